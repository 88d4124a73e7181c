"""The message vocabulary: every kind round-trips, a bad frame is a clear error, the tables
are the kinds."""

from __future__ import annotations

import os
import pickle
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import fiber_core
from fiber_core.base.errors import FiberError
from fiber_core.runtime.hub import dial
from fiber_core.runtime.run import runtime
from fiber_core.wire import messages as m
from fiber_core.wire.auth import _MAGIC, client_handshake
from fiber_core.wire.framing import Connection

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed


def _frame(head: bytes, body: bytes = b"") -> bytes:
    return head + body


# kind -> (frame, what decoding it must give, the decoder). Every kind appears once.
_PICKLED_TASKS = (7, 3, b"func", 1, [b"unit-a", b"unit-b"], True, (4, 2**63, [0, 5], [0, 1]))
_PICKLED_RESULTS = (7, 0.25, [(True, [1, 2]), (False, (ValueError("no"), "tb"))])
_PRELUDE = {"sys_path": ["/x"], "main": None, "config": {}, "forward_output": True,
            "parent": ("MainProcess", 1)}
_STATE = {"run": {"id": "abc", "pid": 7}, "pools": [{"queued": 3, "losses": {"exited": 1}}]}


def _cases() -> dict[bytes, tuple[bytes, Any, Callable[[bytes], Any]]]:
    return {
        m.PROCESS_PRELUDE: (_frame(m.PROCESS_PRELUDE, m.encode_process_prelude(_PRELUDE)),
                            _PRELUDE, m.decode_process_prelude),
        m.PROCESS_OBJECT: (_frame(m.PROCESS_OBJECT, m.encode_process_object(("a", 1))),
                           ("a", 1), m.decode_process_object),
        m.PROCESS_STDOUT: (_frame(m.PROCESS_STDOUT, b"out\n"), b"out\n", m.body),
        m.PROCESS_STDERR: (_frame(m.PROCESS_STDERR, b"err"), b"err", m.body),
        m.PROCESS_EXIT: (m.encode_process_exit(-9), -9, m.decode_process_exit),
        m.PROCESS_INTERRUPT: (_frame(m.PROCESS_INTERRUPT), b"", m.body),
        m.PROCESS_WAITING: (_frame(m.PROCESS_WAITING), b"", m.body),
        m.POOL_HELLO: (m.encode_pool_hello(2**40), 2**40, m.decode_pool_hello),
        m.POOL_READY: (_frame(m.POOL_READY), b"", m.body),
        m.POOL_TASKS: (_frame(m.POOL_TASKS, m.encode_pool_tasks(*_PICKLED_TASKS)),
                       _PICKLED_TASKS, m.decode_pool_tasks),
        m.POOL_RESULTS: (_frame(m.POOL_RESULTS, m.encode_pool_results(*_PICKLED_RESULTS)),
                         _PICKLED_RESULTS, m.decode_pool_results),
        m.POOL_QUIT: (_frame(m.POOL_QUIT), b"", m.body),
        m.POOL_RUNNING: (m.encode_pool_running(2**40, 7), (2**40, 7), m.decode_pool_running),
        m.POOL_DRAIN: (m.encode_pool_drain(-1), -1, m.decode_pool_drain),
        m.POOL_CANCEL: (m.encode_pool_cancel(2**40), 2**40, m.decode_pool_cancel),
        m.POOL_HEARTBEAT: (m.encode_pool_heartbeat(12.5, 2**33, None, 7 << 20),
                           {"cpu": 12.5, "rss": 2**33, "gpu": None, "gpu_memory": 7 << 20},
                           m.decode_pool_heartbeat),
        m.QUEUE_PUT: (_frame(m.encode_queue_put(False, 2.5), b"item"), (False, 2.5, b"item"),
                      m.decode_queue_put),
        m.QUEUE_GET: (m.encode_queue_get(True, None, 64), (True, None, 64), m.decode_queue_get),
        m.QUEUE_GOT: (_frame(m.QUEUE_GOT), b"", m.body),
        m.QUEUE_SIZE: (_frame(m.QUEUE_SIZE), b"", m.body),
        m.QUEUE_TASK_DONE: (_frame(m.QUEUE_TASK_DONE), b"", m.body),
        m.QUEUE_JOIN: (_frame(m.QUEUE_JOIN), b"", m.body),
        m.QUEUE_LOAN: (m.encode_queue_loan(2**62), 2**62, m.decode_queue_loan),
        m.QUEUE_ACK: (m.encode_queue_ack(5), 5, m.decode_queue_ack),
        m.QUEUE_RETURN: (m.encode_queue_return(2**32 - 1), 2**32 - 1, m.decode_queue_return),
        m.QUEUE_OK: (_frame(m.QUEUE_OK), b"", m.body),
        m.QUEUE_SIZES: (m.encode_queue_sizes(3, 10), (3, 10), m.decode_queue_sizes),
        m.QUEUE_ITEM: (_frame(m.QUEUE_ITEM, b"item"), b"item", m.body),
        m.QUEUE_BATCH: (m.encode_queue_batch([b"one", b"", memoryview(b"three")]),
                        [b"one", b"", b"three"], m.decode_queue_batch),
        m.QUEUE_EMPTY: (_frame(m.QUEUE_EMPTY), b"", m.body),
        m.QUEUE_FULL: (_frame(m.QUEUE_FULL), b"", m.body),
        m.QUEUE_TOO_MANY_DONE: (_frame(m.QUEUE_TOO_MANY_DONE), b"", m.body),
        m.QUEUE_RECALL: (_frame(m.QUEUE_RECALL), b"", m.body),
        m.SYNC_HELLO: (_frame(m.SYNC_HELLO, b"job-1 thread-2"), b"job-1 thread-2", m.body),
        m.SYNC_ACQUIRE: (m.encode_acquire(2**40, False, 1.5), (2**40, False, 1.5),
                         m.decode_acquire),
        m.SYNC_RELEASE: (m.encode_release(9), 9, m.decode_obj),
        m.SYNC_CALL: (m.encode_call(3, "notify", (2,)), (3, "notify", (2,)), m.decode_call),
        m.SYNC_YES: (_frame(m.SYNC_YES), b"", m.body),
        m.SYNC_NO: (_frame(m.SYNC_NO), b"", m.body),
        m.SYNC_DONE: (_frame(m.SYNC_DONE), b"", m.body),
        m.SYNC_VALUE: (_frame(m.SYNC_VALUE, pickle.dumps(42)), 42,
                       lambda f: pickle.loads(m.body(f))),
        m.SYNC_ERROR: (m.encode_error(KeyError("k")), (KeyError, ("k",)),
                       lambda f: _raised(m.raise_error, f)),
        m.SYNC_ACTION: (_frame(m.SYNC_ACTION), b"", m.body),
        m.STATUS_ASK: (_frame(m.STATUS_ASK), b"", m.body),
        m.STATUS_STATE: (_frame(m.STATUS_STATE, m.encode_status_state(_STATE)), _STATE,
                         m.decode_status_state),
        **{code: (_frame(code, body), body, m.body) for code, body in (
            (m.PIPE_ACTIVE, b""), (m.PIPE_WANT, (7).to_bytes(8, "big")),
            (m.PIPE_TICKET, b"c.1"), (m.PIPE_ABANDON, b"c.2"), (m.PIPE_RETURN, b"message"),
            (m.PIPE_CLOSING, (3).to_bytes(8, "big")), (m.PIPE_CLOSE, (4).to_bytes(8, "big")),
            (m.PIPE_MODE, b"d"), (m.PIPE_EOF, b""), (m.PIPE_CLOSED, b""), (m.PIPE_BYE, b""),
            (m.PIPE_ACK, (5).to_bytes(8, "big") + (2).to_bytes(8, "big")))},
    }


def _raised(func: Any, frame: bytes) -> Any:
    try:
        func(frame)
    except BaseException as e:
        return type(e), e.args
    raise AssertionError("no exception raised")


def _plain(value: Any) -> Any:
    """memoryviews as bytes, exceptions as (type, args): comparable with ==."""
    if isinstance(value, memoryview):
        return bytes(value)
    if isinstance(value, BaseException):
        return type(value), value.args
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def test_every_kind_round_trips() -> None:
    cases = _cases()
    assert set(cases) == {kind.code for kind in m.KINDS}
    for code, (frame, expected, decode) in cases.items():
        assert m.kind_of(frame) == code
        assert _plain(decode(frame)) == _plain(expected), m.BY_CODE[code].name


def test_a_put_item_is_a_copy_when_small_and_a_view_when_big() -> None:
    small = m.encode_queue_put(True, None) + b"x" * 100
    big = m.encode_queue_put(True, None) + b"x" * 100_000
    assert type(m.decode_queue_put_item(small)) is bytes
    assert isinstance(m.decode_queue_put_item(big), memoryview)
    assert bytes(m.decode_queue_put_item(big)) == b"x" * 100_000
    assert m.decode_queue_get(m.encode_queue_get(False, 0.5)) == (False, 0.5, None)


def test_codes_are_single_unique_bytes_and_every_kind_is_listed() -> None:
    defined = {name: value for name, value in vars(m).items()
               if name.startswith(("PROCESS_", "POOL_", "QUEUE_", "SYNC_", "PIPE_", "STATUS_"))}
    assert defined == {kind.name: kind.code for kind in m.KINDS}
    assert all(type(code) is bytes and len(code) == 1 for code in defined.values())
    assert len(set(defined.values())) == len(m.KINDS)
    assert all(k.sender and k.receiver and k.meaning for k in m.KINDS)
    with pytest.raises(ValueError, match="share the code"):
        m._kind(b"p", "QUEUE_PUT_AGAIN", "a", "b", "", "", "a second meaning")


def test_the_reference_tables_are_the_kinds() -> None:
    assert m.table() in (m.__doc__ or "")
    architecture = Path(__file__).parent.parent / "docs" / "architecture.md"
    assert m.table() in architecture.read_text()


def test_each_fixed_layout_is_the_struct_its_kind_declares() -> None:
    kinds = m.BY_CODE
    assert kinds[m.QUEUE_PUT].struct().size == 10
    assert kinds[m.QUEUE_GET].struct(optional=False).size == 10
    assert kinds[m.QUEUE_GET].struct().size == 14
    assert len(m.encode_queue_sizes(1, 2)) == kinds[m.QUEUE_SIZES].struct().size == 17
    assert len(m.encode_pool_hello(1)) == kinds[m.POOL_HELLO].struct().size


_FIXED: list[tuple[bytes, Callable[[bytes], Any]]] = [
    (m.encode_pool_hello(3), m.decode_pool_hello),
    (m.encode_queue_get(True, 1.0), m.decode_queue_get),
    (m.encode_queue_get(True, 1.0, 8), m.decode_queue_get),
    (m.encode_queue_loan(9), m.decode_queue_loan),
    (m.encode_queue_ack(1), m.decode_queue_ack),
    (m.encode_queue_return(1), m.decode_queue_return),
    (m.encode_queue_sizes(1, 2), m.decode_queue_sizes),
]


@pytest.mark.parametrize(("frame", "decode"), _FIXED, ids=lambda x: getattr(x, "__name__", ""))
def test_a_truncated_or_padded_frame_is_a_clear_error(frame: bytes,
                                                      decode: Callable[[bytes], Any]) -> None:
    for cut in range(1, len(frame)):
        if decode is m.decode_queue_get and cut == 10:
            continue  # a get without its window: valid
        with pytest.raises(m.MessageError, match="malformed"):
            decode(frame[:cut])
    with pytest.raises(m.MessageError, match="malformed"):
        decode(frame + b"\0")


def test_a_truncated_body_is_a_clear_error() -> None:
    batch = m.encode_queue_batch([b"one", b"two"])
    for cut in range(1, len(batch)):
        with pytest.raises(m.MessageError, match="QUEUE_BATCH"):
            m.decode_queue_batch(batch[:cut])
    put = m.encode_queue_put(True, None) + b"item"
    for cut in range(1, 11):
        with pytest.raises(m.MessageError, match="QUEUE_PUT"):
            m.decode_queue_put(put[:cut])
        with pytest.raises(m.MessageError, match="QUEUE_PUT"):
            m.decode_queue_put_item(put[:cut])
    for bad in (m.PROCESS_EXIT, m.PROCESS_EXIT + b"nine"):
        with pytest.raises(m.MessageError, match="PROCESS_EXIT"):
            m.decode_process_exit(bad)


def test_a_status_state_that_is_not_a_json_object_is_a_clear_error() -> None:
    state = m.encode_status_state(_STATE)
    with pytest.raises(m.MessageError, match="not JSON"):
        m.decode_status_state(m.STATUS_STATE + state[:-1])
    with pytest.raises(m.MessageError, match="not an object"):
        m.decode_status_state(m.STATUS_STATE + b"[1, 2]")
    with pytest.raises(m.MessageError, match="STATUS_ASK"):
        m.decode_status_state(m.STATUS_ASK)


def test_a_frame_of_another_kind_or_an_unknown_one_is_a_clear_error() -> None:
    err = m.unexpected(b"\x07abc", "a test connection")
    assert isinstance(err, m.MessageError) and isinstance(err, ValueError)
    assert isinstance(err, FiberError)
    assert "unknown kind b'\\x07'" in str(err) and "a test connection" in str(err)
    assert "another version" in str(err)
    assert "empty frame" in str(m.unexpected(b"", "here"))
    assert "QUEUE_FULL (owner → handle)" in str(m.unexpected(m.QUEUE_FULL, "here"))
    with pytest.raises(m.MessageError, match="POOL_QUIT"):
        m.decode_process_prelude(m.POOL_QUIT)
    with pytest.raises(m.MessageError, match="unknown kind"):
        m.decode_process_object(b"\xff")
    with pytest.raises(m.MessageError, match="empty frame"):
        m.decode_pool_hello(b"")


def test_a_negative_timeout_is_refused_before_anything_is_sent() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        m.encode_queue_put(True, -1.0)
    with pytest.raises(ValueError, match="non-negative"):
        m.encode_queue_get(True, -0.5)


def test_a_queue_owner_hangs_up_on_a_frame_it_does_not_understand() -> None:
    q = fiber_core.Queue()
    for garbage in (b"\x07junk", b"", m.POOL_TASKS, m.encode_queue_ack(1)):
        conn = Connection(dial(q._hub, runtime().authkey, f"queue:{q._id}"))
        conn._socket().settimeout(T)
        conn.send_frame(garbage)
        with pytest.raises(EOFError):
            conn.recv_bytes()
        conn.close()
    q.put("still works")
    assert q.get(timeout=T) == "still works"


def test_a_process_of_another_wire_version_is_refused_clearly() -> None:
    # A client of another version: the hub hangs up at once.
    path = dict(a.split(":", 1) for a in runtime().hub.addresses.split(","))["unix"]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(T)
    sock.connect(path)
    sock.sendall(_MAGIC[:-1] + bytes([_MAGIC[-1] - 1]) + os.urandom(16))
    assert sock.recv(64) == b""
    sock.close()
    # A server of another version, seen from this side: an error that says so.
    ours, theirs = socket.socketpair()
    ours.settimeout(T)

    def old_server() -> None:
        theirs.recv(len(_MAGIC) + 16)
        theirs.close()

    t = threading.Thread(target=old_server)
    t.start()
    with pytest.raises(EOFError, match="another version of Fiber"):
        client_handshake(ours, runtime().authkey, "queue:x")
    t.join(T)
    ours.close()
