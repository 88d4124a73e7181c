"""What another local user of a shared host can do to a running program's hub, status page and ``fiber top``.

The other user is played for real (``nobody``, through :mod:`tenant`): it floods the hub's
TCP port and the status page with idle connections while the program works. ``fiber top``
is run as the docs say, beside a real program whose process names and worker errors hold
escape sequences. ``T`` bounds every wait: reaching it is a failure, never a measure of speed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from tenant import as_other_user, needs_root

from fiber_core.wire.auth import _MAGIC

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed


class Program:
    """A script run with ``FIBER_STATUS=1`` in a temporary directory of its own (its ``TMPDIR``).

    The script prints ``run <id>`` once it is ready, then waits for its standard input to
    close.
    """

    def __init__(self, tmp_path: Path, code: str, name: str = "program.py") -> None:
        self.tmpdir = tempfile.mkdtemp(prefix="ften-")  # short: the hub's socket path is in it
        self.env = {**os.environ, "TMPDIR": self.tmpdir}
        script = tmp_path / name
        script.write_text(code)
        self.proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     cwd=tmp_path, env={**self.env, "FIBER_STATUS": "1"})
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("run "):
            _, err = self.stop()
            pytest.fail(f"the program did not start: {line!r}\n{err[-3000:]}")
        self.run_id = line.split()[1]
        self.rest = line.split()[2:]

    def stop(self) -> tuple[str, str]:
        """Close its input and wait for its end: what it wrote to stdout and stderr."""
        try:
            out, err = self.proc.communicate(timeout=3 * T)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        finally:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
        return out, err


@pytest.fixture
def programs(tmp_path: Path) -> Iterator[list[Program]]:
    started: list[Program] = []
    try:
        yield started
    finally:
        for p in started:
            if p.proc.returncode is None:
                p.stop()


# -- fiber top: what the program sends is shown, never obeyed -------------------------------------

_HOSTILE_PROGRAM = r'''
import os, sys, threading
import fiber_core
from fiber_core.runtime.run import runtime

HOSTILE = "\x1b]0;owned\x07\x1b[2J\x1b[H\x9b31m\u202e\x7f\x00"

if __name__ != "__main__" and os.environ.get("HOSTILE_WORKER"):  # a pool worker, at its start
    sys.stderr.write(HOSTILE + "worker error\n")  # into its log, before output is forwarded
    sys.stderr.flush()
    os._exit(3)


def hold():
    threading.Event().wait(60)


if __name__ == "__main__":
    p = fiber_core.Process(target=hold, name=HOSTILE + "named", daemon=True)
    p.start()
    os.environ["HOSTILE_WORKER"] = "1"  # for the pool's workers only
    pool = fiber_core.Pool(1)
    try:
        pool.apply(len, ((),))
    except Exception as e:
        print(type(e).__name__, file=sys.stderr)
    print("run", runtime().run_id, flush=True)
    sys.stdin.read()
'''

_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u202e]")  # every control but the newline


def test_fiber_top_shows_escape_sequences_in_names_and_worker_errors_as_plain_text(
        tmp_path: Path, programs: list[Program]) -> None:
    program = Program(tmp_path, _HOSTILE_PROGRAM, name="\x1b]0;owned\x07\x1b[2Jevil.py")
    programs.append(program)
    shown = subprocess.run([sys.executable, "-m", "fiber_core.cli", "top", "--once", program.run_id],
                           capture_output=True, text=True, env=program.env, timeout=T)
    assert shown.returncode == 0, shown.stderr
    assert _CONTROL.findall(shown.stdout) == []
    # What was around the escapes is still there to read.
    assert f"run {program.run_id}  ??evil.py  pid" in shown.stdout
    assert re.search(r"^\s+\?+named\s+local\s", shown.stdout, re.M), shown.stdout
    assert re.search(r"failed .*the end of its log: \?+worker error$", shown.stdout, re.M), shown.stdout
    listed = subprocess.run([sys.executable, "-m", "fiber_core.cli", "top", "--list"],
                            capture_output=True, text=True, env=program.env, timeout=T)
    assert listed.returncode == 0, listed.stderr
    assert _CONTROL.findall(listed.stdout) == [] and "??evil.py" in listed.stdout


# -- the hub: a flood of idle connections while jobs dial in over a slow link ---------------------

_FLOODED_PROGRAM = r'''
import os, resource, sys
import fiber_core
from fiber_core.backends.local import LocalBackend
from fiber_core.runtime.config import plugins
from fiber_core.runtime.hub import pending_bound
from fiber_core.runtime.run import runtime


class SlowLinkBackend(LocalBackend):
    """Local jobs that reach their parent over TCP through a slow link (the test's relay)."""

    name = "slow-link"
    shares_this_machine = False

    def get_listen_addr(self):
        return "127.0.0.1"

    def create_job(self, spec):
        spec.env["FIBER_PARENT_HUB"] = "tcp:127.0.0.1:" + os.environ["SLOW_LINK_PORT"]
        return super().create_job(spec)


class Plugin:
    @fiber_core.hookimpl
    def fiber_register_backends(self, register):
        register(SlowLinkBackend)


def started(q, i):
    q.put(i)


if __name__ == "__main__":
    plugins().register_plugin(Plugin(), name="slow-link")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    tcp = [a for a in runtime().addresses_for(runtime().get_backend("slow-link")).split(",")
           if a.startswith("tcp:")][0]
    print("run", runtime().run_id, tcp[4:], pending_bound(), flush=True)
    os.environ["SLOW_LINK_PORT"] = sys.stdin.readline().strip()  # flooded from now on
    q = fiber_core.Queue()
    jobs = [fiber_core.Process(target=started, args=(q, i), backend="slow-link") for i in range(6)]
    for p in jobs:
        p.start()
    for p in jobs:
        p.join(60)
    print("exitcodes", *[p.exitcode for p in jobs], flush=True)
    print("started", *sorted(q.get(timeout=30) for _ in jobs), flush=True)
'''

_FLOODER = r'''
import selectors, signal, socket, sys
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sel = selectors.DefaultSelector()
shed = 0


def report(*_):
    print(shed, flush=True)
    sys.exit(0)


def connect():
    try:
        s = socket.create_connection((host, port))
    except OSError:  # the program has ended
        report()
    sel.register(s, selectors.EVENT_READ)


signal.signal(signal.SIGTERM, report)
for _ in range(n):
    connect()
print("flooding", flush=True)
while True:  # every connection the hub closes is opened again at once, saying nothing
    for key, _ in sel.select(1):
        try:
            data = key.fileobj.recv(100)
        except OSError:
            data = b""
        if not data:
            sel.unregister(key.fileobj)
            key.fileobj.close()
            shed += 1
            connect()
'''

LINK_DELAY = 1.0  # seconds a slow link takes to carry each message of a job after its first


class SlowLink:
    """A TCP relay to the hub for the jobs: their first message (the hello) goes at once, every
    later one ``LINK_DELAY`` late, so each keyed handshake waits that long for its answer."""

    def __init__(self, target: tuple[str, int]) -> None:
        self._target = target
        self._lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self._lsock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._lsock.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        with client:
            hello = client.recv(len(_MAGIC) + 16, socket.MSG_WAITALL)
            with socket.create_connection(self._target) as hub:
                hub.sendall(hello)
                back = threading.Thread(target=self._pump, args=(hub, client, 0.0), daemon=True)
                back.start()
                self._pump(client, hub, LINK_DELAY)
                back.join(T)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, delay: float) -> None:
        try:
            while data := src.recv(65536):
                if delay:
                    threading.Event().wait(delay)  # the link's latency itself
                dst.sendall(data)
        except OSError:
            pass
        for sock, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                sock.shutdown(how)
            except OSError:
                pass

    def close(self) -> None:
        self._lsock.close()


@needs_root()
@pytest.mark.timeout(180)
def test_a_flood_of_idle_connections_from_another_user_does_not_stop_jobs_dialing_in(
        tmp_path: Path, programs: list[Program]) -> None:
    program = Program(tmp_path, _FLOODED_PROGRAM)
    programs.append(program)
    address, bound = program.rest[0], int(program.rest[1])
    host, _, port = address.rpartition(":")
    link = SlowLink((host, int(port)))
    flooder = as_other_user(_FLOODER, host, port, str(4 * bound), background=True)
    assert isinstance(flooder, subprocess.Popen) and flooder.stdout is not None
    try:
        assert flooder.stdout.readline().strip() == "flooding", flooder.stderr and flooder.stderr.read()
        assert program.proc.stdin is not None
        program.proc.stdin.write(f"{link.port}\n")
        program.proc.stdin.flush()
        out, err = program.stop()
    finally:
        flooder.terminate()
        shed, _ = flooder.communicate(timeout=T)
        link.close()
    assert "exitcodes 0 0 0 0 0 0" in out, out + err[-3000:]
    assert "started 0 1 2 3 4 5" in out
    assert int(shed) >= bound  # the flood went past the bound all along


# -- the status page: idle connections from another user ------------------------------------------

_PAGE_PROGRAM = r'''
import sys
import fiber_core
from fiber_core.runtime.run import runtime

if __name__ == "__main__":
    server = fiber_core.serve_status(page=True, port=0)
    print("run", runtime().run_id, server.url, flush=True)
    sys.stdin.read()
'''

_IDLER = r'''
import socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
held = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
print("holding", flush=True)
sys.stdin.read()  # ended by the test
'''


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


@needs_root()
def test_idle_connections_from_another_user_neither_pile_up_threads_nor_keep_the_page_from_its_owner(
        tmp_path: Path, programs: list[Program]) -> None:
    from fiber_core.runtime.status_page import PAGE_CONNECTIONS

    program = Program(tmp_path, _PAGE_PROGRAM)
    programs.append(program)
    url = program.rest[0]
    port = int(re.match(r"http://127\.0\.0\.1:(\d+)/", url).group(1))  # type: ignore[union-attr]
    assert json.load(urllib.request.urlopen(url.replace("/?", "/status.json?"), timeout=T))["run"]
    before = _threads(program.proc.pid)
    idler = as_other_user(_IDLER, str(port), str(3 * PAGE_CONNECTIONS), background=True)
    assert isinstance(idler, subprocess.Popen) and idler.stdout is not None
    try:
        assert idler.stdout.readline().strip() == "holding", idler.stderr and idler.stderr.read()
        # The owner's request comes after every idle connection was accepted: answered.
        with urllib.request.urlopen(url.replace("/?", "/status.json?"), timeout=T) as answer:
            state = json.load(answer)
        assert state["run"]["id"] == program.run_id
        assert _threads(program.proc.pid) <= before + PAGE_CONNECTIONS + 2
    finally:
        idler.kill()
        idler.communicate(timeout=T)
