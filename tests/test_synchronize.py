"""Lock, RLock, Semaphore, BoundedSemaphore, Condition, Event and Barrier across real jobs.

Every test that involves jobs runs twice on the local backend: jobs *attached* to the
OS semaphores (what a job on the creator's host does) and jobs *served* by the creator
(what a job on another host or in a container does; forced here with
FIBER_SYNC_SERVED=1). A test on the Docker backend shows the served path taken for real.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import pickle
import signal
import sys
import threading
from pathlib import Path

import pytest
import sync_tasks
from procs import wait_gone

import fiber_core
import fiber_core.synchronize
from fiber_core.parallel.sharing import SERVED_ENV, TOKEN, run_prefix

T = 30.0  # seconds any wait in these tests may take

WT = Path(__file__).resolve().parents[1]


@pytest.fixture(params=["attached", "served"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How the jobs of the test reach the objects the test creates."""
    if request.param == "served":
        monkeypatch.setenv(SERVED_ENV, "1")
    return request.param


def start(target, *args, **kwargs) -> fiber_core.Process:  # noqa: ANN001
    p = fiber_core.Process(target=target, args=args, kwargs=kwargs)
    p.start()
    return p


def joined(*procs: fiber_core.Process) -> list[int | None]:
    for p in procs:
        p.join(T)
    return [p.exitcode for p in procs]


# -- the names ------------------------------------------------------------------------------


def test_names_on_the_module_the_context_and_the_submodule() -> None:
    ctx = fiber_core.get_context()
    for name in ("Lock", "RLock", "Semaphore", "BoundedSemaphore", "Condition", "Event"):
        cls = getattr(fiber_core, name)
        assert isinstance(getattr(ctx, name)(), cls)
        assert getattr(fiber_core.synchronize, name) is cls
    assert isinstance(ctx.Barrier(2), fiber_core.Barrier)
    assert isinstance(fiber_core.get_context("spawn").Lock(), fiber_core.Lock)
    # The stdlib's classes are the bases: code that checks for them keeps working.
    import multiprocessing.synchronize

    assert isinstance(fiber_core.RLock(), multiprocessing.synchronize.RLock)


def test_reprs_like_the_stdlib() -> None:
    lock, rlock = fiber_core.Lock(), fiber_core.RLock()
    assert repr(lock) == "<Lock(owner=None)>"
    with lock:
        assert repr(lock) == "<Lock(owner=MainProcess)>"
    with rlock, rlock:
        assert repr(rlock) == "<RLock(MainProcess, 2)>"
    assert repr(rlock) == "<RLock(None, 0)>"
    assert repr(fiber_core.Semaphore(3)) == "<Semaphore(value=3)>"
    assert repr(fiber_core.BoundedSemaphore(2)) == "<BoundedSemaphore(value=2, maxvalue=2)>"
    assert repr(fiber_core.Condition()) == "<Condition(<RLock(None, 0)>, 0)>"
    event = fiber_core.Event()
    assert repr(event).endswith(" unset>")
    event.set()
    assert repr(event).endswith(" set>")
    assert repr(fiber_core.Barrier(3)).endswith(": waiters=0/3>")


def test_bad_inputs_raise_the_stdlibs_errors() -> None:
    with pytest.raises(OSError) as e:
        fiber_core.Semaphore(-1)
    assert e.value.errno == errno.EINVAL and ">= 0" in str(e.value)
    with pytest.raises(OSError):
        fiber_core.BoundedSemaphore(-2)
    with pytest.raises(ValueError, match="released too many times"):
        fiber_core.Lock().release()
    with pytest.raises(AssertionError, match="not owned"):
        fiber_core.RLock().release()
    bounded = fiber_core.BoundedSemaphore(1)
    with pytest.raises(ValueError, match="released too many times"):
        bounded.release()
    with pytest.raises(AssertionError, match="must acquire"):
        fiber_core.Condition().wait(0)
    with pytest.raises(ValueError, match="parties"):
        fiber_core.Barrier(0)


def test_sessions_speak_the_runs_one_message_vocabulary() -> None:
    from fiber_core.wire import messages

    names = {k.name for k in messages.KINDS}
    assert {"SYNC_HELLO", "SYNC_ACQUIRE", "SYNC_CALL", "SYNC_ACTION"} <= names
    oid, block, timeout = messages.decode_acquire(messages.encode_acquire(7, True, None))
    assert (oid, block, timeout) == (7, True, None)


# -- each primitive across jobs ----------------------------------------------------------------


def test_jobs_take_the_path_the_test_asks_for(path: str) -> None:
    q = fiber_core.Queue()
    objs = (fiber_core.Lock(), fiber_core.RLock(), fiber_core.Semaphore(), fiber_core.Condition(),
            fiber_core.Event(), fiber_core.Barrier(2), fiber_core.Value("i"), fiber_core.RawArray("d", 3))
    p = start(sync_tasks.report_paths, q, *objs)
    paths, where = q.get(timeout=T)
    assert paths == [path] * len(objs)
    assert where == fiber_core.__file__
    assert joined(p) == [0]


def test_a_lock_contended_by_four_jobs_counts_correctly(path: str) -> None:
    lock = fiber_core.Lock()
    counter = fiber_core.RawValue("i", 0)
    n = 300 if path == "attached" else 100
    procs = [start(sync_tasks.count_under_lock, lock, counter, n) for _ in range(4)]
    sync_tasks.count_under_lock(lock, counter, n)  # the creator takes part too
    assert joined(*procs) == [0] * 4
    assert counter.value == 5 * n


def test_event_wakes_a_waiting_job_and_a_job_wakes_the_creator(path: str) -> None:
    event, q = fiber_core.Event(), fiber_core.Queue()
    p = start(sync_tasks.wait_event, event, q)
    assert q.get(timeout=T)[0] == "waiting"
    assert not event.is_set()
    event.set()
    assert q.get(timeout=T) is True
    assert joined(p) == [0]

    event.clear()
    assert not event.is_set()
    p = start(sync_tasks.set_event, event)
    assert event.wait(T) is True
    assert joined(p) == [0]


def test_condition_notify_n_wakes_n_waiters_then_notify_all_the_rest(path: str) -> None:
    cond, arrived, q = fiber_core.Condition(), fiber_core.Semaphore(0), fiber_core.Queue()
    procs = [start(sync_tasks.wait_condition, cond, arrived, q, i) for i in range(3)]
    for _ in range(3):
        assert arrived.acquire(timeout=T)  # each released it holding the lock, then waits
    with cond:
        cond.notify(2)
    woken = {q.get(timeout=T), q.get(timeout=T)}
    assert len(woken) == 2
    # Exactly one still sleeps (the stdlib's count: sleepers minus those woken).
    assert cond._sleeping_count.get_value() - cond._woken_count.get_value() == 1
    assert repr(cond).endswith(", 1)>")
    p = start(sync_tasks.notify_condition, cond, 10)  # notify_all from a job, through its path
    assert {q.get(timeout=T)} | woken == {0, 1, 2}
    assert joined(*procs, p) == [0] * 4


def test_barrier_runs_its_action_once_in_a_party(path: str) -> None:
    q = fiber_core.Queue()
    barrier = fiber_core.Barrier(3, action=functools.partial(sync_tasks.note_action, q))
    procs = [start(sync_tasks.wait_barrier, barrier, q) for _ in range(3)]
    got = [q.get(timeout=T) for _ in range(4)]
    actions = [g for g in got if g[0] == "action"]
    indices = sorted(g[1] for g in got if g[0] == "index")
    assert len(actions) == 1 and indices == [0, 1, 2]
    assert actions[0][1] in {p.name for p in procs}  # the last party ran it, in its own process
    assert joined(*procs) == [0] * 3
    assert barrier.parties == 3 and barrier.n_waiting == 0 and not barrier.broken


def test_barrier_abort_breaks_it_for_every_party_and_reset_mends_it(path: str) -> None:
    q = fiber_core.Queue()
    barrier = fiber_core.Barrier(3)
    p = start(sync_tasks.wait_barrier, barrier, q)
    barrier.abort()  # before or during the job's wait: either way it finds the barrier broken
    assert q.get(timeout=T)[0] == "broken"
    assert barrier.broken
    with pytest.raises(threading.BrokenBarrierError):
        barrier.wait(T)
    barrier.reset()
    assert not barrier.broken
    procs = [start(sync_tasks.wait_barrier, barrier, q) for _ in range(2)]
    index = barrier.wait(T)
    others = sorted(q.get(timeout=T)[1] for _ in range(2))
    assert sorted([index, *others]) == [0, 1, 2]
    assert joined(p, *procs) == [0] * 3


def test_a_failing_action_breaks_the_barrier(path: str) -> None:
    q = fiber_core.Queue()
    barrier = fiber_core.Barrier(1, action=sync_tasks.fail_action)
    p = start(sync_tasks.wait_barrier, barrier, q)
    kind, detail, _ = q.get(timeout=T)
    assert (kind, detail) == ("error", "ValueError: the action failed")
    assert barrier.broken
    assert joined(p) == [0]


def test_rlock_recursion_in_a_job_and_release_by_a_non_owner(path: str) -> None:
    rlock, q = fiber_core.RLock(), fiber_core.Queue()
    p = start(sync_tasks.rlock_recursion, rlock, q)
    inner, mid, after = q.get(timeout=T)
    assert inner == f"<RLock({p.name}, 2)>" and mid == f"<RLock({p.name}, 1)>"
    assert after == "<RLock(None, 0)>"
    assert joined(p) == [0]

    # A job holds it: the creator is not the owner.
    held, done = fiber_core.Event(), fiber_core.Event()
    p = start(sync_tasks.hold, rlock, held, done, 2)
    assert held.wait(T)
    with pytest.raises(AssertionError, match="not owned"):
        rlock.release()
    assert not rlock.acquire(False)
    done.set()
    assert joined(p) == [0]

    # The creator holds it: a job is not the owner.
    with rlock:
        p = start(sync_tasks.try_release, rlock, q)
        assert q.get(timeout=T) == ("AssertionError",
                                    "attempt to release recursive lock not owned by thread")
        assert joined(p) == [0]
        assert repr(rlock) == "<RLock(MainProcess, 1)>"


def test_a_lock_may_be_released_by_another_process_as_in_multiprocessing(path: str) -> None:
    lock, q = fiber_core.Lock(), fiber_core.Queue()
    lock.acquire()
    p = start(sync_tasks.try_release, lock, q)
    assert q.get(timeout=T) == ("released", "")
    assert joined(p) == [0]
    p = start(sync_tasks.try_release, lock, q)  # now it is free: too many releases
    assert q.get(timeout=T) == ("ValueError", "semaphore or lock released too many times")
    assert joined(p) == [0]


def test_semaphore_values_and_bounded_over_release(path: str) -> None:
    sem, bounded, q = fiber_core.Semaphore(2), fiber_core.BoundedSemaphore(1), fiber_core.Queue()
    p = start(sync_tasks.semaphore_steps, sem, bounded, q)
    assert q.get(timeout=T) == ("after two acquires", 0, False)
    assert q.get(timeout=T) == ("bounded", "ValueError: semaphore or lock released too many times")
    assert joined(p) == [0]
    assert sem.get_value() == 1 and bounded.get_value() == 1


def test_timeouts_give_up_in_jobs(path: str) -> None:
    lock, event, cond = fiber_core.Lock(), fiber_core.Event(), fiber_core.Condition()
    sem, barrier, q = fiber_core.Semaphore(0), fiber_core.Barrier(2), fiber_core.Queue()
    with lock:
        p = start(sync_tasks.timeouts, lock, event, cond, sem, barrier, q)
        assert q.get(timeout=T) == (False, False, False, False, True, True)
    assert joined(p) == [0]
    # And here, on the same objects.
    assert lock.acquire(timeout=0.05) is True
    assert event.wait(0.01) is False
    with cond:
        assert cond.wait(0.01) is False
    assert sem.acquire(timeout=0.01) is False


# -- travelling ------------------------------------------------------------------------------


def test_objects_travel_through_queues_and_pools_and_come_back_as_themselves(path: str) -> None:
    lock, arr, q, inbox = fiber_core.Lock(), fiber_core.Array("i", 4), fiber_core.Queue(), fiber_core.Queue()
    p = start(sync_tasks.put_back, q, lock)
    assert q.get(timeout=T) is lock  # back in its creator: the same object
    p2 = start(sync_tasks.same_objects, lock, lock, q)
    assert q.get(timeout=T) is True
    inbox.put((lock, arr))
    p3 = start(sync_tasks.use_from_queue, inbox, q)
    assert q.get(timeout=T) == path
    assert arr[0] == 1
    assert joined(p, p2, p3) == [0] * 3
    assert pickle.loads(pickle.dumps(lock)) is lock

    with fiber_core.Pool(2, initializer=sync_tasks.pool_init, initargs=(lock, arr)) as pool:
        assert pool.map(sync_tasks.pool_add, range(8)) == list(range(8))
        value = fiber_core.Value("i", 0)
        assert set(pool.map(sync_tasks.pool_task, [(value, 50)] * 4)) == {path}
    assert arr[:] == [3, 2, 2, 2]
    assert value.value == 200


# -- lost holders -----------------------------------------------------------------------------


def test_served_holds_of_a_killed_job_are_released_with_a_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(SERVED_ENV, "1")
    lock, rlock, bounded = fiber_core.Lock(), fiber_core.RLock(), fiber_core.BoundedSemaphore(2)
    cond, sem = fiber_core.Condition(fiber_core.Lock()), fiber_core.Semaphore(1)
    held = fiber_core.Event()
    p = start(sync_tasks.hold_forever, [lock, rlock, rlock, bounded, cond, sem], held)
    assert held.wait(T)
    assert not lock.acquire(False) and bounded.get_value() == 1 and sem.get_value() == 0
    caplog.set_level(logging.WARNING, logger="fiber")
    p.kill()
    # The creator sees the job's connection end and releases what it held for it.
    assert lock.acquire(timeout=T)
    assert rlock.acquire(timeout=T)
    assert cond.acquire(timeout=T)
    assert bounded.get_value() == 2
    assert sem.get_value() == 0  # a Semaphore's acquisitions may be consumed signals: kept
    assert joined(p) == [-signal.SIGKILL]
    # One warning, logged before anything was released.
    warned = [r.getMessage() for r in caplog.records if "ended while it held" in r.getMessage()]
    assert len(warned) == 1 and p.name in warned[0]
    assert ("held a Lock, an RLock (2 levels), 1 unit(s) of a BoundedSemaphore, "
            "the lock of a Condition; releasing") in warned[0]


def test_a_waiting_job_that_is_killed_takes_nothing_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SERVED_ENV, "1")
    sem, q = fiber_core.Semaphore(0), fiber_core.Queue()
    event = fiber_core.Event()
    p = start(sync_tasks.wait_event, event, q)
    assert q.get(timeout=T)[0] == "waiting"
    started = fiber_core.Event()
    waiter = start(sync_tasks.block_on, sem, started)
    assert started.wait(T)
    p.kill()
    waiter.kill()
    assert joined(p, waiter) == [-signal.SIGKILL] * 2
    sem.release()  # the killed job's abandoned acquire does not take it (or gives it back)
    assert sem.acquire(timeout=T)
    assert sem.get_value() == 0


def test_a_same_host_lock_held_by_a_killed_job_stays_held_as_in_multiprocessing() -> None:
    lock, held = fiber_core.Lock(), fiber_core.Event()
    p = start(sync_tasks.hold_forever, [lock], held)
    assert held.wait(T)
    p.kill()
    assert joined(p) == [-signal.SIGKILL]
    assert lock.acquire(timeout=0.2) is False  # the OS semaphore is still taken
    lock.release()  # a Lock (not an RLock) may be released by any process
    assert lock.acquire(timeout=T)


# -- cleanup --------------------------------------------------------------------------------


def _leftovers(run_id: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if run_prefix(run_id) in n)


CLEANUP = """
import os, signal, sys
import fiber_core
import sync_tasks
from fiber_core.parallel import sharing
from fiber_core.runtime.run import runtime


def make(q):
    # A job that creates its own objects, drops some, and exits (os._exit: no atexit).
    global kept
    kept = fiber_core.Lock(), fiber_core.Array("d", 8)
    fiber_core.Event()
    q.put(sync_tasks.path_of(kept[0]))

def killed_creator(q):
    # Killed with its process group: its tracker, in a session of its own, survives.
    keep = [fiber_core.Lock(), fiber_core.RawArray("i", 4), fiber_core.Barrier(2)]
    q.put(sharing._tracker.tracker_pid)
    signal.pause()

if __name__ == "__main__":
    print(runtime().run_id, flush=True)
    objs = [fiber_core.Lock(), fiber_core.RLock(), fiber_core.Semaphore(2), fiber_core.Condition(),
            fiber_core.Event(), fiber_core.Barrier(2), fiber_core.Value("i"), fiber_core.Array("d", 4),
            fiber_core.RawValue("d"), fiber_core.RawArray("b", 16)]
    q = fiber_core.Queue()
    if sys.argv[1:] == ["kill-myself"]:
        print(sharing._tracker.tracker_pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(2):  # the second job attaches after the first one exited: nothing was removed
        p = fiber_core.Process(target=sync_tasks.report_paths, args=(q, *objs))
        p.start()
        print(*sorted(set(q.get()[0])), flush=True)
        p.join()
    p = fiber_core.Process(target=make, args=(q,))
    p.start()
    print(q.get(), flush=True)
    p.join()
    p = fiber_core.Process(target=killed_creator, args=(q,))
    p.start()
    print(q.get(), flush=True)
    p.kill()
    p.join()
"""



@pytest.mark.parametrize("end", ["exit", "kill-myself"])
def test_no_segment_or_semaphore_outlives_the_run(run_script, tmp_path: Path, end: str,  # noqa: ANN001
                                                  own_tmpdir: str) -> None:
    (tmp_path / "sync_tasks.py").write_text(Path(sync_tasks.__file__).read_text())
    result = run_script(CLEANUP.replace("sys.argv[1:]", repr([end])),
                        env={"PYTHONPATH": os.pathsep.join([str(WT), str(tmp_path)]),
                             "TMPDIR": own_tmpdir})  # it may kill itself
    lines = result.stdout.split()
    run_id = lines[0]
    if end == "exit":
        assert result.returncode == 0, result.stderr
        assert lines[1:4] == ["attached"] * 3
        assert "leaked" not in result.stderr  # nothing to say about a job's exit
        wait_gone(int(lines[4]))  # the killed job's tracker removes what it created
    else:
        assert result.returncode == -signal.SIGKILL, result.stderr
        wait_gone(int(lines[1]))  # the killed creator's tracker removes what it created
    assert _leftovers(run_id) == []


def test_objects_are_removed_when_their_creator_drops_them() -> None:
    import gc

    lock, cond, barrier, arr = (fiber_core.Lock(), fiber_core.Condition(), fiber_core.Barrier(2),
                                fiber_core.Array("i", 3))
    sems = [lock, cond._lock, cond._sleeping_count, cond._woken_count, cond._wait_semaphore,
            barrier._cond._lock]
    names = {"sem." + s._semlock.name[1:] for s in sems}
    names |= {barrier._segment.name[1:], arr.get_obj().fiber_segment.name[1:]}
    assert names <= set(os.listdir("/dev/shm"))
    del lock, cond, barrier, arr, sems
    gc.collect()
    assert not names & set(os.listdir("/dev/shm"))


# -- the Docker backend: the served path for real ---------------------------------------------


@pytest.fixture
def docker_backend(monkeypatch: pytest.MonkeyPatch) -> str:
    """The test Docker daemon and image; jobs run this worktree's fiber_core (mounted cwd)."""
    sys.path.insert(0, str(WT / "plugins" / "fiber_docker" / "tests"))
    try:
        from docker_service import IMAGE, docker_host
    finally:
        sys.path.pop(0)
    monkeypatch.setenv("DOCKER_HOST", docker_host())
    monkeypatch.chdir(WT)  # mounted at the same path: `python -m` there imports this fiber_core
    return IMAGE


def test_a_docker_job_uses_a_lock_an_event_and_an_array_through_the_creator(docker_backend: str) -> None:
    lock, counter, q = fiber_core.Lock(), fiber_core.RawValue("i", 0), fiber_core.Queue()
    event, arr, value = fiber_core.Event(), fiber_core.Array("d", 4), fiber_core.Value("i", 1)

    def docker(target, *args) -> fiber_core.Process:  # noqa: ANN001
        p = fiber_core.Process(target=target, args=args, backend="docker", image=docker_backend)
        p.start()
        return p

    p = docker(sync_tasks.report_paths, q, lock, event, arr)
    paths, where = q.get(timeout=120)
    assert paths == ["served"] * 3  # the container has its own /dev/shm
    assert where == str(WT / "fiber_core" / "__init__.py")
    p2 = docker(sync_tasks.count_under_lock, lock, counter, 50)
    sync_tasks.count_under_lock(lock, counter, 50)
    p3 = docker(sync_tasks.wait_event, event, q)
    assert q.get(timeout=120)[0] == "waiting"
    event.set()
    assert q.get(timeout=T) is True
    p4 = docker(sync_tasks.write_elements, arr, value, q)
    seen, length, total, refused = q.get(timeout=120)
    assert seen == [10.0, 20.0, 30.0, 40.0] and length == 4 and total == 6
    assert refused.startswith("SharedBufferError: this shared c_double_Array_4 is served by its creator")
    assert joined(p, p2, p3, p4) == [0] * 4
    assert counter.value == 100
    assert arr[:] == [10.0, 20.0, 30.0, 40.0] and value.value == 6


def test_docker_jobs_sharing_this_machines_ipc_attach_and_see_the_memory(
        docker_backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FIBER_DOCKER_IPC_MODE", "host")
    lock, q, arr = fiber_core.Lock(), fiber_core.Queue(), fiber_core.Array("d", 4)
    p = fiber_core.Process(target=sync_tasks.report_paths, args=(q, lock, arr), backend="docker",
                           image=docker_backend)
    p.start()
    paths, _ = q.get(timeout=120)
    assert paths == ["attached"] * 2
    p2 = fiber_core.Process(target=sync_tasks.write_through_buffer, args=(arr, q), backend="docker",
                            image=docker_backend)
    p2.start()
    assert q.get(timeout=120) == "written"
    assert arr[:] == [1.0, 2.0, 3.0, 4.0]  # written in the container, through its numpy view
    assert joined(p, p2) == [0, 0]


def test_the_creator_token_is_this_process() -> None:
    lock = fiber_core.Lock()
    from fiber_core.parallel.sharing import ref_for_pickle

    assert ref_for_pickle(lock).token == TOKEN


def test_the_ref_record_type_checkers_see_is_the_one_pickles_carry() -> None:
    # sharing.py declares Ref twice: a typing.NamedTuple for type checkers, and at run time a
    # collections.namedtuple (the template then starts without typing). Both must agree.
    from declared import declared_fields

    from fiber_core.parallel import sharing

    assert declared_fields(sharing, "Ref") == sharing.Ref._fields == ("token", "host", "addresses", "oid", "uid")
    ref = sharing.Ref("t", "h", "a", 7)
    assert ref.uid == sharing.UID == os.geteuid()  # the default, as declared
    assert pickle.loads(pickle.dumps(ref)) == ref and ref._replace(addresses="b").addresses == "b"
    assert type(ref).__module__ == "fiber_core.parallel.sharing"

