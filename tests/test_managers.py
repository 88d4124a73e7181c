"""Managers, proxies, AsyncManager, Ring and meta, with real jobs on the local backend."""

from __future__ import annotations

import functools
import os
import threading
import time

import pytest

import fiber_core as mp
from fiber_core.contract.backend import JobSpec
from fiber_core.managers import AsyncManager, BaseManager, SyncManager


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.n = start

    def add(self, k: int) -> int:
        self.n += k
        return self.n

    def fail(self) -> None:
        raise KeyError("no such thing")


class CounterManager(BaseManager):
    pass


CounterManager.register("Counter", Counter)


class EnvManager(AsyncManager):
    pass


EnvManager.register("Counter", Counter)


def _use_everything(d, lst, ns, value, array, q, lock, event, sem, barrier, counter) -> None:  # noqa: ANN001
    d["child"] = os.getpid()
    lst.append("from child")
    ns.flag = True
    with value.get_lock() if hasattr(value, "get_lock") else lock:
        value.value += 1
    array[0] = 42
    q.put("queued")
    with lock:
        pass
    event.set()
    sem.acquire()
    sem.release()
    barrier.wait(timeout=30)
    counter.add(5)


@pytest.fixture
def manager():
    with mp.Manager() as m:
        yield m


def test_every_registered_type_across_processes(manager: SyncManager) -> None:
    d, lst, ns = manager.dict(), manager.list(), manager.Namespace()
    value, array = manager.Value("i", 0), manager.Array("i", [0, 0])
    q, lock, event = manager.Queue(), manager.Lock(), manager.Event()
    sem, barrier = manager.BoundedSemaphore(1), manager.Barrier(2)
    with CounterManager() as cm:
        counter = cm.Counter()
        p = mp.Process(target=_use_everything,
                       args=(d, lst, ns, value, array, q, lock, event, sem, barrier, counter))
        p.start()
        barrier.wait(timeout=30)
        p.join(30)
        assert p.exitcode == 0
        assert d["child"] != os.getpid()
        assert list(lst) == ["from child"]
        assert ns.flag is True
        assert value.value == 1 and array[0] == 42
        assert q.get(timeout=5) == "queued"
        assert event.is_set()
        assert counter.add(0) == 5
    for factory in (manager.RLock, manager.Semaphore, manager.Condition, manager.JoinableQueue):
        assert factory() is not None


def test_manager_pool_is_a_fiber_pool(manager: SyncManager) -> None:
    pool = manager.Pool(2)
    try:
        assert pool.map(abs, [-1, -2, 3]) == [1, 2, 3]
    finally:
        pool.terminate()


def test_proxy_passed_to_grandchild(manager: SyncManager) -> None:
    d = manager.dict()

    def grandchild(shared) -> None:  # noqa: ANN001
        shared["depth"] = 2

    def child(shared) -> None:  # noqa: ANN001
        p = mp.Process(target=grandchild, args=(shared,))
        p.start()
        p.join()
        shared["child_saw"] = p.exitcode

    p = mp.Process(target=child, args=(d,))
    p.start()
    p.join(60)
    assert dict(d) == {"depth": 2, "child_saw": 0}


def test_remote_exception_reraised() -> None:
    with CounterManager() as cm:
        c = cm.Counter(1)
        with pytest.raises(KeyError, match="no such thing"):
            c.fail()
        assert c.add(1) == 2


def test_shutdown_leaves_no_process() -> None:
    m = CounterManager()
    m.start()
    proc = m._process
    pid = proc.pid
    m.shutdown()
    assert not proc.is_alive()
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_bad_inputs() -> None:
    with pytest.raises(TypeError, match="not callable"):
        CounterManager.register("Bad", 42)
    with CounterManager() as cm:
        c = cm.Counter()
        with pytest.raises(AttributeError):
            c.no_such_method()
        address = cm.address
    # The manager is gone: a new proxy call fails at once instead of hanging.
    with pytest.raises(Exception) as info:
        c.add(1)
    assert isinstance(info.value, (OSError, EOFError, mp.ProcessError))
    assert address


def test_async_handles_out_of_order_and_from_threads() -> None:
    with EnvManager() as em:
        envs = [em.Counter(10 * i) for i in range(4)]
        first = [e.add(1) for e in envs]
        second = [e.add(2) for e in envs]
        assert [h.get(30) for h in reversed(second)] == [33, 23, 13, 3]
        assert [h.get(30) for h in first] == [1, 11, 21, 31]
        with pytest.raises(KeyError):
            envs[0].fail().get(30)
        results: dict[int, list[int]] = {}

        def drive(i: int) -> None:
            handles = [envs[i].add(1) for _ in range(50)]
            results[i] = [h.get(30) for h in handles]

        threads = [threading.Thread(target=drive, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for i in range(4):
            start = 10 * i + 3
            assert results[i] == list(range(start + 1, start + 51))


def test_async_handle_turns_ready_while_only_polled() -> None:
    with EnvManager() as em:
        handle = em.Counter(41).add(1)
        deadline = time.monotonic() + 30
        while not handle.ready():  # nothing else reads the reply
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert handle.get(0) == 42


def test_async_handle_timeout() -> None:
    with EnvManager() as em:
        env = em.Counter()
        handle = env.add(1)
        assert handle.get(30) == 1
        slow = mp.managers.AsyncHandle()
        with pytest.raises(mp.TimeoutError):
            slow.get(0.01)


def _ring_member(rank: int, size: int, out) -> None:  # noqa: ANN001
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    assert dist.get_rank() == rank and dist.get_world_size() == size
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    out.put((rank, t.item()))
    dist.destroy_process_group()


def test_ring_torch_allreduce() -> None:
    pytest.importorskip("torch")
    out = mp.Queue()
    mp.Ring(3, lambda rank, size: _ring_member(rank, size, out)).run()
    assert sorted(out.get(timeout=30) for _ in range(3)) == [(0, 6.0), (1, 6.0), (2, 6.0)]


def test_a_gang_ring_starts_its_members_together() -> None:
    out = mp.Queue()
    ring = mp.Ring(3, lambda rank, size: out.put((rank, size)), gang=True, gang_timeout=60)
    ring.start()
    # start() returned once every member ran: each is connected to this process
    assert all(p._run is not None and p._run.connected.is_set() for p in ring.members)
    ring.join()
    assert sorted(out.get(timeout=30) for _ in range(3)) == [(0, 3), (1, 3), (2, 3)]
    with pytest.raises(ValueError, match="gang_timeout must be a number of seconds above 0"):
        mp.Ring(2, abs, gang=True, gang_timeout=0)


def _cannot_be_rebuilt() -> None:
    raise RuntimeError("this argument cannot be rebuilt in a job")


class _Unloadable:
    """Pickles here; fails to unpickle in the job, so every member ends before the gang starts."""

    def __reduce__(self) -> tuple:
        return _cannot_be_rebuilt, ()


def test_a_gang_ring_whose_member_ends_before_it_starts_fails_at_once() -> None:
    from fiber_core.parallel.ring import RingError

    ring = mp.Ring(2, functools.partial(_put_rank, _Unloadable()), gang=True, gang_timeout=3600)
    with pytest.raises(RingError, match=r"ring member \d \(Ring-\d\) exited with code 1 before the ring started"):
        ring.start()  # not after gang_timeout: the pytest timeout fails a wait that long


def _put_rank(what: object, rank: int, size: int) -> None:
    pass


def test_ring_member_failure_stops_the_others() -> None:
    from fiber_core.parallel.ring import RingError

    def member(rank: int, size: int) -> None:
        import time

        if rank == 1:
            raise SystemExit(3)
        time.sleep(120)

    with pytest.raises(RingError) as info:
        mp.Ring(3, member).run()
    assert info.value.rank == 1 and info.value.exitcode == 3


def test_meta_reaches_jobspec() -> None:
    from fiber_core.backends import local
    from fiber_core.contract.hookspecs import hookimpl
    from fiber_core.runtime.config import plugins

    seen: list[JobSpec] = []

    class Recording(local.LocalBackend):
        name = "recording"

        def create_job(self, spec: JobSpec):  # noqa: ANN201
            seen.append(spec)
            return super().create_job(spec)

    class Plugin:
        @hookimpl
        def fiber_register_backends(self, register) -> None:  # noqa: ANN001
            register(Recording)

    plugins().register_plugin(Plugin(), name="recording-test")

    @mp.meta(cpu=2, memory=512, gpu=1, gpu_type="a10g")
    def task() -> None:
        pass

    p = mp.Process(target=task, backend="recording")
    p.start()
    p.join(30)
    pool = mp.Pool(1, backend="recording", cpu=0.5, gpu=2, gpu_type="v100")
    try:
        assert pool.apply(abs, (-3,)) == 3
    finally:
        pool.terminate()
    assert (seen[0].cpu, seen[0].memory, seen[0].gpu, seen[0].gpu_type) == (2, 512, 1, "a10g")
    assert (seen[1].cpu, seen[1].gpu, seen[1].gpu_type) == (0.5, 2, "v100")
    with pytest.raises(ValueError):
        mp.meta(cpu=-1)


def test_shared_memory_manager_unlinks_its_blocks_at_shutdown() -> None:
    from multiprocessing import shared_memory

    from fiber_core.managers import SharedMemoryManager

    smm = SharedMemoryManager()
    with pytest.raises(ValueError):
        smm.SharedMemory(size=16)  # not started: nowhere to track the block
    smm.start()
    listed = smm.ShareableList(range(5))
    block = smm.SharedMemory(size=64)
    names = [listed.shm.name, block.name]
    view = shared_memory.SharedMemory(name=block.name)
    assert view.size >= 64
    view.close()
    listed.shm.close()
    block.close()
    smm.shutdown()
    for name in names:
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=name)
    with SharedMemoryManager() as smm2:
        name = smm2.ShareableList("howdy").shm.name
    with pytest.raises(FileNotFoundError):
        shared_memory.ShareableList(name=name)


def _put_through(address, authkey, serializer: str = "pickle") -> None:  # noqa: ANN001
    manager = _QueueManager(address=address, authkey=authkey, serializer=serializer)
    manager.connect()
    manager.get_queue().put("from a job")


class _QueueManager(BaseManager):
    pass


_QUEUE = None


def _the_queue():  # noqa: ANN202
    global _QUEUE
    if _QUEUE is None:
        import queue

        _QUEUE = queue.Queue()
    return _QUEUE


_QueueManager.register("get_queue", callable=_the_queue)


def test_get_server_serves_jobs_from_this_process() -> None:
    authkey = os.urandom(32)
    server = _QueueManager(address=("127.0.0.1", 0), authkey=authkey).get_server()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    p = mp.Process(target=_put_through, args=(server.address, authkey))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    assert _the_queue().get(timeout=30) == "from a job"


def test_a_started_server_speaks_xmlrpc_when_asked() -> None:
    authkey = os.urandom(32)
    manager = _QueueManager(address=("127.0.0.1", 0), authkey=authkey, serializer="xmlrpclib")
    manager.start()
    try:
        p = mp.Process(target=_put_through, args=(manager.address, authkey, "xmlrpclib"))
        p.start()
        p.join(30)
        assert p.exitcode == 0
        assert manager.get_queue().get(timeout=30) == "from a job"
    finally:
        manager.shutdown()
