"""A queue handle whose connection to the owner is cut while both processes live.

The handle's process shuts its borrowing socket down itself (what a reset by the network
or ``ss -K`` does to it), right after its program took items faster than it acknowledges
them: those items go back to the queue, and the handle says so instead of letting them be
delivered twice unnoticed.
"""

from __future__ import annotations

import socket
from typing import Any

import fiber_core
from fiber_core.base.errors import QueueCutError

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed


def take_cut_and_go_on(q: Any, out: Any, before: int, total: int) -> None:
    got = [q.get(timeout=T) for _ in range(before)]
    q._borrower.conn._socket().shutdown(socket.SHUT_RDWR)  # the connection is cut
    reported = at = None
    while len(set(got)) < total:
        try:
            got.append(q.get(timeout=T))
        except QueueCutError as e:
            assert reported is None, "reported once"
            reported, at = e.taken, len(got)
        except fiber_core.queues.Empty:
            break
    out.put((got, reported, at))


def test_items_taken_before_a_cut_are_reported_not_silently_delivered_twice() -> None:
    n, before = 3000, 500
    q, out = fiber_core.Queue(), fiber_core.Queue()
    for i in range(n):
        q.put(i)
    p = fiber_core.Process(target=take_cut_and_go_on, args=(q, out, before, n))
    p.start()
    got, reported, at = out.get(timeout=T)
    p.join(T)
    assert p.exitcode == 0
    assert reported is not None and reported > 0  # lent in batches, acknowledged later
    twice = [x for x in set(got) if got.count(x) > 1]
    assert sorted(set(got)) == list(range(n))  # nothing lost
    assert len(got) == n + reported  # each duplicate was reported ...
    # ... and is one of those it took last before the error (the lent ones still here were
    # handed out until the handle saw the cut)
    assert sorted(twice) == sorted(got[at - reported:at])
