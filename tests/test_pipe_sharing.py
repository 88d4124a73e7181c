"""Pipe ends shared as the stdlib's handles are: copies in several processes, real jobs."""

from __future__ import annotations

import pytest

import fiber_core

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed


def started(target: object, *args: object, daemon: bool = False) -> fiber_core.Process:
    p = fiber_core.Process(target=target, args=args, daemon=daemon)
    p.start()
    return p


# -- what vectorised environments do (Stable-Baselines3, gymnasium) -------------------------


def _vec_worker(remote, parent_remote) -> None:  # noqa: ANN001
    parent_remote.close()
    while True:
        cmd, data = remote.recv()
        if cmd == "step":
            remote.send(data * 2)
        elif cmd == "close":
            remote.close()
            break


def test_both_ends_to_each_worker_and_parent_closes_the_worker_end() -> None:
    remotes, work_remotes = zip(*[fiber_core.Pipe() for _ in range(2)])
    ps = []
    for work_remote, remote in zip(work_remotes, remotes):
        ps.append(started(_vec_worker, work_remote, remote, daemon=True))
        work_remote.close()
    for k in range(20):
        for remote in remotes:
            remote.send(("step", k))
        assert [remote.recv() for remote in remotes] == [2 * k, 2 * k]
    # One end here and one in the worker are used: they talk directly, not through a relay.
    assert all(remote._state.machine.direct is not None for remote in remotes)
    for remote in remotes:
        remote.send(("close", None))
    for p, remote in zip(ps, remotes):
        p.join(T)
        assert p.exitcode == 0
        with pytest.raises(EOFError):
            remote.recv()


def _echo_bytes(conn) -> None:  # noqa: ANN001
    while msg := conn.recv_bytes():
        conn.send_bytes(msg)


def test_an_unused_copy_kept_here_does_not_slow_the_pair_down() -> None:
    conn, child = fiber_core.Pipe()  # ``child`` stays open here, as in the docs' example
    p = started(_echo_bytes, child)
    for _ in range(50):
        conn.send_bytes(b"x")
        assert conn.recv_bytes() == b"x"
    assert conn._state.machine.direct is not None
    conn.send_bytes(b"")
    p.join(T)
    assert p.exitcode == 0


# -- several readers, several writers ---------------------------------------------------------


def _drain(conn, report) -> None:  # noqa: ANN001
    got = []
    try:
        while True:
            got.append(conn.recv())
    except EOFError:
        pass
    report.put(got)


def test_readers_of_one_end_share_its_messages_each_once() -> None:
    a, b = fiber_core.Pipe()
    report = fiber_core.Queue()
    ps = [started(_drain, b, report) for _ in range(2)]
    b.close()
    for i in range(200):
        a.send(i)
    a.close()  # the last writer: both readers get EOFError once the messages are taken
    got = [report.get(timeout=T) for _ in ps]
    for p in ps:
        p.join(T)
        assert p.exitcode == 0
    assert sorted(got[0] + got[1]) == list(range(200))
    for part in got:
        assert part == sorted(part)  # each reader sees them in the order they were written


def _write(conn, tag: str, n: int) -> None:  # noqa: ANN001
    for k in range(n):
        conn.send((tag, k))


def test_every_writer_arrives_and_eof_comes_after_the_last() -> None:
    r, w = fiber_core.Pipe(duplex=False)
    ps = [started(_write, w, tag, 30) for tag in "xyz"]
    w.close()
    got: dict[str, list[int]] = {"x": [], "y": [], "z": []}
    with pytest.raises(EOFError):
        while True:
            tag, k = r.recv()
            got[tag].append(k)
    assert got == {tag: list(range(30)) for tag in "xyz"}
    for p in ps:
        p.join(T)
        assert p.exitcode == 0


def _pass_on(w, depth: int) -> None:  # noqa: ANN001
    w.send(depth)
    if depth < 2:
        p = fiber_core.Process(target=_pass_on, args=(w, depth + 1))
        p.start()
        p.join()
        w.send(-depth)
    w.close()


def test_an_end_used_here_is_sent_and_passed_on_in_order() -> None:
    r, w = fiber_core.Pipe(duplex=False)
    w.send("before")  # used here first, then sent
    p = started(_pass_on, w, 0)
    p.join(T)
    assert p.exitcode == 0
    w.send("after")
    w.close()
    got = []
    with pytest.raises(EOFError):
        while True:
            got.append(r.recv())
    assert got == ["before", 0, 1, 2, -1, 0, "after"]


def _take_from(queue) -> None:  # noqa: ANN001
    conn = queue.get(timeout=T)
    conn.send(conn.recv() + 1)


def test_an_end_sent_through_a_queue() -> None:
    a, b = fiber_core.Pipe()
    queue = fiber_core.Queue()
    p = started(_take_from, queue)
    queue.put(b)
    b.close()
    a.send(41)
    assert a.recv() == 42
    p.join(T)
    assert p.exitcode == 0


# -- polling and closing ------------------------------------------------------------------------


def _send_three(b) -> None:  # noqa: ANN001
    b.send_bytes(b"a")
    b.send_bytes(b"b")
    b.send_bytes(b"cd")


def test_polling_before_the_other_end_is_sent_does_not_merge_them() -> None:
    a, b = fiber_core.Pipe()
    assert not a.poll(0.0)
    assert not a.poll(0.05)
    p = started(_send_three, b)
    assert a.recv_bytes() == b"a"
    assert a.poll(T)
    assert a.recv_bytes() == b"b"
    assert a.poll(T)
    assert a.recv_bytes() == b"cd"
    p.join(T)
    assert p.exitcode == 0


def _poll_then_exit(r, report) -> None:  # noqa: ANN001
    r.fileno()  # in use here: what is written from now on may come here
    report.put("ready")
    report.put(r.poll(T))


def test_messages_a_copy_did_not_read_go_back_when_it_exits() -> None:
    r, w = fiber_core.Pipe(duplex=False)
    report = fiber_core.Queue()
    p = started(_poll_then_exit, r, report)
    assert report.get(timeout=T) == "ready"
    w.send_bytes(b"first")
    w.send_bytes(b"second")
    assert report.get(timeout=T) is True
    p.join(T)
    assert p.exitcode == 0
    w.close()
    assert r.recv_bytes() == b"first"  # polled into the child, given back when it ended
    assert r.recv_bytes() == b"second"
    with pytest.raises(EOFError):
        r.recv_bytes()


def _poll_then_close(conn, report) -> None:  # noqa: ANN001
    conn.fileno()  # in use: the creator knows, and it asked for a message
    report.put("ready")
    report.put(conn.poll(T))  # the message came to this copy on its request ...
    conn.close()  # ... and it closes without reading it


def _hello_then_read(conn, go, report) -> None:  # noqa: ANN001
    conn.send("hello")  # in use, not reading yet
    go.get(timeout=T)
    report.put(conn.recv())


def test_a_message_a_closing_reader_gives_back_reaches_the_one_reader_left() -> None:
    here, there = fiber_core.Pipe()
    go, report_a, report_b = fiber_core.Queue(), fiber_core.Queue(), fiber_core.Queue()
    b = started(_hello_then_read, there, go, report_b)
    assert here.recv() == "hello"
    a = started(_poll_then_close, there, report_a)  # two copies in use: messages are queued
    there.close()
    assert report_a.get(timeout=T) == "ready"
    here.send("given back")
    assert report_a.get(timeout=T) is True
    a.join(T)
    assert a.exitcode == 0
    # The one reader left now talks to this end directly: what the other gave back is its.
    go.put(True)
    assert report_b.get(timeout=T) == "given back"
    b.join(T)
    assert b.exitcode == 0


def _close_unused_then_read(a, b, report) -> None:  # noqa: ANN001
    a.close()  # a copy closed unused changes nothing for the others
    report.put(b.recv())


def test_a_copy_closed_unused_changes_nothing() -> None:
    a, b = fiber_core.Pipe()
    report = fiber_core.Queue()
    p = started(_close_unused_then_read, a, b, report)
    a.send("to the child")
    assert report.get(timeout=T) == "to the child"
    p.join(T)
    b.send("here")
    assert a.recv() == "here"


def test_writing_when_no_reader_is_left_raises() -> None:
    a, b = fiber_core.Pipe()
    b.close()
    with pytest.raises(BrokenPipeError):
        a.send("nobody")


# -- what the stdlib's pickler for processes knows how to send ------------------------------


def _accept_and_send(conn) -> None:  # noqa: ANN001
    import multiprocessing.connection as mpc
    import socket

    with mpc.Listener(family="AF_UNIX") as listener:
        conn.send(listener.address)
        accepted = listener.accept()
        conn.send(accepted)  # reduced by multiprocessing.reduction: the handle itself travels
        accepted.close()
    server = socket.create_server(("127.0.0.1", 0))
    conn.send(server.getsockname())
    sock, _ = server.accept()
    conn.send(sock)
    sock.close()
    server.close()
    conn.recv()  # stays alive until the parent has taken both handles


def test_a_stdlib_connection_and_a_socket_sent_by_a_job_arrive_working() -> None:
    import multiprocessing.connection as mpc
    import socket

    here, there = fiber_core.Pipe()
    p = started(_accept_and_send, there, daemon=True)
    there.close()
    assert here.poll(T)
    with mpc.Client(here.recv()) as client:
        assert here.poll(T)
        received = here.recv()
        assert isinstance(received, mpc.Connection)
        client.send("over the handle")
        assert received.poll(T)
        assert received.recv() == "over the handle"
        received.close()
    assert here.poll(T)
    with socket.create_connection(here.recv(), timeout=T) as client_sock:
        assert here.poll(T)
        sock = here.recv()
        assert isinstance(sock, socket.socket)
        client_sock.sendall(b"raw bytes")
        sock.settimeout(T)
        assert sock.recv(100) == b"raw bytes"
        sock.close()
    here.send(None)
    p.join(T)
    assert p.exitcode == 0
