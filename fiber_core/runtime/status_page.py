"""The status page: one HTML page and its JSON on 127.0.0.1, each request carrying the page's token.

A stdlib HTTP server in a daemon thread. ``/`` is the page, whose script asks
``/status.json`` for the run's state every second and draws pools, workers, progress,
throughput over time, each worker's timeline, resource use and last lines, and the
losses. The page is three files of this package (``status_page.html``, ``.css``, ``.js``:
no library, no CDN; the charts are SVG drawn by the script), put together once; its
Content-Security-Policy admits that script and style by their hashes and nothing else.
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

import base64
import hashlib
import hmac
import json
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

from fiber_core.base.log import log
from fiber_core.runtime.hub import Handshakes, source_of

FORBIDDEN = (b"403 Forbidden: this page needs the address with its token that the program "
             b"printed when it started serving it.\n")

def _page() -> tuple[bytes, str]:
    """The page (its HTML with its style and script put in), and the policy that lets the
    browser run that script and apply that style and nothing else: each by its hash."""
    here = resources.files(__package__ or "fiber_core.runtime")
    style = here.joinpath("status_page.css").read_text("utf-8")
    script = here.joinpath("status_page.js").read_text("utf-8")
    html = here.joinpath("status_page.html").read_text("utf-8")
    page = html.replace("/*STYLE*/", style, 1).replace("/*SCRIPT*/", script, 1)

    def digest(text: str) -> str:
        return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"

    return page.encode(), (f"default-src 'none'; script-src {digest(script)}; style-src {digest(style)}; "
                           "connect-src 'self'; img-src 'none'; base-uri 'none'; form-action 'none'; "
                           "frame-ancestors 'none'")


PAGE, _POLICY = _page()
"""The page as served, and its Content-Security-Policy: no inline code but its own script
and style (no ``'unsafe-inline'``), no other source, requests only to this address."""

_HEADERS = {
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": _POLICY,
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

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return  # a viewer that went away (a closed tab) mid-answer: nothing to tell anyone
        super().handle_error(request, client_address)

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
            self._send(200, "text/html; charset=utf-8", PAGE)
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
