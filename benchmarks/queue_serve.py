"""CPU time of a queue owner's serving loop per message, this tree against another.

No child and no hub: a client thread writes N frames on one end of a socket
pair (unbounded puts, bounded puts that each get a reply, or ``qsize()``
requests) and the owner's ``serve`` reads the other end; what is timed is the
serving thread's CPU time (``time.thread_time``) divided by N, the lowest of 5
runs. On a shared machine this varies far less than a rate does.

``--against DIR`` runs this file in fresh interpreters with ``PYTHONPATH=DIR``
and with this tree's root, alternating (the order flips every round), and
prints the median of each figure for both and their ratio::

    python benchmarks/queue_serve.py --against /path/to/other/checkout --rounds 7
"""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

CASES = {"unbounded puts": ("put", 200_000), "bounded puts": ("bounded", 100_000),
         "qsize requests": ("size", 100_000)}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def per_message(kind: str, n: int) -> float:
    """The serving thread's CPU time per message (us) for one run of ``n`` frames."""
    try:  # the serving side's module; a tree from before it had it in queues.py as _Store, _serve
        serving = importlib.import_module("fiber_core.parallel.queue_serve")
        Store, serve = serving.Store, serving.serve
    except ImportError:
        serving = importlib.import_module("fiber_core.parallel.queues")
        Store, serve = serving._Store, serving._serve
    from fiber_core.wire import messages
    from fiber_core.wire.framing import framed
    from fiber_core.wire.serialize import dumps

    store = Store(0 if kind == "put" else 1 << 40)
    ours, theirs = socket.socketpair()
    if kind == "size":
        frame = framed(messages.QUEUE_SIZE)
    else:
        frame = framed(messages.encode_queue_put(True, None) + dumps(("msg", 42, 3.14)))

    def drain() -> None:
        while theirs.recv(1 << 20):
            pass

    def write() -> None:
        theirs.sendall(frame * n)
        theirs.shutdown(socket.SHUT_WR)

    threads = [threading.Thread(target=drain), threading.Thread(target=write)]
    for t in threads:
        t.start()
    t0 = time.thread_time()
    serve(store, ours)
    dt = time.thread_time() - t0
    for t in threads:
        t.join()
    theirs.close()
    if kind != "size" and len(store.items) != n:
        raise RuntimeError(f"{len(store.items)} items stored of {n}")
    return dt / n * 1e6


def compare(other: str, rounds: int) -> None:
    trees = {"other": other, "this": ROOT}
    res: dict[str, dict[str, list[float]]] = {}
    for r in range(rounds):
        for label, (kind, n) in CASES.items():
            for name in (["other", "this"] if r % 2 == 0 else ["this", "other"]):
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--case", kind,
                                      "--n", str(n)], env=dict(os.environ, PYTHONPATH=trees[name]),
                                     cwd=trees[name],  # jobs run `python -m` there
                                     capture_output=True, text=True, check=True)
                res.setdefault(label, {}).setdefault(name, []).append(float(out.stdout))
    print(f"this = {ROOT}, other = {other}; medians over {rounds} interleaved rounds "
          "(min-max in brackets), us of the owner's CPU per message (lower is better)\n")
    print("| messages | other | this | this / other |\n|---|---:|---:|---:|")
    for label, d in res.items():
        o, t = statistics.median(d["other"]), statistics.median(d["this"])
        print(f"| {label} | {o:.3f} [{min(d['other']):.3f}-{max(d['other']):.3f}] "
              f"| {t:.3f} [{min(d['this']):.3f}-{max(d['this']):.3f}] | {t / o:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", metavar="DIR", help="another tree to compare with")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--case", choices=[k for k, _ in CASES.values()], help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=100_000, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(min(per_message(args.case, args.n) for _ in range(5)))
    elif args.against:
        compare(args.against, args.rounds)
    else:
        for label, (kind, n) in CASES.items():
            print(f"{label}: {min(per_message(kind, n) for _ in range(5)):.3f} us/message")


if __name__ == "__main__":
    main()
