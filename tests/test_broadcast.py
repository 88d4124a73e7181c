"""Broadcast on the local backend: versions in order, one shared segment per host, fetches
counted, memory released however the program ends, a reader killed mid-fetch harmless.

"Another host" here is a job that sets ``FIBER_JOB_HOST`` as a remote backend would: it
uses a directory of its own and fetches over a real authenticated socket; the SSH
plugin's tests do the same across real hosts.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys

import broadcast_tasks as tasks
import numpy as np
import pytest
from procs import wait_until

import fiber_core
from fiber_core.base.errors import FiberError
from fiber_core.parallel.broadcast import SHM_ROOT, store_name
from fiber_core.runtime.run import runtime

T = 30.0


def store_dir(host: str = "") -> str:
    return os.path.join(SHM_ROOT, store_name(runtime().authkey, runtime().run_id, host))


def segments(path: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(path) if not n.startswith(".") and n.split("-")[-1].isdigit())
    except FileNotFoundError:
        return []


def table(version: int, n: int = 100_000) -> np.ndarray:
    return np.full(n, float(version), dtype=np.float32)


def test_the_publisher_reads_its_own_value_and_versions_count_up() -> None:
    arr = table(1)
    b = fiber_core.broadcast(arr)
    assert b.value is arr and b.version == 1
    assert b.publish(table(2)) == 2 and b.version == 2
    assert float(b.value[0]) == 2.0
    assert len(segments(store_dir())) >= 1
    b.close()
    with pytest.raises(FiberError, match="closed"):
        b.value  # noqa: B018
    with pytest.raises(FiberError, match="closed"):
        b.publish(1)


def test_pool_workers_see_each_version_in_order_through_an_initializer() -> None:
    b = fiber_core.broadcast({"table": table(1), "tag": "first"})
    with fiber_core.Pool(3, initializer=tasks.keep, initargs=(b,)) as pool:
        first = pool.map(tasks.summary, [None] * 12)
        assert {r["version"] for r in first} == {1}
        assert all(r["values"] == [1.0] and r["tag"] == "first" for r in first)
        b.publish({"table": table(2), "tag": "second"})
        second = pool.map(tasks.summary, [None] * 12)
        assert {r["version"] for r in second} == {2}
        assert all(r["values"] == [2.0] and r["tag"] == "second" for r in second)


def test_readers_on_one_host_map_one_segment_read_only() -> None:
    b = fiber_core.broadcast(table(7, 1 << 20))
    barrier = fiber_core.Barrier(3)
    with fiber_core.Pool(3) as pool:
        # each task waits for the other two: three workers read it, each in its own process
        seen = pool.map(functools.partial(tasks.summary_together, barrier), [b] * 3, chunksize=1)
    path = os.path.join(store_dir(), segments(store_dir())[0])
    assert len({r["pid"] for r in seen}) == 3
    for r in seen:
        assert r["values"] == [7.0] and r["version"] == 1
        assert r["shared"] is True and r["writeable"] is False
        # the array's memory lies in a mapping of the publisher's segment: no copy
        assert r["mapping"] == (path, os.stat(path).st_ino)
    assert b.fetches == 0  # this host's jobs map it where the publisher put it


def test_each_other_host_fetches_a_version_once_and_its_readers_share_it() -> None:
    b = fiber_core.broadcast(table(3, 1 << 18))
    q, hold = fiber_core.Queue(), fiber_core.Event()
    jobs = [fiber_core.Process(target=tasks.read_as_host, args=(b, host, q, hold))
            for host in ("hosta", "hosta", "hosta", "hostb", "hostb")]
    for p in jobs:
        p.start()
    seen = [q.get(timeout=T) for _ in jobs]
    assert b.fetches == 2
    hold.set()  # a host's copies go with the last of its readers
    for p in jobs:
        p.join(T)
        assert p.exitcode == 0
    mappings = {r["mapping"] for r in seen}
    assert {os.path.dirname(m[0]) for m in mappings} == {store_dir("hosta"), store_dir("hostb")}
    assert len(mappings) == 2 and all(r["values"] == [3.0] and r["shared"] for r in seen)
    # their trackers remove them once the readers are gone
    wait_until(lambda: not os.path.exists(store_dir("hosta")) and not os.path.exists(store_dir("hostb")),
               "the two hosts' directories are removed")


def test_a_version_replaced_is_fetched_anew_and_the_old_copy_removed() -> None:
    b = fiber_core.broadcast(table(1, 1000))
    with fiber_core.Pool(1, initializer=tasks.as_host, initargs=("hostc",)) as pool:
        for version in (1, 2, 3):
            if version > 1:
                b.publish(table(version, 1000))
            assert pool.apply(tasks.summary, (b,))["values"] == [float(version)]
            assert segments(store_dir("hostc")) == [f"{b._bid}-{version}"]
            assert segments(store_dir()) == [f"{b._bid}-{version}"]
            assert pool.apply(tasks.summary, (b,))["version"] == version  # read again: no fetch
    assert b.fetches == 3


def test_a_reader_killed_mid_fetch_leaves_nothing_half_written() -> None:
    host = "hostk"
    small, b = fiber_core.broadcast(1), fiber_core.broadcast(table(5, 64 << 20))  # 256 MiB
    q, hold = fiber_core.Queue(), fiber_core.Event()
    stays = fiber_core.Process(target=_read_and_stay, args=(small, host, q, hold))
    stays.start()
    assert q.get(timeout=T) == 1  # a user of hostk's directory while the others come and go
    victim = fiber_core.Process(target=tasks.die_while_fetching, args=(b, host, store_dir(host)))
    victim.start()
    victim.join(T)
    assert victim.exitcode == -signal.SIGKILL
    assert b.fetches == 0  # it never finished
    assert [n for n in os.listdir(store_dir(host)) if ".part." in n]  # what it left
    reader = fiber_core.Process(target=tasks.read_as_host, args=(b, host, q))
    reader.start()
    seen = q.get(timeout=T)
    reader.join(T)
    assert seen["values"] == [5.0] and seen["version"] == 1 and seen["shared"]
    assert b.fetches == 1
    assert not [n for n in os.listdir(store_dir(host)) if ".part." in n]
    assert segments(store_dir(host)) == sorted([f"{b._bid}-1", f"{small._bid}-1"])
    hold.set()
    stays.join(T)


def _read_and_stay(handle, host, q, hold) -> None:  # noqa: ANN001
    tasks.as_host(host)
    q.put(handle.value)
    hold.wait(T)


def test_readers_never_see_a_mix_of_two_versions() -> None:
    b = fiber_core.broadcast(table(1, 1 << 16))
    until, q, progress = fiber_core.Event(), fiber_core.Queue(), fiber_core.Queue()
    hosts = ("", "hostm")
    readers = [fiber_core.Process(target=tasks.read_in_loop, args=(b, until, q, progress, host))
               for host in hosts]
    for p in readers:
        p.start()
    newest = dict.fromkeys(hosts, 0)
    for version in range(1, 31):
        if version > 1:
            b.publish(table(version, 1 << 16))
        if version % 10 == 1:  # now and then, until both readers have seen this version
            while min(newest.values()) < version:
                host, seen = progress.get(timeout=T)
                newest[host] = max(newest[host], seen)
    until.set()
    logs = [q.get(timeout=T) for _ in readers]
    for p in readers:
        p.join(T)
        assert p.exitcode == 0
    for log in logs:
        assert log, "a reader read nothing"
        versions = [v for v, _ in log]
        assert versions == sorted(versions) and {1, 11, 21} <= set(versions)
        assert [(v, values) for v, values in log if values != [float(v)]] == []


def test_bytes_come_back_as_read_only_memoryviews_and_objects_unpickled() -> None:
    raw = fiber_core.broadcast(b"abc" * 1000)
    obj = fiber_core.broadcast({"weights": [1, 2, 3], "lr": 0.1})
    q = fiber_core.Queue()
    p = fiber_core.Process(target=_report_types, args=(raw, obj, q))
    p.start()
    kind, readonly, data, value = q.get(timeout=T)
    p.join(T)
    assert (kind, readonly, data) == ("memoryview", True, b"abc" * 1000)
    assert value == {"weights": [1, 2, 3], "lr": 0.1}


def _report_types(raw, obj, q) -> None:  # noqa: ANN001
    view = raw.value
    q.put((type(view).__name__, view.readonly, bytes(view), obj.value))


def test_a_reader_without_usable_shared_memory_keeps_its_own_copy() -> None:
    b = fiber_core.broadcast(table(4, 1000))
    host = "noshm"
    with open(store_dir(host), "w"):  # a file where the directory would go: unusable
        pass
    try:
        q = fiber_core.Queue()
        p = fiber_core.Process(target=tasks.read_as_host, args=(b, host, q))
        p.start()
        seen = q.get(timeout=T)
        p.join(T)
    finally:
        os.unlink(store_dir(host))
    assert seen["values"] == [4.0] and seen["shared"] is False and seen["writeable"] is False
    assert b.fetches == 1


def test_bad_uses_say_what_to_do() -> None:
    with pytest.raises(Exception, match="cannot send|pickle"):
        fiber_core.broadcast(lambda_holder())
    b = fiber_core.broadcast(1)
    q = fiber_core.Queue()
    p = fiber_core.Process(target=_try_publish, args=(b, q))
    p.start()
    message = q.get(timeout=T)
    p.join(T)
    assert "publish() is for the process that made this broadcast" in message
    b.close()
    p = fiber_core.Process(target=_try_read, args=(b, q))
    p.start()
    message = q.get(timeout=T)
    p.join(T)
    assert "closed by the process that published it" in message


def lambda_holder() -> object:
    import threading

    return {"lock": threading.Lock()}


def _try_publish(b, q) -> None:  # noqa: ANN001
    try:
        b.publish(2)
    except FiberError as e:
        q.put(str(e))


def _try_read(b, q) -> None:  # noqa: ANN001
    try:
        b.value  # noqa: B018
    except FiberError as e:
        q.put(str(e))


PROGRAM = """
import os, sys
import numpy as np
import fiber_core
import broadcast_tasks as tasks

if __name__ == "__main__":
    b = fiber_core.broadcast(np.ones(1 << 20, dtype=np.float32))
    q, hold = fiber_core.Queue(), fiber_core.Event()
    readers = [fiber_core.Process(target=tasks.read_as_host, args=(b, h, q, hold), daemon=True)
               for h in ("", "", "far")]
    for p in readers:
        p.start()
    for _ in readers:
        q.get(timeout=30)
    pool = fiber_core.Pool(2, initializer=tasks.keep, initargs=(b,))
    pool.map(tasks.summary, [None] * 4)
    from fiber_core.runtime.run import runtime
    print(runtime().run_id, flush=True)
    sys.stdin.read()
"""


@pytest.mark.parametrize("ending", ["killed", "normal"])
def test_no_segment_outlives_the_program(ending: str, tmp_path, own_tmpdir: str) -> None:  # noqa: ANN001
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]),
           "TMPDIR": own_tmpdir}  # it may be killed
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env, cwd=tmp_path)
    try:
        run_id = proc.stdout.readline().strip()
        assert run_id, "the program did not get as far as reading"
        dirs = [n for n in os.listdir(SHM_ROOT) if n.startswith(f"fiber-bc-{run_id}-")]
        assert len(dirs) == 2 and all(segments(os.path.join(SHM_ROOT, d)) for d in dirs)  # here and "far"
        if ending == "killed":
            proc.kill()
        else:
            proc.stdin.close()
        proc.wait(T)
        def left() -> list[str]:
            return [n for n in os.listdir(SHM_ROOT) if n.startswith(f"fiber-bc-{run_id}")]

        # the jobs' trackers remove them once the last user is gone
        wait_until(lambda: not left(), f"no directory of run {run_id} is left in {SHM_ROOT}")
    finally:
        proc.kill()
        proc.wait(T)
