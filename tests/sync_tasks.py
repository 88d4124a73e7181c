"""What the synchronization tests run in jobs: stdlib and fiber_core only (containers import it too).

Each function reports to the test through a Queue; none sleeps to synchronise.
"""

from __future__ import annotations

import os
import threading
from typing import Any


def path_of(obj: Any) -> str:
    """``attached`` when the object uses this host's OS objects here, else ``served``."""
    if getattr(obj, "_remote", None) is not None:
        return "served"
    semlock = getattr(obj, "_semlock", None)
    if semlock is not None:
        return "served" if type(semlock).__name__ == "_RemoteSemLock" else "attached"
    inner = getattr(obj, "_obj", obj)
    return "served" if type(inner).__name__ == "ServedCtypes" else "attached"


def report_paths(q: Any, *objs: Any) -> None:
    import fiber_core

    q.put(([path_of(o) for o in objs], fiber_core.__file__))


def count_under_lock(lock: Any, counter: Any, n: int) -> None:
    """``n`` increments of a raw shared value, each under ``lock`` (not atomic without it)."""
    for _ in range(n):
        with lock:
            counter.value += 1


def increment_value(value: Any, n: int) -> None:
    """``n`` increments of a synchronized Value under its own lock."""
    for _ in range(n):
        with value.get_lock():
            value.value += 1


def wait_event(event: Any, q: Any, timeout: float | None = None) -> None:
    q.put(("waiting", os.getpid()))
    q.put(event.wait(timeout))


def set_event(event: Any) -> None:
    event.set()


def wait_condition(cond: Any, arrived: Any, q: Any, i: int) -> None:
    with cond:
        arrived.release()
        cond.wait()
        q.put(i)


def notify_condition(cond: Any, n: int) -> None:
    with cond:
        cond.notify(n)


def note_action(q: Any) -> None:
    """A Barrier action: which process ran it."""
    import fiber_core

    q.put(("action", fiber_core.current_process().name))


def fail_action() -> None:
    raise ValueError("the action failed")


def wait_barrier(barrier: Any, q: Any, timeout: float | None = None) -> None:
    import fiber_core

    try:
        q.put(("index", barrier.wait(timeout), fiber_core.current_process().name))
    except threading.BrokenBarrierError:
        q.put(("broken", None, fiber_core.current_process().name))
    except Exception as e:
        q.put(("error", f"{type(e).__name__}: {e}", fiber_core.current_process().name))


def hold(lock: Any, held: Any, done: Any, times: int = 1) -> None:
    """Acquire ``lock`` ``times`` times (an RLock recursively), say so, release when told."""
    for _ in range(times):
        lock.acquire()
    held.set()
    done.wait()
    for _ in range(times):
        lock.release()


def hold_forever(objs: list, held: Any) -> None:
    """Take each object (a lock, a semaphore unit, a condition), say so, and never let go."""
    for obj in objs:
        obj.acquire()
    held.set()
    threading.Event().wait()


def block_on(sem: Any, started: Any) -> None:
    """Say so, then wait for a unit of ``sem`` (the test kills this job meanwhile)."""
    started.set()
    sem.acquire()


def try_release(lock: Any, q: Any) -> None:
    """Release a lock this process does not hold: report the error's type and message."""
    try:
        lock.release()
        q.put(("released", ""))
    except Exception as e:
        q.put((type(e).__name__, str(e)))


def rlock_recursion(rlock: Any, q: Any) -> None:
    with rlock:
        with rlock:
            inner = repr(rlock)
        mid = repr(rlock)
    q.put((inner, mid, repr(rlock)))


def semaphore_steps(sem: Any, bounded: Any, q: Any) -> None:
    sem.acquire()
    sem.acquire()
    q.put(("after two acquires", sem.get_value(), sem.acquire(False)))
    sem.release()
    try:
        bounded.release()
        q.put(("bounded", "released"))
    except ValueError as e:
        q.put(("bounded", f"ValueError: {e}"))


def timeouts(lock: Any, event: Any, cond: Any, sem: Any, barrier: Any, q: Any) -> None:
    """Every blocking call with a timeout, where it cannot succeed: each gives up."""
    got = lock.acquire(timeout=0.2)
    waited = event.wait(0.2)
    with cond:
        notified = cond.wait(0.2)
    sem_got = sem.acquire(True, 0.2)
    try:
        barrier.wait(0.2)
        broke = False
    except threading.BrokenBarrierError:
        broke = True
    q.put((got, waited, notified, sem_got, broke, barrier.broken))


def write_with_numpy(arr: Any, raw: Any, start: int, stop: int, q: Any) -> None:
    """Write a slice through numpy views of the shared memory; report what this job sees."""
    import numpy as np

    view = np.frombuffer(arr.get_obj(), dtype=np.float64)
    view[start:stop] = np.arange(start, stop, dtype=np.float64) + 1
    rview = np.frombuffer(raw, dtype=np.int32)
    with arr.get_lock():
        rview[start:stop] += 1
    q.put((float(view.sum()), int(rview.sum())))


def write_elements(arr: Any, value: Any, q: Any) -> None:
    """What a job on the served path can do with an Array and a Value, and what it cannot."""
    arr[0] = 10.0
    arr[1:3] = [20.0, 30.0]
    with arr.get_lock():
        arr[3] = arr[0] + arr[2]
    with value.get_lock():
        value.value += 5
    try:
        arr.get_obj()
        refused = ""
    except BufferError as e:
        refused = f"{type(e).__name__}: {e}"
    q.put((arr[:], len(arr), value.value, refused))


def put_back(q: Any, obj: Any) -> None:
    q.put(obj)


def same_objects(a: Any, b: Any, q: Any) -> None:
    q.put(a is b)


def use_from_queue(inbox: Any, q: Any) -> None:
    lock, arr = inbox.get()
    with lock:
        arr[0] += 1
    q.put(path_of(lock))


_pool_state: dict = {}


def pool_init(lock: Any, arr: Any) -> None:
    _pool_state["lock"], _pool_state["arr"] = lock, arr


def pool_add(i: int) -> int:
    lock, arr = _pool_state["lock"], _pool_state["arr"]
    with lock:
        arr[i % len(arr)] += 1
    return i


def pool_task(args: tuple) -> str:
    value, n = args
    for _ in range(n):
        with value.get_lock():
            value.value += 1
    return path_of(value)


def write_through_buffer(arr: Any, q: Any) -> None:
    """Write every element through numpy's view of the Array's own memory (attached path only)."""
    import numpy as np

    view = np.frombuffer(arr.get_obj(), dtype=np.float64)
    with arr.get_lock():
        view[:] = np.arange(1.0, len(view) + 1.0)
    q.put("written")
