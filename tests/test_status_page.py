"""The status page in a real headless browser (Debian's chromium, driven over the DevTools protocol).

A program (tests/status_program.py) maps on a pool with ``FIBER_STATUS_PORT=0``; the test
reads the page's address from the program's stderr, as a person would, and opens it in
chromium: without the token and with a wrong one the answer is 403; with it, the page
shows the pool's three workers and its progress moving, and says when the program has
ended. A screenshot is kept in ``test-artifacts/status-page.png``.

``scripts/test-services.sh up`` installs chromium (scripts/services/browser.sh); without it
the test is skipped, saying so. The browser is kept off every network but loopback: no
proxy, and every host name but 127.0.0.1 resolves to nothing. ``T`` bounds every wait:
reaching it is a failure, never a measure of speed.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fiber_core.runtime.status_page import StatusPage

websocket = pytest.importorskip("websocket", reason="websocket-client (requirements-test.txt) drives the browser")

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed
PROGRAM = Path(__file__).with_name("status_program.py")
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/test-services.sh up "
                                                "installs it: scripts/services/browser.sh)"),
    pytest.mark.timeout(120),
]


class Browser:
    """A headless chromium and one of its pages, spoken to over the DevTools protocol."""

    def __init__(self, profile: Path) -> None:
        assert CHROMIUM is not None
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--disable-extensions",
             "--disable-default-apps", "--disable-domain-reliability", "--metrics-recording-only",
             "--no-proxy-server", "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
             "--window-size=1200,900", "--remote-debugging-address=127.0.0.1",
             "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._id = 0
        self.events: list[dict[str, Any]] = []
        try:
            port = self._devtools_port()
            targets = json.load(_opener().open(f"http://127.0.0.1:{port}/json/list", timeout=T))
            [page] = [t for t in targets if t["type"] == "page"]
            self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=T,
                                                  suppress_origin=True)
        except BaseException:
            self.close()
            raise
        self.call("Page.enable")
        self.call("Network.enable")

    def _devtools_port(self) -> int:
        assert self.proc.stderr is not None
        lines = []
        for line in self.proc.stderr:  # ends when chromium does
            lines.append(line)
            found = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
            if found:
                return int(found.group(1))
        raise AssertionError("chromium ended before it listened:\n" + "".join(lines[-20:]))

    def _receive(self) -> dict[str, Any]:
        message = json.loads(self.ws.recv())
        if "id" not in message:
            self.events.append(message)
        return message

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            message = self._receive()
            if message.get("id") == self._id:
                if "error" in message:
                    raise AssertionError(f"{method}: {message['error']}")
                return message["result"]

    def open(self, url: str) -> int:
        """Load ``url`` until its load event; return the HTTP status of the document."""
        self.events.clear()
        self.call("Page.navigate", url=url)
        while not any(e["method"] == "Page.loadEventFired" for e in self.events):
            self._receive()
        [status] = [e["params"]["response"]["status"] for e in self.events
                    if e["method"] == "Network.responseReceived" and e["params"]["type"] == "Document"]
        return int(status)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, condition: str, what: str) -> Any:
        """Wait until the JavaScript ``condition`` is truthy, woken by each change of the page."""
        try:
            return self.evaluate(f"""new Promise((resolve, reject) => {{
                const check = () => {{ const v = ({condition}); if (v) {{ observer.disconnect(); resolve(v); }} return v; }};
                const observer = new MutationObserver(check);
                if (!check()) {{
                    observer.observe(document, {{subtree: true, childList: true, characterData: true, attributes: true}});
                    setTimeout(() => {{ observer.disconnect(); reject(new Error("timed out")); }}, {int(T * 1000) - 2000});
                }}
            }})""")
        except AssertionError as e:
            text = self.evaluate("document.body ? document.body.innerText : ''")
            raise AssertionError(f"the page never showed {what}: {e}\nit shows:\n{text}") from None

    def screenshot(self, path: Path, whole: bool = False) -> bytes:
        """A PNG of the page as shown, or of the whole page (``whole``), kept at ``path``."""
        params: dict[str, Any] = {"format": "png"}
        if whole:
            size = self.call("Page.getLayoutMetrics")["cssContentSize"]
            params.update(captureBeyondViewport=True,
                          clip={"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1})
        data = base64.b64decode(self.call("Page.captureScreenshot", **params)["data"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return data

    def close(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            ws.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(T)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(T)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


def _opener() -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, never a proxy


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    b = Browser(tmp_path / "profile")
    try:
        yield b
    finally:
        b.close()


@pytest.fixture
def program() -> Iterator[tuple[subprocess.Popen[str], str, str, Path]]:
    """The program with its page: (process, run id, the page's address, its run file)."""
    with _program() as found:
        yield found


@contextlib.contextmanager
def _program(*args: str) -> Iterator[tuple[subprocess.Popen[str], str, str, Path]]:
    tmpdir = tempfile.mkdtemp(prefix="fpage-")  # short: it holds the hub's Unix socket
    proc = subprocess.Popen([sys.executable, str(PROGRAM), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": tmpdir, "FIBER_STATUS_PORT": "0"})
    assert proc.stdout is not None and proc.stderr is not None and proc.stdin is not None
    try:
        line = proc.stdout.readline()
        while line.startswith("[PoolWorker-"):  # a worker's line, printed before it
            line = proc.stdout.readline()
        assert line.startswith("run "), (line, proc.stderr.read() if proc.poll() is not None else "")
        run_id = line.split()[1]
        # The rest of its output (the workers' lines, prefixed) is read as it comes: a
        # full pipe would stop the program.
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        url = None
        for err in proc.stderr:  # what the person who started it reads
            found = re.match(rf"fiber: status page of run {run_id}: (http://127\.0\.0\.1:\d+/\?token=\w+)$",
                             err.strip())
            if found:
                url = found.group(1)
                break
        assert url is not None, "the program did not print its page's address"
        [run_file] = Path(tmpdir).glob("fiber-*/status.json")
        yield proc, run_id, url, run_file
    finally:
        proc.stdin.close()  # it terminates its pool and exits
        try:
            proc.wait(T)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(T)
            proc.stdout.close()
            proc.stderr.close()
            shutil.rmtree(tmpdir, ignore_errors=True)


WORKERS = "[...document.querySelectorAll('tr.worker')]"
DONE = "Number(document.querySelector('.progress') && document.querySelector('.progress').dataset.done)"


def test_the_status_page_in_a_browser_needs_the_token_and_shows_the_pool_at_work(
        browser: Browser, program: tuple[subprocess.Popen[str], str, str, Path]) -> None:
    proc, run_id, url, run_file = program
    key = json.loads(run_file.read_text())["key"]
    base, token = url.split("?token=")

    # Without the token, or with another, the page is refused and shows nothing of the run.
    for bad in (base, f"{base}?token={'0' * len(token)}", f"{base}status.json"):
        assert browser.open(bad) == 403, bad
        text = browser.evaluate("document.body.innerText")
        assert text.startswith("403 Forbidden") and run_id not in text

    assert browser.open(url) == 200
    browser.wait_for(f"{WORKERS}.length === 3 && {WORKERS}.every(r => r.dataset.state === 'busy') && {DONE} > 0",
                     "three busy workers and tasks done")
    text = browser.evaluate("document.body.innerText")
    assert f"Fiber run {run_id}" in text and "status_program.py" in text
    for name in ("PoolWorker-1", "PoolWorker-2", "PoolWorker-3"):
        assert name in text
    assert re.search(r"\d+ of 100000 tasks done \(\d+%\)", text)
    assert "map(slow)" in text and "tasks/s" in text
    rows = browser.evaluate(f"{WORKERS}.map(r => [...r.cells].map(c => c.innerText))")
    assert [r[1] for r in rows] == ["local"] * 3 and all(r[3].isdigit() for r in rows)

    # It refreshes by itself: the progress moves on.
    done = browser.evaluate(DONE)
    browser.wait_for(f"{DONE} > {done}", "the progress moving")
    shot = browser.screenshot(ARTIFACTS / "status-page.png")
    assert shot.startswith(b"\x89PNG\r\n\x1a\n") and len(shot) > 10_000

    html = browser.evaluate("document.documentElement.outerHTML")
    assert key not in html  # the run's key is never on the page

    # The program ends: the page says it cannot reach it any more.
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(T)
    browser.wait_for("document.getElementById('conn').className === 'down'", "that the program ended")
    assert "cannot reach the program" in browser.evaluate("document.getElementById('conn').innerText")


# -- a run with losses, and a run of 512 workers ----------------------------------------------

LOST = "document.querySelector('tr.timeline-row[data-lost=\"1\"]')"


def test_the_page_of_a_run_with_a_loss_shows_the_lost_worker_its_reason_its_lines_and_the_chart(
        browser: Browser) -> None:
    with _program("--losses") as (proc, run_id, url, _):
        assert browser.open(url) == 200
        browser.wait_for(f"{LOST} && document.querySelector('tr.loss') && {WORKERS}.length === 3",
                         "a lost worker in the timeline and the losses, and three workers")
        lost = browser.evaluate(f"[{LOST}.dataset.name, {LOST}.dataset.end, {LOST}.innerText]")
        assert lost[1] == "stopped" and f"lost: stopped \u2014 {lost[0]}" in lost[2]
        assert "stopped by Fiber" in lost[2] or "stopped" in lost[2]
        loss = browser.evaluate("[...document.querySelectorAll('tr.loss')].map(r => "
                                "[r.dataset.worker, r.dataset.reason, r.querySelector('td.lines').dataset.lines])")
        assert loss == [[lost[0], "stopped", loss[0][2]]] and int(loss[0][2]) > 0

        # Its last lines, one click away.
        browser.evaluate("document.querySelector('tr.loss td.lines').click()")
        text = browser.wait_for("document.querySelector('tr.loss pre.log') && "
                                "document.querySelector('tr.loss pre.log').innerText", "the lost worker's lines")
        assert re.search(r"^item \d+: done$", text.split("\n")[-1])
        # The live workers' lines too, and their states over time.
        browser.wait_for(f"{WORKERS}.every(r => r.querySelector('td.lines').dataset.lines > 0)",
                         "each worker's last line")
        assert re.match(r"item \d+: done", browser.evaluate(
            "document.querySelector('tr.worker td.lines').innerText"))
        browser.wait_for("document.querySelectorAll('tr.timeline-row svg.track rect').length >= 4",
                         "the workers' states over time (sampled once a second)")

        # The chart has data: a bar for each second tasks were done.
        points = browser.wait_for("Number(document.querySelector('svg.chart').dataset.points) > 1 && "
                                  "document.querySelectorAll('svg.chart rect').length", "the throughput chart")
        assert points >= 2
        shot = browser.screenshot(ARTIFACTS / "status-page-losses.png", whole=True)
        assert shot.startswith(b"\x89PNG\r\n\x1a\n") and len(shot) > 10_000
        # The page's own style and script run under its policy (no 'unsafe-inline').
        assert browser.evaluate("getComputedStyle(document.querySelector('.pool')).backgroundColor") == \
            "rgb(255, 255, 255)"


def _big_state(workers: int = 512) -> dict[str, Any]:
    """A state as a pool of ``workers`` with the resource use (issue's ``usage`` keys),
    a cost per hour and a loss would show it."""
    rows, timeline = [], []
    for i in range(1, workers + 1):
        rows.append({"name": f"PoolWorker-{i}", "id": str(1000 + i), "backend": "local", "host": "h",
                     "state": "busy" if i % 3 else "idle", "for_seconds": 5.0, "done": i, "in_flight": 1,
                     "output": [f"step {j} of worker {i}" for j in range(4)],
                     "usage": {"cpu": 50.0 + i % 50, "rss": (100 + i) << 20,
                               "gpu": 30.0 if i % 2 else None, "gpu_memory": (1 << 30) if i % 2 else None},
                     "usage_history": [[60.0 - k, 40.0 + k, (100 + i) << 20] for k in range(0, 60, 5)]})
        timeline.append({"name": f"PoolWorker-{i}", "id": str(1000 + i), "host": "h", "started_ago": 120.0,
                         "events": [[120.0, "starting"], [118.0, "busy"], [30.0, "idle"], [20.0, "busy"]],
                         "end": None})
    description = "PoolWorker-600 was killed by the system: out of memory (memory 1 GiB)"
    timeline.append({"name": "PoolWorker-600", "id": "1600", "host": "h2", "started_ago": 100.0,
                     "events": [[100.0, "busy"], [40.0, "lost"]],
                     "end": {"reason": "oom", "description": description, "lost": True, "ago": 40.0}})
    pool = {"id": "abcd1234", "state": "RUN", "error": None, "backend": "local", "size": workers,
            "min_size": workers, "elastic": False, "age_seconds": 120.0,
            "tasks": {"queued": 10_000, "running": workers, "done": 500_000, "failed": 0},
            "throughput": 900.0, "throughput_seconds": 10,
            "throughput_history": [[float(s), 800 + s, 1] for s in range(120, 0, -1)],
            "losses": {"oom": 1}, "last_loss": description, "calls": [], "workers": rows,
            "timeline": timeline, "cost_per_hour": 12.5,
            "loss_log": [{"worker": "PoolWorker-600", "id": "1600", "host": "h2", "reason": "oom",
                          "description": description, "ago": 40.0,
                          "output": ["allocating 2 GiB", "<script>document.title='owned'</script>"]}]}
    return {"run": {"id": "r512", "program": "big.py", "pid": 1, "host": "h", "backend": "local",
                    "now": 1000.0, "started": 880.0},
            "pools": [pool], "processes": []}


def test_the_page_draws_resource_use_cost_and_512_workers_fifty_rows_at_a_time(browser: Browser) -> None:
    state = _big_state()
    assert len(json.dumps(state)) < 1_000_000
    page = StatusPage(lambda: state, "t" * 32)
    try:
        assert browser.open(f"http://127.0.0.1:{page.port}/?token={'t' * 32}") == 200
        browser.wait_for(f"{WORKERS}.length === 50", "the first 50 workers")
        text = browser.evaluate("document.body.innerText")
        assert "costs $12.50 per hour" in text and "rows 1-50 of 512" in text
        assert browser.evaluate("document.querySelectorAll('tr.worker .usage.cpu .meter').length") == 50
        assert browser.evaluate("document.querySelectorAll('tr.worker svg.spark').length") == 50
        first = browser.evaluate("[...document.querySelector('tr.worker').cells].map(c => c.innerText.trim())")
        assert first[8] == "51%" and first[9] == "101.0 MiB" and first[10] == "30% \u00b7 1.0 GiB"
        assert first[11] == "step 3 of worker 1"
        width = browser.evaluate("document.querySelector('tr.worker .usage.mem .fill').style.width")
        assert 0 < float(width.rstrip("%")) < 100
        assert browser.evaluate("document.querySelectorAll('svg.chart rect').length") == 120
        assert browser.evaluate("document.querySelectorAll('tr.timeline-row').length") == 50

        # The next page of workers, which stays chosen as the page refreshes.
        browser.evaluate("document.querySelector('.scroll + .pager button:nth-of-type(2)').click()")
        browser.wait_for(f"{WORKERS}[0].dataset.name === 'PoolWorker-51'", "the second page")
        assert "rows 51-100 of 512" in browser.evaluate("document.body.innerText")

        # The loss, with its reason; its lines are text, never markup that runs.
        loss = browser.evaluate("document.querySelector('tr.loss').innerText")
        assert "PoolWorker-600" in loss and "oom" in loss and "out of memory" in loss
        browser.evaluate("document.querySelector('tr.loss td.lines').click()")
        log = browser.wait_for("document.querySelector('tr.loss pre.log') && "
                               "document.querySelector('tr.loss pre.log').innerText", "the lines")
        assert "<script>document.title='owned'</script>" in log
        assert browser.evaluate("document.title") == "Fiber run r512"
        browser.screenshot(ARTIFACTS / "status-page-512.png", whole=True)
    finally:
        page.close()
