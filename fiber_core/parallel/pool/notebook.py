"""A pool in a Jupyter notebook: a live progress display in the cell that uses it, and ``display(pool)``.

In a notebook (an IPython kernel), the first call of a cell on a pool (``map``,
``imap``, ``apply_async``, an executor's ``submit``, ...) shows one display in that
cell: a progress bar of the tasks the cell gave the pool, the pool's throughput, its
workers and losses. A thread updates it every :data:`UPDATE_SECONDS` while tasks are
left; when the cell ends its display shows the state then (done, or still running:
calls left running go on updating it). ``display(pool)`` shows the pool's summary,
kept up to date the same way until the pool ends. Plain HTML with ``display_id``
updates: no widget extension is needed, and a notebook saved shows the last state.

Outside a notebook nothing of this runs: whether this process is an IPython kernel is
looked up once (in ``sys.modules``: nothing is imported to find out), and every later
call costs a global's read. In a terminal nothing is shown; ``fiber top``, the status
page and a progress bar over ``imap`` (docs/progress.md) are there for it.
"""

from __future__ import annotations

import html
import sys
import threading
import time
import weakref
from typing import Any

UPDATE_SECONDS = 0.5
"""How often a display in a notebook is updated while its pool works."""

WORKERS_SHOWN = 16
"""Workers listed in a pool's summary (the first ones; the status page has them all)."""

_BAR = ("display:inline-block;width:280px;height:12px;background:#eaecf0;border-radius:3px;"
        "overflow:hidden;vertical-align:middle;margin-right:8px")

_kernel: Any = None  # the IPython shell of this kernel, once looked for
_looked = False
_lock = threading.Lock()
_shown: dict[tuple[int, int], _Display] = {}  # (id of the pool, cell) -> its display there
_thread: threading.Thread | None = None
_hooked = False  # the end of each cell is heard (IPython's post_execute)


def kernel_shell() -> Any:
    """This process's IPython shell if it is a notebook's kernel, else ``None`` (looked up once)."""
    global _kernel, _looked
    if not _looked:
        _looked = True
        ipython = sys.modules.get("IPython")  # a kernel imported it before any user code
        shell = ipython.get_ipython() if ipython is not None else None
        if shell is not None and getattr(shell, "kernel", None) is not None:
            _kernel = shell
    return _kernel


# -- what is shown: pure -------------------------------------------------------------------


def _bar(fraction: float, colour: str) -> str:
    width = max(0.0, min(1.0, fraction)) * 100
    return (f'<div style="{_BAR}"><div style="width:{width:.1f}%;height:100%;background:{colour}">'
            f"</div></div>")


def progress_html(snap: dict[str, Any], base_done: int, base_losses: int, seconds: float) -> str:
    """A cell's progress on a pool: ``snap`` its status snapshot now; ``base_done`` and
    ``base_losses``, its tasks done and workers lost when the cell began using it."""
    t = snap["tasks"]
    done = t["done"] - base_done
    total = done + t["queued"] + t["running"]
    left = t["queued"] + t["running"]
    lost = sum(snap["losses"].values()) - base_losses
    busy = sum(1 for w in snap["workers"] if w["state"] == "busy")
    state = "running" if left else ("failed" if t["failed"] else "done")
    calls = ", ".join(c["call"] for c in snap["calls"][:3]) + (" ..." if len(snap["calls"]) > 3 else "")
    words = [f"{done} of {total} tasks" + (f" ({100 * done // total}%)" if total else ""),
             f"{t['failed']} failed" if t["failed"] else "",
             f"{snap['throughput']:.1f} tasks/s" if left else f"in {seconds:.1f} s",
             f"{busy} of {len(snap['workers'])} workers busy" if left else "",
             f"{lost} workers lost (last: {snap['last_loss']})" if lost > 0 else "",
             calls if left else ""]
    text = " \u00b7 ".join(w for w in words if w)
    colour = "#3b82f6" if left else ("#f04438" if t["failed"] else "#12b76a")
    return (f'<div class="fiber-progress" data-pool="{html.escape(snap["id"])}" data-done="{done}" '
            f'data-total="{total}" data-state="{state}" '
            f'style="font:13px system-ui,sans-serif;margin:4px 0">'
            f'{_bar(done / total if total else 1.0, colour)}'
            f'<span>pool {html.escape(snap["id"])}: {html.escape(text)}</span></div>')


def pool_html(snap: dict[str, Any]) -> str:
    """A pool's summary: its size and state, tasks, throughput, losses, and its first workers."""
    t = snap["tasks"]
    total = t["queued"] + t["running"] + t["done"]
    head = (f"<b>Fiber pool {html.escape(snap['id'])}</b> \u00b7 {snap['size']} workers \u00b7 "
            f"{html.escape(snap['backend'])} \u00b7 {html.escape(snap['state'])}")
    stats = (f"queued {t['queued']} \u00b7 running {t['running']} \u00b7 done {t['done']} \u00b7 "
             f"failed {t['failed']} \u00b7 {snap['throughput']:.1f} tasks/s")
    if isinstance(snap.get("cost_per_hour"), (int, float)):
        stats += f" \u00b7 {html.escape(snap.get('cost_currency') or '$')}{snap['cost_per_hour']:.2f} per hour"
    losses = ", ".join(f"{html.escape(k)} {v}" for k, v in sorted(snap["losses"].items()))
    cell = 'style="padding:1px 8px;text-align:left"'
    rows = "".join(
        f"<tr><td {cell}>{html.escape(w['name'])}</td><td {cell}>{html.escape(w['host'] or '')}</td>"
        f"<td {cell}>{html.escape(w['state'])}</td><td {cell}>{w['done']}</td>"
        f"<td {cell}><code>{html.escape((w.get('output') or [''])[-1])}</code></td></tr>"
        for w in snap["workers"][:WORKERS_SHOWN])
    more = len(snap["workers"]) - WORKERS_SHOWN
    return (f'<div class="fiber-pool" data-pool="{html.escape(snap["id"])}" data-done="{t["done"]}" '
            f'data-state="{html.escape(snap["state"])}" style="font:13px system-ui,sans-serif">'
            f"<div>{head}</div><div>{_bar(t['done'] / total if total else 0.0, '#3b82f6')}{stats}</div>"
            + (f'<div style="color:#b42318">workers lost: {losses}</div>' if losses else "")
            + f"<table><tr><th {cell}>worker</th><th {cell}>host</th><th {cell}>state</th>"
              f"<th {cell}>done</th><th {cell}>last line</th></tr>{rows}</table>"
            + (f"<div>... and {more} more workers</div>" if more > 0 else "") + "</div>")


# -- the displays and their updates: the I/O ---------------------------------------------


class _Display:
    """One display: a cell's progress on a pool, or a pool's summary (``base`` is None)."""

    __slots__ = ("pool", "handle", "base", "started", "ended")

    def __init__(self, pool: Any, handle: Any, base: tuple[int, int] | None) -> None:
        self.pool = weakref.ref(pool)
        self.handle = handle
        self.base = base
        self.started = time.monotonic()
        self.ended = False

    def html(self, snap: dict[str, Any]) -> str:
        if self.base is None:
            return pool_html(snap)
        return progress_html(snap, self.base[0], self.base[1], time.monotonic() - self.started)

    def update(self) -> None:
        """Show the pool's state now; ``ended`` once nothing is left to follow."""
        pool = self.pool()
        if pool is None:
            self.ended = True
            return
        snap = pool.status_snapshot()
        t = snap["tasks"]
        idle = not (t["queued"] or t["running"])
        self.ended = (idle and self.base is not None) or snap["state"] not in ("RUN", "CLOSE") or (
            idle and snap["state"] == "CLOSE")
        self.handle.update(_html(self.html(snap)))


def _html(text: str) -> Any:
    from IPython.display import HTML  # a kernel has it loaded: only reached in a notebook

    return HTML(text)


def _show(text: str) -> Any:
    from IPython.display import display  # as in _html

    return display(_html(text), display_id=True)


def follow_cell(pool: Any) -> None:
    """A call was made on ``pool``: in a notebook, show its progress in this cell (once per cell)."""
    shell = kernel_shell()
    if shell is None:
        return
    key = (id(pool), shell.execution_count)
    display = _Display(pool, None, None)
    with _lock:
        if key in _shown:
            return
        _shown[key] = display  # (its handle comes next: until then the updates pass it by)
    snap = pool.status_snapshot()
    display.base = (snap["tasks"]["done"], sum(snap["losses"].values()))
    display.handle = _show(display.html(snap))
    _start(shell)


def show_pool(pool: Any) -> None:
    """``display(pool)`` in a notebook: the pool's summary, updated while it runs."""
    shell = kernel_shell()
    display = _Display(pool, None, None)
    display.handle = _show(pool_html(pool.status_snapshot()))
    if shell is not None:
        with _lock:
            _shown[(id(display), -1)] = display
        _start(shell)


def _start(shell: Any) -> None:
    """Make sure the updating thread runs and the end of each cell is heard."""
    global _thread, _hooked
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_updates, daemon=True, name="fiber-notebook")
            _thread.start()
        hook, _hooked = not _hooked, True
    if hook:
        shell.events.register("post_execute", _cell_ended)


def _cell_ended() -> None:
    """IPython's post_execute, in the cell's thread before the kernel says it is done: the
    cell's displays show the state at its end (the updates go on for what still runs)."""
    with _lock:
        displays = list(_shown.items())
    for key, display in displays:
        _update(key, display)


def _update(key: tuple[int, int], display: _Display) -> None:
    if display.handle is None:
        return  # shown in a moment, by the thread that made it
    try:
        display.update()
    except Exception:  # a display must never break the program it shows
        display.ended = True
    if display.ended:
        with _lock:
            _shown.pop(key, None)


def _updates() -> None:
    """The updating thread: every :data:`UPDATE_SECONDS` while there are displays to follow."""
    global _thread
    while True:
        time.sleep(UPDATE_SECONDS)  # the update rate itself
        with _lock:
            displays = list(_shown.items())
            if not displays:
                _thread = None
                return
        for key, display in displays:
            _update(key, display)
