"""Round-trip latency of a remote ``step()`` call: Fiber managers vs multiprocessing's.

    python benchmarks/managers.py [--calls 2000] [--reps 5] [--envs 8]

Both managers serve the same ``Env`` class from a separate process. Measured,
interleaved per repetition (the order alternating), medians over repetitions of
the mean time per call:

* sync: one ``env.step(a)`` at a time (stdlib proxy vs Fiber's SyncManager-style proxy);
* async 1: ``env.step(a).get()`` one at a time through an ``AsyncManager`` proxy;
* async N: N envs stepped at once (handles collected after all calls were sent),
  against the stdlib stepping the same N envs one after the other.
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.managers
import statistics
import sys
import time

import fiber_core
from fiber_core.managers import AsyncManager, BaseManager


class Env:
    """A stand-in simulator: a tiny state update per step."""

    def __init__(self) -> None:
        self.t = 0

    def step(self, action: int) -> tuple[int, float]:
        self.t += 1
        return self.t, float(action) * 0.5


class StdManager(multiprocessing.managers.BaseManager):
    pass


class FiberSyncManager(BaseManager):
    pass


class FiberAsyncManager(AsyncManager):
    pass


StdManager.register("Env", Env)
FiberSyncManager.register("Env", Env)
FiberAsyncManager.register("Env", Env)


def per_call_us(fn, calls: int) -> float:  # noqa: ANN001
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--envs", type=int, default=8)
    args = parser.parse_args()

    ctx = multiprocessing.get_context("spawn")
    std = StdManager(ctx=ctx)
    std.start()
    fsync = FiberSyncManager()
    fsync.start()
    fasync = FiberAsyncManager()
    fasync.start()
    try:
        s_env, f_env, a_env = std.Env(), fsync.Env(), fasync.Env()
        s_envs = [std.Env() for _ in range(args.envs)]
        a_envs = [fasync.Env() for _ in range(args.envs)]
        rows: dict[str, list[float]] = {k: [] for k in
                                        ("std sync", "fiber sync", "fiber async 1",
                                         "std N sequential", "fiber async N")}
        rounds = max(1, args.calls // args.envs)
        cases = [
            ("std sync", lambda: per_call_us(s_env.step, args.calls)),
            ("fiber sync", lambda: per_call_us(f_env.step, args.calls)),
            ("fiber async 1", lambda: per_call_us(lambda i: a_env.step(i).get(), args.calls)),
            ("std N sequential", lambda: per_call_us(
                lambda i: [e.step(i) for e in s_envs], rounds) / args.envs),
            ("fiber async N", lambda: per_call_us(
                lambda i: [h.get() for h in [e.step(i) for e in a_envs]], rounds) / args.envs),
        ]
        for rep in range(args.reps):
            # Alternate the order, so that neither library always goes first.
            for name, measure in cases if rep % 2 == 0 else reversed(cases):
                rows[name].append(measure())
    finally:
        fasync.shutdown()
        fsync.shutdown()
        std.shutdown()

    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"command: {' '.join([sys.executable.rsplit('/', 1)[-1], *sys.argv])}")
    print(f"python {sys.version.split()[0]}, fiber-core {fiber_core.__version__}, "
          f"{args.reps} interleaved repetitions, medians\n")
    print("| remote step() | fiber (us/call) | multiprocessing (us/call) | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| one call at a time, sync proxy | {med['fiber sync']:.0f} | {med['std sync']:.0f} | "
          f"{med['fiber sync'] / med['std sync']:.2f} |")
    print(f"| one call at a time, AsyncManager `.get()` | {med['fiber async 1']:.0f} | "
          f"{med['std sync']:.0f} | {med['fiber async 1'] / med['std sync']:.2f} |")
    print(f"| {args.envs} envs per step, AsyncManager vs sequential | {med['fiber async N']:.0f} | "
          f"{med['std N sequential']:.0f} | {med['fiber async N'] / med['std N sequential']:.2f} |")


if __name__ == "__main__":
    main()
