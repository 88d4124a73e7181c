"""The status page: one HTML page and its JSON on 127.0.0.1, each request carrying the page's token.

A stdlib HTTP server in a daemon thread. ``/`` is the page, whose script asks
``/status.json`` for the run's state every second and draws pools, workers and progress.
Every request, the page's included, needs the token (``?token=`` in the address the
program printed, or the ``X-Fiber-Token`` header the script sends), compared in constant
time; without it, or with a ``Host`` other than this address (a page of another site
that renamed itself to 127.0.0.1), the answer is 403 and nothing else. Requests are not
logged: their addresses hold the token.

Anyone on this host can connect to the page, so connections are bounded as the hub's are
(:class:`~fiber_core.runtime.hub.Handshakes`): at most :data:`PAGE_CONNECTIONS` wait for
their request, each for :data:`PAGE_TIMEOUT` seconds; past that bound the oldest that has
sent nothing is closed at once. Idle connections hold no more threads than that, and one
that sends its request (the owner's browser) is not pushed out by them.
"""

from __future__ import annotations

import hmac
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from fiber_core.base.log import log
from fiber_core.runtime.hub import Handshakes, source_of

FORBIDDEN = (b"403 Forbidden: this page needs the address with its token that the program "
             b"printed when it started serving it.\n")

_HEADERS = {
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": ("default-src 'none'; script-src 'unsafe-inline'; "
                                "style-src 'unsafe-inline'; connect-src 'self'; "
                                "frame-ancestors 'none'"),
}


PAGE_CONNECTIONS = 16
"""How many connections the page holds while their request has not come (one thread each)."""

PAGE_TIMEOUT = 5.0
"""Seconds a connection has to send its request, and each later read or write may take."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: Callable[[], dict[str, Any]]
    token: bytes
    hosts: frozenset[str]

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        self.waiting = Handshakes(PAGE_CONNECTIONS, PAGE_CONNECTIONS, PAGE_TIMEOUT)
        self._tokens: dict[int, int] = {}  # descriptor -> its token in waiting, while open
        self._tokens_lock = threading.Lock()
        super().__init__(address, handler)  # (a port that is taken: server_close, then raises)

    def process_request(self, request: Any, client_address: Any) -> None:
        token = self.waiting.admit(request.fileno(), source_of(client_address))
        with self._tokens_lock:
            self._tokens[request.fileno()] = token
        super().process_request(request, client_address)

    def _token(self, request: Any) -> int:
        with self._tokens_lock:
            return self._tokens.get(request.fileno(), -1)

    def heard(self, request: Any) -> None:
        """The request line of ``request`` came: idle connections are closed before it."""
        self.waiting.spoke(self._token(request))

    def came(self, request: Any) -> bool:
        """The whole request came: True if in time (its connection was not closed meanwhile)."""
        return self.waiting.done(self._token(request))

    def shutdown_request(self, request: Any) -> None:
        with self._tokens_lock:  # done before the descriptor is freed: never shed a reused one
            token = self._tokens.pop(request.fileno(), -1)
        self.waiting.done(token)
        super().shutdown_request(request)

    def server_close(self) -> None:
        super().server_close()
        self.waiting.close()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "fiber-status"
    sys_version = ""
    timeout = PAGE_TIMEOUT  # each read and write; a connection is closed after one response

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the request line holds the token: no log of it anywhere

    def parse_request(self) -> bool:
        self.server.heard(self.request)
        if not super().parse_request():  # (it reads the headers)
            return False
        if not self.server.came(self.request):
            self.close_connection = True
            return False
        return True

    def _allowed(self, url: Any) -> bool:
        if self.headers.get("Host", "") not in self.server.hosts:
            return False
        token = self.headers.get("X-Fiber-Token") or parse_qs(url.query).get("token", [""])[0]
        return hmac.compare_digest(token.encode("utf-8", "replace"), self.server.token)

    def _send(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in _HEADERS.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urlsplit(self.path)
        if not self._allowed(url):
            self._send(403, "text/plain; charset=utf-8", FORBIDDEN)
        elif url.path == "/":
            self._send(200, "text/html; charset=utf-8", PAGE.encode())
        elif url.path == "/status.json":
            try:
                body = json.dumps(self.server.state()).encode()
            except Exception as e:
                log.exception("fiber: the status page could not read the run's state")
                self._send(500, "text/plain; charset=utf-8", f"the run's state: {e!r}\n".encode())
                return
            self._send(200, "application/json", body)
        else:
            self._send(404, "text/plain; charset=utf-8", b"404 Not Found\n")


class StatusPage:
    """The page, served on 127.0.0.1:``port`` (0: a free port) until :meth:`close`."""

    def __init__(self, state: Callable[[], dict[str, Any]], token: str, port: int = 0) -> None:
        server = _Server(("127.0.0.1", port), _Handler)
        server.state = state
        server.token = token.encode()
        self.port = server.server_address[1]
        server.hosts = frozenset({f"127.0.0.1:{self.port}", f"localhost:{self.port}"})
        self._server = server
        self.url = f"http://127.0.0.1:{self.port}/?token={token}"
        """The page's address with its token: what opens it."""
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.25},
                                        daemon=True, name="fiber-status-page")
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Fiber run</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #1d2430; background: #f6f7f9; }
  h1 { font-size: 1.3em; margin: 0 0 .2em; }
  .muted { color: #667085; }
  #conn.down { color: #b42318; font-weight: 600; }
  .pool { background: #fff; border: 1px solid #d0d5dd; border-radius: 6px; padding: .8em 1em; margin: 1em 0; }
  .pool h2 { font-size: 1.1em; margin: 0 0 .4em; }
  .bar { position: relative; height: 1.4em; background: #eaecf0; border-radius: 4px; overflow: hidden; margin: .4em 0; }
  .bar .fill { height: 100%; background: #3b82f6; }
  .bar .label { position: absolute; inset: 0; text-align: center; line-height: 1.4em; font-size: .9em; }
  .stats span { margin-right: 1.2em; }
  .losses { color: #b42318; }
  table { border-collapse: collapse; width: 100%; margin-top: .5em; }
  th, td { text-align: left; padding: .2em .6em; border-bottom: 1px solid #eaecf0; white-space: nowrap; }
  th { font-weight: 600; color: #475467; }
  td.num, th.num { text-align: right; }
  .state-busy { color: #067647; font-weight: 600; }
  .state-idle { color: #475467; }
  .state-lost, .state-draining { color: #b42318; }
  .state-starting, .state-initializing, .state-retiring { color: #b54708; }
</style>
</head>
<body>
<h1 id="title">Fiber run</h1>
<div id="run" class="muted"></div>
<div id="conn" class="muted">connecting...</div>
<div id="pools"></div>
<div id="processes"></div>
<script>
"use strict";
const token = new URLSearchParams(location.search).get("token") || "";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function duration(s) {
  if (s < 60) return s.toFixed(1) + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + Math.floor(s % 60) + " s";
  return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
}

function table(headers, rows, numeric) {
  const head = el("tr", {}, ...headers.map((h, i) => el("th", numeric.includes(i) ? {class: "num"} : {}, h)));
  const body = rows.map(r => el("tr", r.attrs, ...r.cells.map((c, i) =>
    el("td", numeric.includes(i) ? {class: "num"} : (r.classes && r.classes[i] ? {class: r.classes[i]} : {}), c))));
  return el("table", {}, el("thead", {}, head), el("tbody", {}, ...body));
}

function renderPool(p) {
  const t = p.tasks;
  const total = t.queued + t.running + t.done;
  const pct = total ? Math.floor(100 * t.done / total) : 0;
  const size = p.elastic ? p.size + " workers at most, " + p.min_size + " at least" : p.size + " workers";
  const card = el("section", {class: "pool", "data-pool": p.id});
  card.append(el("h2", {}, "Pool " + p.id + " \\u2014 " + size + " \\u00b7 " + p.backend + " \\u00b7 " + p.state));
  const bar = el("div", {class: "bar progress", "data-done": t.done, "data-total": total},
    el("div", {class: "fill", style: "width:" + pct + "%"}),
    el("div", {class: "label"}, total ? t.done + " of " + total + " tasks done (" + pct + "%)" : "no tasks yet"));
  card.append(bar);
  card.append(el("div", {class: "stats"},
    el("span", {}, "queued " + t.queued), el("span", {}, "running " + t.running),
    el("span", {}, "done " + t.done), el("span", {}, "failed " + t.failed),
    el("span", {}, p.throughput.toFixed(1) + " tasks/s (last " + p.throughput_seconds + " s)")));
  const losses = Object.entries(p.losses);
  if (losses.length) {
    card.append(el("div", {class: "losses"}, "workers lost: " +
      losses.map(([k, v]) => k + " " + v).join(", ") + (p.last_loss ? " \\u2014 last: " + p.last_loss : "")));
  }
  if (p.error) card.append(el("div", {class: "losses"}, "failed: " + p.error));
  for (const c of p.calls) {
    card.append(el("div", {class: "call muted"}, c.call + ": " + c.units_done + " of " +
      (c.units === null ? "?" : c.units) + " units"));
  }
  const rows = p.workers.map(w => ({
    attrs: {class: "worker", "data-name": w.name, "data-state": w.state},
    classes: [null, null, null, null, "state-" + w.state],
    cells: [w.name, w.backend, w.host || "", w.id || "", w.state, duration(w.for_seconds), w.done, w.in_flight],
  }));
  card.append(table(["worker", "backend", "host", "id", "state", "for", "done", "in flight"], rows, [6, 7]));
  return card;
}

function render(s) {
  const r = s.run;
  document.title = "Fiber run " + r.id;
  document.getElementById("title").textContent = "Fiber run " + r.id;
  document.getElementById("run").textContent = r.program + " \\u00b7 pid " + r.pid + " on " + r.host +
    " \\u00b7 backend " + (r.backend || "-") + " \\u00b7 up " + duration(r.now - r.started);
  document.getElementById("pools").replaceChildren(...(s.pools.length ? s.pools.map(renderPool)
    : [el("p", {class: "muted"}, "no pool")]));
  const procs = document.getElementById("processes");
  if (s.processes.length) {
    procs.replaceChildren(el("h2", {}, "Processes"), table(["process", "backend", "host", "id", "state"],
      s.processes.map(p => ({attrs: {class: "process"}, cells: [p.name, p.backend || "", p.host || "", p.id || "", p.state]})), []));
  } else {
    procs.replaceChildren();
  }
}

async function tick() {
  const conn = document.getElementById("conn");
  try {
    const response = await fetch("status.json", {headers: {"X-Fiber-Token": token}, cache: "no-store"});
    if (!response.ok) throw new Error("HTTP " + response.status);
    render(await response.json());
    conn.className = "muted";
    conn.textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    conn.className = "down";
    conn.textContent = "cannot reach the program (" + e.message + "): it may have ended";
  }
  setTimeout(tick, 1000);
}
tick();
</script>
</body>
</html>
"""
