"""The message vocabulary: every kind of frame the processes of a run send each other.

A message is one frame of :mod:`fiber_core.wire.framing` on an authenticated
connection (:mod:`fiber_core.wire.auth`). Its first byte names its kind; the
fixed fields that follow are packed with :mod:`struct` (network byte order); a
*body* (an item, a pickle, output) takes the rest of the frame. Each kind is
defined once, below: a module constant that is its one-byte code (plain
``bytes``, so that ``kind_of(frame) == QUEUE_PUT`` costs no more than comparing
two bytes), and a :class:`Kind` record in :data:`KINDS` with its name, direction,
layout and meaning. No code means two things anywhere in a run.

This module does no I/O and knows nothing of who sends what when: the pool,
queues and processes do. It only builds and reads frame payloads:

* ``encode_<kind>(...)`` returns the frame, or its head when the kind has a body:
  the body goes after it in the same frame, uncopied, with
  ``conn.send_frame(head, body)``. A kind with neither fields nor body is sent as
  itself: ``conn.send_frame(QUEUE_RECALL)``. For a kind whose body is a pickle,
  ``encode_<kind>`` returns that body and the head is the kind.
* ``decode_<kind>(frame)`` returns its fields (and body); :func:`body` returns
  the body of a kind that has nothing else. A frame that is too short, or a kind
  that is not expected where it arrives (:func:`unexpected`), raises
  :class:`MessageError`, never ``IndexError``.

Three connections carry messages. *Process*: the parent and the job that runs a
:class:`~fiber_core.processes.process.Process` (the worker bootstrap). *Pool*:
the pool's master thread and each pool worker. *Queue*: a queue's owner (the
process that created it) and a handle of it in another process; a handle that
borrows items keeps a second connection for them (see :mod:`fiber_core.parallel.queues`).
Besides them, *status*: ``fiber top`` asking a program that shows its state
(:mod:`fiber_core.runtime.status`) for it.

Fields are ``name:format`` with :mod:`struct`'s formats: ``?`` bool (1 byte),
``d`` float64, ``I`` uint32, ``q`` int64, ``Q`` uint64. A timeout of -1 means none.

| code | kind | from → to | after the code | meaning |
|---|---|---|---|---|
| `P` | PROCESS_PRELUDE | parent → job | pickle of {sys_path, main, main_code, config, forward_output, parent, argv, log, spare} | what the job applies before it can unpickle the process object |
| `O` | PROCESS_OBJECT | parent → job | pickle of the Process | the process object to run |
| `+` | PROCESS_WAITING | job → parent | — | a spare job applied its prelude: it waits for a process object |
| `o` | PROCESS_STDOUT | job → parent | output bytes | what the job wrote to fd 1 |
| `e` | PROCESS_STDERR | job → parent | output bytes | what the job wrote to fd 2 |
| `x` | PROCESS_EXIT | job → parent | exit code, ASCII decimal | the exit code of the process object's run |
| `!` | PROCESS_INTERRUPT | parent → job | — | the parent got SIGINT (Ctrl-C): the job gets it too, as from the terminal |
| `H` | POOL_HELLO | worker → pool | worker:Q | a new worker's first frame: which worker it is |
| `W` | POOL_READY | worker → pool | — | its initializer ran: it wants work |
| `T` | POOL_TASKS | pool → worker | pickle of (batch, call, func or None, kind, units, watch, task) | a batch to run; func is sent once per call and worker; with watch, POOL_RUNNING before each item; task: (the call's ordinal, the run's seed, each unit's first item, each unit's attempt), what a task's identity and seed come from |
| `D` | POOL_RESULTS | worker → pool | pickle of (batch, seconds, [(ok, value or (exc, tb))]) | a batch's results, in its order, and its run time |
| `Q` | POOL_QUIT | pool → worker | — | exit once the batches already sent are done |
| `G` | POOL_RUNNING | worker → pool | batch:Q item:I | the item of a watched batch that starts now |
| `M` | POOL_DRAIN | worker → pool | batch:q | the worker is told to stop: it finishes batch (-1: none), runs no other, and waits for POOL_QUIT |
| `B` | POOL_CANCEL | pool → worker | call:Q | the call was cancelled: skip its batches not started yet (answered with empty POOL_RESULTS) |
| `~` | POOL_HEARTBEAT | worker → pool | cpu:d rss:q gpu:d gpu_memory:q | the worker lives (sent every heartbeat interval), with what it uses: % of one CPU since the last, bytes, GPU % and bytes (-1: unknown) |
| `p` | QUEUE_PUT | handle → owner | block:? timeout:d, item | put; answered by QUEUE_OK or QUEUE_FULL only if the queue is bounded |
| `g` | QUEUE_GET | handle → owner | block:? timeout:d [window:I] | get one item (QUEUE_ITEM or QUEUE_EMPTY); with a window, on a loan, up to window (QUEUE_BATCH) |
| `a` | QUEUE_GOT | handle → owner | — | the item of a plain get arrived (else it goes back in front) |
| `s` | QUEUE_SIZE | handle → owner | — | how many items? (QUEUE_SIZES) |
| `d` | QUEUE_TASK_DONE | handle → owner | — | task_done() (QUEUE_OK or QUEUE_TOO_MANY_DONE) |
| `j` | QUEUE_JOIN | handle → owner | — | join(): QUEUE_OK once every item is done |
| `L` | QUEUE_LOAN | handle → owner | token:q | this connection borrows: its gets are loans until it ends |
| `c` | QUEUE_ACK | handle → owner | n:I | the program took the next n lent items |
| `r` | QUEUE_RETURN | handle → owner | n:I | the next n lent items are unused: back in front (answers QUEUE_RECALL) |
| `k` | QUEUE_OK | owner → handle | — | done (a bounded put, task_done, join) |
| `S` | QUEUE_SIZES | owner → handle | waiting:q used:q | items waiting, and room used (waiting + lent) |
| `i` | QUEUE_ITEM | owner → handle | item | one item for a get |
| `b` | QUEUE_BATCH | owner → handle | n:I, n sizes:I, the n items | items lent for a get with a window |
| `E` | QUEUE_EMPTY | owner → handle | — | the get found no item in time |
| `F` | QUEUE_FULL | owner → handle | — | the bounded put found no room in time |
| `V` | QUEUE_TOO_MANY_DONE | owner → handle | — | task_done() was called more times than items were put |
| `R` | QUEUE_RECALL | owner → handle | — | unasked: another getter waits, give back unused items (QUEUE_RETURN) |
| `u` | PIPE_ACTIVE | copy → creator | — | the copy was used for the first time |
| `w` | PIPE_WANT | copy → creator | taken:Q | send me one message (I took `taken` so far) |
| `t` | PIPE_TICKET | copy → creator | ticket: ASCII | a copy of this copy was pickled (after what I wrote) |
| `v` | PIPE_ABANDON | copy → creator | ticket: ASCII | that pickled copy will never arrive |
| `n` | PIPE_RETURN | copy → creator | the message | a message sent to me directly that I did not read |
| `l` | PIPE_CLOSING | copy → creator | taken:Q | I am closing: stop sending me messages |
| `z` | PIPE_CLOSE | copy → creator | received:Q | I am closed (I received `received` direct messages) |
| `m` | PIPE_MODE | creator → copy | `d` or `s` | `d`: messages come unasked; `s`: ask with PIPE_WANT |
| `f` | PIPE_EOF | creator → copy | — | no holder of the other end is left: end of file |
| `q` | PIPE_CLOSED | creator → copy | — | nothing more will be sent to you |
| `y` | PIPE_BYE | creator → copy | — | your PIPE_CLOSE is done (returned messages are queued) |
| `#` | PIPE_ACK | copy → creator | received:Q taken:Q | so far I received `received` direct messages and took `taken` asked for (cumulative; after every message asked for, and every 64th direct one) |
| `h` | SYNC_HELLO | user → creator | who: UTF-8 | first frame of a session: the process and thread it serves (for warnings) |
| `A` | SYNC_ACQUIRE | user → creator | obj:Q block:? timeout:d | acquire the lock or semaphore obj (a Condition: its lock); SYNC_YES, SYNC_NO (not in time) or SYNC_ERROR |
| `U` | SYNC_RELEASE | user → creator | obj:Q | release it: SYNC_DONE or SYNC_ERROR |
| `C` | SYNC_CALL | user → creator | obj:Q, pickle of (operation, args) | any other operation of obj (wait, notify, set, an item...): SYNC_VALUE or SYNC_ERROR; a Barrier's wait may first get SYNC_ACTION |
| `Y` | SYNC_YES | creator → user | — | acquired |
| `N` | SYNC_NO | creator → user | — | not acquired (would block, or timed out) |
| `K` | SYNC_DONE | either → the other | — | done: a release, or (user to creator) the action that SYNC_ACTION asked for |
| `Z` | SYNC_VALUE | creator → user | pickle of the result | the result of a SYNC_CALL |
| `X` | SYNC_ERROR | either → the other | pickle of the exception | the operation raised it (the user raises it too); or the action did |
| `J` | SYNC_ACTION | creator → user | — | the user's Barrier.wait is the last party: run the barrier's action there and answer SYNC_DONE or SYNC_ERROR |
| `?` | STATUS_ASK | viewer → program | — | send the program's state now (STATUS_STATE) |
| `I` | STATUS_STATE | program → viewer | JSON of the state, UTF-8 | pools, workers, processes: what `fiber top` and the status page show |
"""

from __future__ import annotations

import math
import operator
import pickle
import struct
from collections.abc import Callable, Sequence

from fiber_core.base.errors import FiberError
from fiber_core.wire.serialize import dumps, loads

TYPE_CHECKING = False  # typing's own, without importing typing: a job starts without it
if TYPE_CHECKING:
    from typing import Any


class MessageError(FiberError, ValueError):
    """A frame that is not a message this process understands where it arrived.

    Truncated, of an unknown kind, or of a kind that this connection never carries:
    a bug, or a peer that runs another version of Fiber.
    """


class Kind:
    """A message kind: the one byte that starts its frames, and what it is.

    ``fields`` is a space-separated list of ``name:format`` (:mod:`struct`) packed
    right after the code, a ``[field]`` being optional; ``body`` says what takes the
    rest of the frame ("" for nothing). (Not a ``typing.NamedTuple``, for the reason
    :class:`~fiber_core.base.options.Option` gives.)
    """

    __slots__ = ("code", "name", "sender", "receiver", "fields", "body", "meaning")

    def __init__(self, code: bytes, name: str, sender: str, receiver: str, fields: str, body: str,
                 meaning: str) -> None:
        self.code = code
        self.name = name
        self.sender = sender
        self.receiver = receiver
        self.fields = fields
        self.body = body
        self.meaning = meaning

    def __repr__(self) -> str:
        return f"Kind({self.code!r}, {self.name!r})"

    def struct(self, optional: bool = True) -> struct.Struct:
        """The code and the fixed fields (with the optional ones or not), packed together."""
        return struct.Struct("!c" + "".join(
            f.strip("[]").split(":")[1] for f in self.fields.split()
            if optional or not f.startswith("[")))

    def layout(self) -> str:
        """What follows the code, as the reference table shows it."""
        parts = [p for p in (self.fields, self.body) if p]
        return ", ".join(parts) if parts else "—"


_table: list[Kind] = []


def _kind(code: bytes, name: str, sender: str, receiver: str, fields: str, body: str,
          meaning: str) -> bytes:
    """Add a kind to the table; return its code, the constant the protocols use."""
    if len(code) != 1:
        raise ValueError(f"the code of {name} must be one byte, not {code!r}")
    for other in _table:
        if other.code == code:
            raise ValueError(f"{name} and {other.name} would share the code {code!r}")
    _table.append(Kind(code, name, sender, receiver, fields, body, meaning))
    return code


# -- process: the parent and the job running a Process ---------------------------------

PROCESS_PRELUDE = _kind(b"P", "PROCESS_PRELUDE", "parent", "job", "",
                        "pickle of {sys_path, main, main_code, config, forward_output, parent, argv, log, spare}",
                        "what the job applies before it can unpickle the process object")
PROCESS_OBJECT = _kind(b"O", "PROCESS_OBJECT", "parent", "job", "", "pickle of the Process",
                       "the process object to run")
PROCESS_WAITING = _kind(b"+", "PROCESS_WAITING", "job", "parent", "", "",
                        "a spare job applied its prelude: it waits for a process object")
PROCESS_STDOUT = _kind(b"o", "PROCESS_STDOUT", "job", "parent", "", "output bytes",
                       "what the job wrote to fd 1")
PROCESS_STDERR = _kind(b"e", "PROCESS_STDERR", "job", "parent", "", "output bytes",
                       "what the job wrote to fd 2")
PROCESS_EXIT = _kind(b"x", "PROCESS_EXIT", "job", "parent", "", "exit code, ASCII decimal",
                     "the exit code of the process object's run")
PROCESS_INTERRUPT = _kind(b"!", "PROCESS_INTERRUPT", "parent", "job", "", "",
                          "the parent got SIGINT (Ctrl-C): the job gets it too, as from the terminal")

# -- pool: the pool's master thread and a worker ---------------------------------------

POOL_HELLO = _kind(b"H", "POOL_HELLO", "worker", "pool", "worker:Q", "",
                   "a new worker's first frame: which worker it is")
POOL_READY = _kind(b"W", "POOL_READY", "worker", "pool", "", "",
                   "its initializer ran: it wants work")
POOL_TASKS = _kind(b"T", "POOL_TASKS", "pool", "worker", "",
                   "pickle of (batch, call, func or None, kind, units, watch, task)",
                   "a batch to run; func is sent once per call and worker; with watch, "
                   "POOL_RUNNING before each item; task: (the call's ordinal, the run's seed, each "
                   "unit's first item, each unit's attempt), what a task's identity and seed come from")
POOL_RESULTS = _kind(b"D", "POOL_RESULTS", "worker", "pool", "",
                     "pickle of (batch, seconds, [(ok, value or (exc, tb))])",
                     "a batch's results, in its order, and its run time")
POOL_QUIT = _kind(b"Q", "POOL_QUIT", "pool", "worker", "", "",
                  "exit once the batches already sent are done")
POOL_RUNNING = _kind(b"G", "POOL_RUNNING", "worker", "pool", "batch:Q item:I", "",
                     "the item of a watched batch that starts now")
POOL_DRAIN = _kind(b"M", "POOL_DRAIN", "worker", "pool", "batch:q", "",
                   "the worker is told to stop: it finishes batch (-1: none), runs no other, "
                   "and waits for POOL_QUIT")
POOL_CANCEL = _kind(b"B", "POOL_CANCEL", "pool", "worker", "call:Q", "",
                    "the call was cancelled: skip its batches not started yet "
                    "(answered with empty POOL_RESULTS)")
POOL_HEARTBEAT = _kind(b"~", "POOL_HEARTBEAT", "worker", "pool", "cpu:d rss:q gpu:d gpu_memory:q", "",
                       "the worker lives (sent every heartbeat interval), with what it uses: % of one "
                       "CPU since the last, bytes, GPU % and bytes (-1: unknown)")

# -- queue: a handle in another process and the queue's owner --------------------------

QUEUE_PUT = _kind(b"p", "QUEUE_PUT", "handle", "owner", "block:? timeout:d", "item",
                  "put; answered by QUEUE_OK or QUEUE_FULL only if the queue is bounded")
QUEUE_GET = _kind(b"g", "QUEUE_GET", "handle", "owner", "block:? timeout:d [window:I]", "",
                  "get one item (QUEUE_ITEM or QUEUE_EMPTY); with a window, on a loan, "
                  "up to window (QUEUE_BATCH)")
QUEUE_GOT = _kind(b"a", "QUEUE_GOT", "handle", "owner", "", "",
                  "the item of a plain get arrived (else it goes back in front)")
QUEUE_SIZE = _kind(b"s", "QUEUE_SIZE", "handle", "owner", "", "", "how many items? (QUEUE_SIZES)")
QUEUE_TASK_DONE = _kind(b"d", "QUEUE_TASK_DONE", "handle", "owner", "", "",
                        "task_done() (QUEUE_OK or QUEUE_TOO_MANY_DONE)")
QUEUE_JOIN = _kind(b"j", "QUEUE_JOIN", "handle", "owner", "", "",
                   "join(): QUEUE_OK once every item is done")
QUEUE_LOAN = _kind(b"L", "QUEUE_LOAN", "handle", "owner", "token:q", "",
                   "this connection borrows: its gets are loans until it ends")
QUEUE_ACK = _kind(b"c", "QUEUE_ACK", "handle", "owner", "n:I", "",
                  "the program took the next n lent items")
QUEUE_RETURN = _kind(b"r", "QUEUE_RETURN", "handle", "owner", "n:I", "",
                     "the next n lent items are unused: back in front (answers QUEUE_RECALL)")
QUEUE_OK = _kind(b"k", "QUEUE_OK", "owner", "handle", "", "",
                 "done (a bounded put, task_done, join)")
QUEUE_SIZES = _kind(b"S", "QUEUE_SIZES", "owner", "handle", "waiting:q used:q", "",
                    "items waiting, and room used (waiting + lent)")
QUEUE_ITEM = _kind(b"i", "QUEUE_ITEM", "owner", "handle", "", "item", "one item for a get")
QUEUE_BATCH = _kind(b"b", "QUEUE_BATCH", "owner", "handle", "n:I", "n sizes:I, the n items",
                    "items lent for a get with a window")
QUEUE_EMPTY = _kind(b"E", "QUEUE_EMPTY", "owner", "handle", "", "", "the get found no item in time")
QUEUE_FULL = _kind(b"F", "QUEUE_FULL", "owner", "handle", "", "",
                   "the bounded put found no room in time")
QUEUE_TOO_MANY_DONE = _kind(b"V", "QUEUE_TOO_MANY_DONE", "owner", "handle", "", "",
                            "task_done() was called more times than items were put")
QUEUE_RECALL = _kind(b"R", "QUEUE_RECALL", "owner", "handle", "", "",
                     "unasked: another getter waits, give back unused items (QUEUE_RETURN)")


# -- pipe: a copy of a Pipe end and the pipe's creator (control frames: wire/control.py) --

PIPE_ACTIVE = _kind(b"u", "PIPE_ACTIVE", "copy", "creator", "", "",
                  "the copy was used for the first time")
PIPE_WANT = _kind(b"w", "PIPE_WANT", "copy", "creator", "taken:Q", "",
                "send me one message (I took `taken` so far)")
PIPE_TICKET = _kind(b"t", "PIPE_TICKET", "copy", "creator", "", "ticket: ASCII",
                  "a copy of this copy was pickled (after what I wrote)")
PIPE_ABANDON = _kind(b"v", "PIPE_ABANDON", "copy", "creator", "", "ticket: ASCII",
                   "that pickled copy will never arrive")
PIPE_RETURN = _kind(b"n", "PIPE_RETURN", "copy", "creator", "", "the message",
                  "a message sent to me directly that I did not read")
PIPE_CLOSING = _kind(b"l", "PIPE_CLOSING", "copy", "creator", "taken:Q", "",
                   "I am closing: stop sending me messages")
PIPE_CLOSE = _kind(b"z", "PIPE_CLOSE", "copy", "creator", "received:Q", "",
                 "I am closed (I received `received` direct messages)")
PIPE_MODE = _kind(b"m", "PIPE_MODE", "creator", "copy", "", "`d` or `s`",
                "`d`: messages come unasked; `s`: ask with PIPE_WANT")
PIPE_EOF = _kind(b"f", "PIPE_EOF", "creator", "copy", "", "",
               "no holder of the other end is left: end of file")
PIPE_CLOSED = _kind(b"q", "PIPE_CLOSED", "creator", "copy", "", "",
                  "nothing more will be sent to you")
PIPE_BYE = _kind(b"y", "PIPE_BYE", "creator", "copy", "", "",
               "your PIPE_CLOSE is done (returned messages are queued)")
PIPE_ACK = _kind(b"#", "PIPE_ACK", "copy", "creator", "received:Q taken:Q", "",
               "so far I received `received` direct messages and took `taken` asked for "
               "(cumulative; after every message asked for, and every 64th direct one)")

# -- sync: a process using a Lock, Value... served by its creator (parallel/sharing.py) --

SYNC_HELLO = _kind(b"h", "SYNC_HELLO", "user", "creator", "", "who: UTF-8",
                   "first frame of a session: the process and thread it serves (for warnings)")
SYNC_ACQUIRE = _kind(b"A", "SYNC_ACQUIRE", "user", "creator", "obj:Q block:? timeout:d", "",
                     "acquire the lock or semaphore obj (a Condition: its lock); "
                     "SYNC_YES, SYNC_NO (not in time) or SYNC_ERROR")
SYNC_RELEASE = _kind(b"U", "SYNC_RELEASE", "user", "creator", "obj:Q", "",
                     "release it: SYNC_DONE or SYNC_ERROR")
SYNC_CALL = _kind(b"C", "SYNC_CALL", "user", "creator", "obj:Q", "pickle of (operation, args)",
                  "any other operation of obj (wait, notify, set, an item...): SYNC_VALUE or "
                  "SYNC_ERROR; a Barrier's wait may first get SYNC_ACTION")
SYNC_YES = _kind(b"Y", "SYNC_YES", "creator", "user", "", "", "acquired")
SYNC_NO = _kind(b"N", "SYNC_NO", "creator", "user", "", "", "not acquired (would block, or timed out)")
SYNC_DONE = _kind(b"K", "SYNC_DONE", "either", "the other", "", "",
                  "done: a release, or (user to creator) the action that SYNC_ACTION asked for")
SYNC_VALUE = _kind(b"Z", "SYNC_VALUE", "creator", "user", "", "pickle of the result",
                   "the result of a SYNC_CALL")
SYNC_ERROR = _kind(b"X", "SYNC_ERROR", "either", "the other", "", "pickle of the exception",
                   "the operation raised it (the user raises it too); or the action did")
SYNC_ACTION = _kind(b"J", "SYNC_ACTION", "creator", "user", "", "",
                    "the user's Barrier.wait is the last party: run the barrier's action there "
                    "and answer SYNC_DONE or SYNC_ERROR")

# -- status: a viewer (`fiber top`) and a program that shows its state (runtime/status.py) --

STATUS_ASK = _kind(b"?", "STATUS_ASK", "viewer", "program", "", "",
                   "send the program's state now (STATUS_STATE)")
STATUS_STATE = _kind(b"I", "STATUS_STATE", "program", "viewer", "", "JSON of the state, UTF-8",
                     "pools, workers, processes: what `fiber top` and the status page show")

_ACQUIRE = struct.Struct("!cQ?d")
_OBJ = struct.Struct("!cQ")
_NO_TIMEOUT = -1.0

def encode_acquire(oid: int, block: bool, timeout: float | None) -> bytes:
    if timeout is None:
        timeout = _NO_TIMEOUT
    elif math.isnan(timeout) or timeout < 0:
        timeout = 0.0  # as the stdlib's SemLock.acquire takes it
    return _ACQUIRE.pack(SYNC_ACQUIRE, oid, block, timeout)


def decode_acquire(frame: bytes) -> tuple[int, bool, float | None]:
    _, oid, block, timeout = _ACQUIRE.unpack(frame)
    return oid, block, None if timeout == _NO_TIMEOUT else timeout


def encode_release(oid: int) -> bytes:
    return _OBJ.pack(SYNC_RELEASE, oid)


def encode_call(oid: int, op: str, args: tuple) -> bytes:
    return _OBJ.pack(SYNC_CALL, oid) + dumps((op, args))


def decode_obj(frame: bytes) -> int:
    return _OBJ.unpack_from(frame)[1]


def decode_call(frame: bytes) -> tuple[int, str, tuple]:
    op, args = loads(memoryview(frame)[_OBJ.size:])
    return decode_obj(frame), op, args


def encode_error(exc: BaseException) -> bytes:
    try:
        return SYNC_ERROR + dumps(exc)
    except Exception:
        return SYNC_ERROR + dumps(FiberError(f"{type(exc).__name__}: {exc}"))


def raise_error(frame: bytes) -> None:
    """Raise the exception of a SYNC_ERROR frame (or say what else arrived)."""
    if frame[:1] == SYNC_ERROR:
        raise loads(memoryview(frame)[1:])
    raise FiberError(f"unexpected answer {bytes(frame[:1])!r} from the creator of a shared object: "
                     "every process of a run must use the same version of Fiber")


KINDS: tuple[Kind, ...] = tuple(_table)
"""Every message kind of a run, in the order of the reference table."""


BY_CODE: dict[bytes, Kind] = {kind.code: kind for kind in KINDS}


def table() -> str:
    """The reference table (Markdown) of :data:`KINDS`, as in this module's docstring."""
    rows = ["| code | kind | from → to | after the code | meaning |", "|---|---|---|---|---|"]
    rows += [f"| `{k.code.decode()}` | {k.name} | {k.sender} → {k.receiver} | {k.layout()} "
             f"| {k.meaning} |" for k in KINDS]
    return "\n".join(rows)


# -- reading any frame ----------------------------------------------------------------

kind_of: Callable[[Any], bytes] = operator.itemgetter(slice(None, 1))
"""The code of a frame (``b""`` for an empty one): compare it with the kinds."""


def body(frame: bytes | bytearray) -> memoryview:
    """Everything after the code: the body of a kind that has no fields."""
    return memoryview(frame)[1:]


def unexpected(frame: bytes | bytearray | memoryview, where: str) -> MessageError:
    """The error for a frame that has no business ``where`` it arrived (to raise)."""
    code = bytes(frame[:1])
    kind = BY_CODE.get(code)
    if not code:
        what = "an empty frame"
    elif kind is None:
        what = f"a frame of unknown kind {code!r}"
    else:
        what = f"{kind.name} ({kind.sender} → {kind.receiver})"
    return MessageError(
        f"{what} arrived on {where}: its sender may run another version of Fiber "
        "(every process of a run must use the same one)")


def _truncated(code: bytes, frame: bytes | bytearray | memoryview, need: str) -> MessageError:
    kind = BY_CODE[code]
    return MessageError(
        f"a {kind.name} frame of {len(frame)} bytes is malformed: it needs {need} "
        f"({kind.layout()} after the code)")


def _expect(code: bytes, frame: bytes | bytearray | memoryview) -> None:
    if frame[:1] != code:
        raise unexpected(frame, f"a connection that expected {BY_CODE[code].name}")


# -- process --------------------------------------------------------------------------


def encode_process_prelude(prelude: dict[str, Any]) -> bytes:
    """The body of a PROCESS_PRELUDE frame."""
    return dumps(prelude)


def decode_process_prelude(frame: bytes | bytearray) -> dict[str, Any]:
    _expect(PROCESS_PRELUDE, frame)
    return loads(body(frame))


def encode_process_object(process: Any) -> bytes:
    """The body of a PROCESS_OBJECT frame (pickled in the caller's ``sending_to``)."""
    return dumps(process)


def decode_process_object(frame: bytes | bytearray) -> Any:
    _expect(PROCESS_OBJECT, frame)
    return loads(body(frame))


def encode_process_exit(code: int) -> bytes:
    return PROCESS_EXIT + b"%d" % code


def decode_process_exit(frame: bytes | bytearray) -> int:
    _expect(PROCESS_EXIT, frame)
    try:
        return int(frame[1:])
    except ValueError:
        raise _truncated(PROCESS_EXIT, frame, "an exit code in ASCII decimal") from None


# -- pool -----------------------------------------------------------------------------

_POOL_HELLO = BY_CODE[POOL_HELLO].struct()


def encode_pool_hello(worker: int) -> bytes:
    return _POOL_HELLO.pack(POOL_HELLO, worker)


def decode_pool_hello(frame: bytes | bytearray) -> int:
    _expect(POOL_HELLO, frame)
    if len(frame) != _POOL_HELLO.size:
        raise _truncated(POOL_HELLO, frame, f"{_POOL_HELLO.size} bytes")
    return _POOL_HELLO.unpack(frame)[1]


TaskField = tuple[int, int, list[int], list[int]]
"""POOL_TASKS's task: the call's ordinal, the run's seed, and per unit its first item's
position in the call's input, and per unit its attempt."""


def encode_pool_tasks(batch: int, call: int, func: bytes | None, kind: int,
                      units: list[bytes], watch: bool = False,
                      task: TaskField = (-1, 0, [], [])) -> bytes:
    """The body of a POOL_TASKS frame: ``func`` and each unit are already pickled."""
    return pickle.dumps((batch, call, func, kind, units, watch, task), protocol=pickle.HIGHEST_PROTOCOL)


def decode_pool_tasks(frame: bytes | bytearray) -> tuple[int, int, bytes | None, int, list[bytes], bool,
                                                         TaskField]:
    """(batch, call, func or None, kind, units, watch, task) of a POOL_TASKS frame."""
    return loads(body(frame))


_POOL_RUNNING = BY_CODE[POOL_RUNNING].struct()
_POOL_DRAIN = BY_CODE[POOL_DRAIN].struct()


def encode_pool_running(batch: int, item: int) -> bytes:
    return _POOL_RUNNING.pack(POOL_RUNNING, batch, item)


def decode_pool_running(frame: bytes | bytearray) -> tuple[int, int]:
    """(batch, item) of a POOL_RUNNING frame."""
    _expect(POOL_RUNNING, frame)
    if len(frame) != _POOL_RUNNING.size:
        raise _truncated(POOL_RUNNING, frame, f"{_POOL_RUNNING.size} bytes")
    _, batch, item = _POOL_RUNNING.unpack(frame)
    return batch, item


_POOL_CANCEL = BY_CODE[POOL_CANCEL].struct()


def encode_pool_cancel(call: int) -> bytes:
    return _POOL_CANCEL.pack(POOL_CANCEL, call)


def decode_pool_cancel(frame: bytes | bytearray) -> int:
    """The cancelled call of a POOL_CANCEL frame."""
    _expect(POOL_CANCEL, frame)
    if len(frame) != _POOL_CANCEL.size:
        raise _truncated(POOL_CANCEL, frame, f"{_POOL_CANCEL.size} bytes")
    return _POOL_CANCEL.unpack(frame)[1]


_POOL_HEARTBEAT = BY_CODE[POOL_HEARTBEAT].struct()


def encode_pool_heartbeat(cpu: float, rss: int | None, gpu: float | None, gpu_memory: int | None) -> bytes:
    """A POOL_HEARTBEAT frame with a sample of the worker's use (None is sent as -1)."""
    return _POOL_HEARTBEAT.pack(POOL_HEARTBEAT, cpu, -1 if rss is None else rss,
                                -1.0 if gpu is None else gpu, -1 if gpu_memory is None else gpu_memory)


def decode_pool_heartbeat(frame: bytes | bytearray) -> dict[str, Any]:
    """The sample of a POOL_HEARTBEAT frame: ``{"cpu", "rss", "gpu", "gpu_memory"}``, None where unknown."""
    _expect(POOL_HEARTBEAT, frame)
    if len(frame) != _POOL_HEARTBEAT.size:
        raise _truncated(POOL_HEARTBEAT, frame, f"{_POOL_HEARTBEAT.size} bytes")
    _, cpu, rss, gpu, gpu_memory = _POOL_HEARTBEAT.unpack(frame)
    return {"cpu": cpu, "rss": None if rss < 0 else rss, "gpu": None if gpu < 0 else gpu,
            "gpu_memory": None if gpu_memory < 0 else gpu_memory}


def encode_pool_drain(batch: int) -> bytes:
    return _POOL_DRAIN.pack(POOL_DRAIN, batch)


def decode_pool_drain(frame: bytes | bytearray) -> int:
    """The batch the worker still finishes (-1: none) of a POOL_DRAIN frame."""
    _expect(POOL_DRAIN, frame)
    if len(frame) != _POOL_DRAIN.size:
        raise _truncated(POOL_DRAIN, frame, f"{_POOL_DRAIN.size} bytes")
    return _POOL_DRAIN.unpack(frame)[1]


def encode_pool_results(batch: int, seconds: float, results: list) -> bytes:
    """The body of a POOL_RESULTS frame; raises if a result cannot be pickled."""
    return dumps((batch, seconds, results))


def decode_pool_results(frame: bytes | bytearray) -> tuple[int, float, list]:
    """(batch, seconds, results) of a POOL_RESULTS frame; raises if they cannot be unpickled."""
    return loads(body(frame))


# -- queue ----------------------------------------------------------------------------

_QUEUE_PUT = BY_CODE[QUEUE_PUT].struct()
_QUEUE_GET = BY_CODE[QUEUE_GET].struct(optional=False)  # without its window ...
_QUEUE_LEND = BY_CODE[QUEUE_GET].struct()  # ... and with it
_QUEUE_LOAN = BY_CODE[QUEUE_LOAN].struct()
_QUEUE_ACK = BY_CODE[QUEUE_ACK].struct()
_QUEUE_RETURN = BY_CODE[QUEUE_RETURN].struct()
_QUEUE_SIZES = BY_CODE[QUEUE_SIZES].struct()
_QUEUE_BATCH = BY_CODE[QUEUE_BATCH].struct()
_SIZE = struct.Struct("!I")
_PUT_SIZE = _QUEUE_PUT.size
_NO_TIMEOUT = -1.0
_PUT_BLOCK = _QUEUE_PUT.pack(QUEUE_PUT, True, _NO_TIMEOUT)
_PUT_NOBLOCK = _QUEUE_PUT.pack(QUEUE_PUT, False, _NO_TIMEOUT)
_COPY_BELOW = 65536  # a smaller item is copied out of its frame, a bigger one is not


def _timeout(timeout: float | None) -> float:
    if timeout is None:
        return _NO_TIMEOUT
    if timeout < 0:
        raise ValueError("'timeout' must be a non-negative number")
    return timeout


def encode_queue_put(block: bool, timeout: float | None) -> bytes:
    """The head of a QUEUE_PUT frame; the pickled item is its body."""
    if timeout is None:
        return _PUT_BLOCK if block else _PUT_NOBLOCK
    return _QUEUE_PUT.pack(QUEUE_PUT, bool(block), _timeout(timeout))


def decode_queue_put(frame: bytes | bytearray
                     ) -> tuple[bool, float | None, bytes | bytearray | memoryview]:
    """(block, timeout, item) of a QUEUE_PUT frame."""
    try:
        _, block, timeout = _QUEUE_PUT.unpack_from(frame)
    except struct.error:
        raise _truncated(QUEUE_PUT, frame, f"at least {_PUT_SIZE} bytes") from None
    return block, None if timeout < 0 else timeout, decode_queue_put_item(frame)


def decode_queue_put_item(frame: bytes | bytearray) -> bytes | bytearray | memoryview:
    """The item of a QUEUE_PUT frame: a copy when small (cheaper to make and to
    unpickle), else a view. Called per item: it checks only that there is one."""
    item = frame[_PUT_SIZE:] if len(frame) <= _COPY_BELOW else memoryview(frame)[_PUT_SIZE:]
    if not item:  # a pickle is never empty
        raise _truncated(QUEUE_PUT, frame, f"more than {_PUT_SIZE} bytes")
    return item


def encode_queue_get(block: bool, timeout: float | None, window: int | None = None) -> bytes:
    """A QUEUE_GET frame; with a ``window``, for a borrowing connection."""
    if window is None:
        return _QUEUE_GET.pack(QUEUE_GET, bool(block), _timeout(timeout))
    return _QUEUE_LEND.pack(QUEUE_GET, bool(block), _timeout(timeout), window)


def decode_queue_get(frame: bytes | bytearray) -> tuple[bool, float | None, int | None]:
    """(block, timeout, window or None) of a QUEUE_GET frame."""
    if len(frame) == _QUEUE_LEND.size:
        _, block, timeout, window = _QUEUE_LEND.unpack(frame)
    elif len(frame) == _QUEUE_GET.size:
        _, block, timeout = _QUEUE_GET.unpack(frame)
        window = None
    else:
        raise _truncated(QUEUE_GET, frame, f"{_QUEUE_GET.size} or {_QUEUE_LEND.size} bytes")
    return block, None if timeout < 0 else timeout, window


def _unpack(packer: struct.Struct, code: bytes, frame: bytes | bytearray) -> tuple:
    if len(frame) != packer.size:
        raise _truncated(code, frame, f"{packer.size} bytes")
    return packer.unpack(frame)


def encode_queue_loan(token: int) -> bytes:
    return _QUEUE_LOAN.pack(QUEUE_LOAN, token)


def decode_queue_loan(frame: bytes | bytearray) -> int:
    return _unpack(_QUEUE_LOAN, QUEUE_LOAN, frame)[1]


def encode_queue_ack(n: int) -> bytes:
    return _QUEUE_ACK.pack(QUEUE_ACK, n)


def decode_queue_ack(frame: bytes | bytearray) -> int:
    return _unpack(_QUEUE_ACK, QUEUE_ACK, frame)[1]


def encode_queue_return(n: int) -> bytes:
    return _QUEUE_RETURN.pack(QUEUE_RETURN, n)


def decode_queue_return(frame: bytes | bytearray) -> int:
    return _unpack(_QUEUE_RETURN, QUEUE_RETURN, frame)[1]


def encode_queue_sizes(waiting: int, used: int) -> bytes:
    return _QUEUE_SIZES.pack(QUEUE_SIZES, waiting, used)


def decode_queue_sizes(frame: bytes | bytearray) -> tuple[int, int]:
    """(items waiting, room used) of a QUEUE_SIZES frame."""
    _, waiting, used = _unpack(_QUEUE_SIZES, QUEUE_SIZES, frame)
    return waiting, used


def encode_queue_batch(items: Sequence[bytes | bytearray | memoryview]) -> bytes:
    """A QUEUE_BATCH frame of ``items``."""
    sizes = b"".join([_SIZE.pack(len(item)) for item in items])
    return b"".join([_QUEUE_BATCH.pack(QUEUE_BATCH, len(items)), sizes, *items])


def decode_queue_batch(frame: bytes | bytearray) -> list[memoryview]:
    """The items of a QUEUE_BATCH frame, as views of it."""
    head = _QUEUE_BATCH.size
    try:
        (n,) = _SIZE.unpack_from(frame, 1)
        sizes = struct.unpack_from(f"!{n}I", frame, head)
    except struct.error:
        raise _truncated(QUEUE_BATCH, frame, "its count and sizes") from None
    view = memoryview(frame)
    pos = head + 4 * n
    if pos + sum(sizes) != len(frame):
        raise _truncated(QUEUE_BATCH, frame, f"{pos + sum(sizes)} bytes for its {n} items")
    items = []
    for size in sizes:
        items.append(view[pos:pos + size])
        pos += size
    return items


# -- status ---------------------------------------------------------------------------


def encode_status_state(state: dict[str, Any]) -> bytes:
    """The body of a STATUS_STATE frame: JSON, so that a viewer unpickles nothing."""
    import json  # the status view only: a job starts without it

    return json.dumps(state, separators=(",", ":")).encode()


def decode_status_state(frame: bytes | bytearray) -> dict[str, Any]:
    import json

    _expect(STATUS_STATE, frame)
    try:
        state = json.loads(bytes(body(frame)))
    except ValueError as e:
        raise MessageError(f"a STATUS_STATE frame that is not JSON: {e}") from None
    if not isinstance(state, dict):
        raise MessageError("a STATUS_STATE frame whose JSON is not an object")
    return state
