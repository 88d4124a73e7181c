"""The live view's source: a pool's snapshot while it works, losses by reason, what is exposed and to whom.

Real pools on the local backend, snapshots asked over the hub as ``fiber top`` asks; run
files in temporary directories; the status page's server asked over HTTP on 127.0.0.1
(tests/test_status_page.py drives it in a browser). ``T`` bounds every wait: reaching it
is a failure, never a measure of speed.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from procs import wait_until

import fiber_core
from fiber_core.base.errors import ConfigError, FiberError
from fiber_core.base.oom import oom_kills
from fiber_core.parallel.pool import Pool
from fiber_core.runtime import status
from fiber_core.runtime.run import runtime
from fiber_core.runtime.status_page import FORBIDDEN, StatusPage

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed


def ms_task(x: int) -> int:
    time.sleep(0.005)  # the work itself, not synchronisation
    return x



def _pool_in(state: dict[str, Any], pool: Pool) -> dict[str, Any]:
    [found] = [p for p in state["pools"] if p["id"] == pool._id[:8]]
    return found


# -- a pool's snapshot --------------------------------------------------------------------


def test_a_snapshot_asked_over_the_hub_while_a_map_runs_adds_up() -> None:
    n = 600
    server = fiber_core.serve_status()
    run = status.find_run(runtime().run_id)
    assert run.key == runtime().authkey and run.pid == os.getpid()
    assert server.path == run.path
    with Pool(2) as pool, status.Viewer(run) as viewer:
        result = pool.map_async(ms_task, range(n), chunksize=1)
        middle = []
        while not result.ready():
            state = viewer.ask()
            snap = _pool_in(state, pool)
            t = snap["tasks"]
            # Every task of the map is queued, running or done, in every snapshot.
            assert t["queued"] + t["running"] + t["done"] == n, t
            assert t["failed"] == 0
            assert t["running"] == sum(w["in_flight"] for w in snap["workers"])
            if 0 < t["done"] < n:
                middle.append(snap)
            result.wait(0.05)  # the next look comes when the map ends, or 50 ms from now
        assert result.get() == list(range(n))
        final = _pool_in(viewer.ask(), pool)

    assert len(middle) >= 3, "the map ran too fast to be seen working"
    done = [s["tasks"]["done"] for s in middle]
    assert done == sorted(done) and done[0] < done[-1]
    busy = [s for s in middle if [w["state"] for w in s["workers"]] == ["busy", "busy"]]
    assert busy, "both workers were never seen busy"
    snap = busy[-1]
    assert snap["size"] == 2 and not snap["elastic"] and snap["state"] == "RUN"
    assert snap["calls"] == [{"call": "map(ms_task)", "units_done": snap["tasks"]["done"], "units": n}]
    assert snap["throughput"] > 0 and snap["losses"] == {}
    for w in snap["workers"]:
        assert w["name"].startswith("PoolWorker-") and w["backend"] == "local"
        assert w["host"] == socket.gethostname() and w["id"].isdigit()
        assert w["in_flight"] >= 1 and w["for_seconds"] >= 0

    t = final["tasks"]
    assert (t["queued"], t["running"], t["done"], t["failed"]) == (0, 0, n, 0)
    assert final["calls"] == []
    assert sum(w["done"] for w in final["workers"]) == n
    assert {w["state"] for w in final["workers"]} == {"idle"}
    # A pool that was joined leaves the view.
    assert all(p["id"] != pool._id[:8] for p in server.state()["pools"])


def test_losses_are_counted_by_the_reason_the_backend_gives() -> None:
    n = 400
    with Pool(3) as pool:
        result = pool.map_async(ms_task, range(n), chunksize=1)
        wait_until(lambda: [w["state"] for w in pool.status_snapshot()["workers"]] == ["busy"] * 3,
                   "the three workers are busy")
        first, second = pool._pool[:2]
        os.kill(first.pid, signal.SIGKILL)  # from outside: "killed" where the cgroup counts OOM kills
        second.kill()  # by Fiber: stopped
        assert result.get(T) == list(range(n))
        wait_until(lambda: sum(pool.status_snapshot()["losses"].values()) >= 2, "both losses are counted")
        snap = pool.status_snapshot()
        outside = "exited" if oom_kills() is None else "killed"  # (else it may be an OOM kill)
        assert snap["losses"] == {outside: 1, "stopped": 1}
        assert snap["last_loss"].startswith((first.name, second.name))
        assert (snap["tasks"]["done"], snap["tasks"]["queued"], snap["tasks"]["running"]) == (n, 0, 0)
        # Both were replaced: three workers, none of them the killed ones.
        wait_until(lambda: len([w for w in pool.status_snapshot()["workers"] if w["state"] == "idle"]) == 3,
                   "the replacements are idle")
        names = {w["name"] for w in pool.status_snapshot()["workers"]}
        assert first.name not in names and second.name not in names


def chatty(x: int) -> int:
    print(f"task {x}\x1b[2J", flush=True)  # an escape sequence: the view removes it
    time.sleep(0.005)  # the work itself, not synchronisation
    return x


def test_a_lost_worker_is_in_the_timeline_and_the_losses_with_its_reason_and_last_lines() -> None:
    n = 1000
    with Pool(2) as pool:
        result = pool.map_async(chatty, range(n), chunksize=1)
        wait_until(lambda: [bool(w["output"]) for w in pool.status_snapshot()["workers"]] == [True, True],
                   "both workers printed")
        [w] = [w for w in pool.status_snapshot()["workers"] if w["name"] == pool._pool[0].name]
        assert all(line.startswith("task ") and "\x1b" not in line for line in w["output"])
        victim = pool._pool[0]
        victim.kill()  # by Fiber: stopped
        assert result.get(T) == list(range(n))
        wait_until(lambda: pool.status_snapshot()["loss_log"], "the loss is logged")
        snap = pool.status_snapshot()
        [loss] = snap["loss_log"]
        assert loss["worker"] == victim.name and loss["reason"] == "stopped"
        assert loss["description"] == snap["last_loss"] and loss["ago"] >= 0
        assert loss["output"] and all(line.startswith("task ") for line in loss["output"])
        track = next(t for t in snap["timeline"] if t["name"] == victim.name)
        assert track["end"]["lost"] and track["end"]["reason"] == "stopped"
        assert track["events"][-1][1] == "lost" and track["id"] == str(victim.pid)
        live = [t for t in snap["timeline"] if t["end"] is None]
        assert len(live) == 2 and victim.name not in {t["name"] for t in live}
        # Every task done is in the throughput's history, each second once.
        assert sum(n_done for _, n_done, _ in snap["throughput_history"]) == n


def test_workers_replaced_after_maxtasksperchild_are_no_losses() -> None:
    with Pool(1, maxtasksperchild=2) as pool:
        assert pool.map(ms_task, range(6), chunksize=1) == list(range(6))
        snap = pool.status_snapshot()
        assert snap["losses"] == {} and snap["tasks"]["done"] == 6
        assert snap["workers"][0]["name"] != "PoolWorker-1"  # it was replaced


def test_a_failed_task_is_done_and_failed() -> None:
    with Pool(1) as pool:
        with pytest.raises(ZeroDivisionError):
            pool.starmap(divmod, [(1, 1), (1, 0), (2, 1)], chunksize=1)
        wait_until(lambda: pool.status_snapshot()["tasks"]["done"] == 3, "all three are back")
        t = pool.status_snapshot()["tasks"]
        assert (t["done"], t["failed"], t["queued"], t["running"]) == (3, 1, 0, 0)


# -- what is exposed, and to whom --------------------------------------------------------


NOT_ASKED = """
import os
import fiber_core
from fiber_core.runtime.hub import dial
from fiber_core.runtime.run import runtime

with fiber_core.Pool(1) as pool:
    assert pool.map(abs, [-1]) == [1]
    rt = runtime()
    print(sorted(os.listdir(rt.rundir)))
    try:
        dial(rt.hub.addresses, rt.authkey, "status")
    except ConnectionError as e:
        print("refused:", e)
"""


def test_nothing_is_exposed_unless_asked(run_script: Any) -> None:
    done = run_script(NOT_ASKED)
    assert done.returncode == 0, done.stderr
    assert "status.json" not in done.stdout and "hub.sock" in done.stdout
    assert "refused: cannot reach" in done.stdout and "status is not served by that process" in done.stdout
    assert "fiber top" not in done.stderr


ASKED = """
import json, os, stat, sys
import fiber_core
from fiber_core.base.errors import AuthenticationError
from fiber_core.runtime.hub import dial
from fiber_core.runtime.run import runtime

with fiber_core.Pool(1) as pool:
    rt = runtime()
    path = os.path.join(rt.rundir, "status.json")
    with open(path) as f:
        info = json.load(f)
    try:
        dial(rt.hub.addresses, os.urandom(32), "status").close()
        wrong = "accepted"
    except AuthenticationError as e:
        wrong = "refused"
    print(json.dumps({
        "file_mode": stat.S_IMODE(os.stat(path).st_mode), "dir_mode": stat.S_IMODE(os.stat(rt.rundir).st_mode),
        "key_is_the_run's": info["key"] == rt.authkey.hex(), "addresses": info["addresses"] == rt.hub.addresses,
        "id": info["id"] == rt.run_id, "pid": info["pid"] == os.getpid(), "wrong_key": wrong,
        "rundir": rt.rundir, "argv_has_key": rt.authkey.hex() in " ".join(sys.argv),
    }))
"""


def test_asked_by_the_setting_the_run_file_is_private_and_the_hub_wants_the_key(run_script: Any) -> None:
    done = run_script(ASKED, env={"FIBER_STATUS": "1"})
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen.pop("file_mode") == 0o600 and seen.pop("dir_mode") == 0o700
    rundir = seen.pop("rundir")
    assert seen == {"key_is_the_run's": True, "addresses": True, "id": True, "pid": True,
                    "wrong_key": "refused", "argv_has_key": False}
    assert "shows its state: fiber top " in done.stderr
    assert not os.path.exists(rundir)  # gone with the run, the run file with it


def test_init_once_the_run_is_under_way_shows_it_at_once(run_script: Any) -> None:
    done = run_script("""
        import os
        import fiber_core
        from fiber_core.runtime.run import runtime

        with fiber_core.Pool(1) as pool:
            path = os.path.join(runtime().rundir, "status.json")
            before = os.path.exists(path)
            fiber_core.init(status=True)
            print(before, os.path.exists(path), pool.map(abs, [-2]))
        """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "[2]"]
    assert done.stderr.count("shows its state: fiber top") == 1


def test_a_page_whose_port_is_taken_is_a_warning_and_the_work_goes_on(run_script: Any) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_script("""
            import fiber_core
            with fiber_core.Pool(1) as pool:
                print(pool.map(abs, [-3]))
            """, env={"FIBER_STATUS_PORT": str(port)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[3]"
    assert f"the status page cannot use port {port} on 127.0.0.1: it is in use" in done.stderr
    assert "shows its state: fiber top" in done.stderr  # fiber top still works


def test_a_bad_port_is_refused() -> None:
    with pytest.raises(ConfigError, match="from 0 to 65535"):
        fiber_core.serve_status(page=True, port=70000)
    with pytest.raises(ConfigError, match="bad value 'x' for status_port"):
        fiber_core.init(status_port="x")


# -- finding runs ---------------------------------------------------------------------------


def _run_file(base: Path, run_id: str, pid: int, started: float, mode: int = 0o600,
              dir_mode: int = 0o700) -> Path:
    d = base / f"fiber-{run_id}-abc"
    d.mkdir(mode=0o700)
    path = d / "status.json"
    path.write_text(json.dumps({"id": run_id, "pid": pid, "started": started, "program": "app.py",
                                "addresses": "unix:/nowhere", "key": "ab" * 32, "page": None}))
    os.chmod(path, mode)
    os.chmod(d, dir_mode)
    return path


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(T)
    return child.pid


def test_runs_are_found_newest_first_and_only_live_private_ones_of_this_user(tmp_path: Path) -> None:
    me = os.getpid()
    _run_file(tmp_path, "aaa111", me, 100.0)
    _run_file(tmp_path, "bbb222", me, 300.0)
    _run_file(tmp_path, "ccc333", _dead_pid(), 400.0)  # its program ended (SIGKILL left the file)
    _run_file(tmp_path, "ddd444", me, 500.0, mode=0o644)  # readable by others: not trusted
    _run_file(tmp_path, "eee555", me, 600.0, dir_mode=0o755)
    link_dir = tmp_path / "fiber-fff666-abc"
    link_dir.mkdir(mode=0o700)
    (link_dir / "status.json").symlink_to(tmp_path / "fiber-aaa111-abc" / "status.json")
    if os.geteuid() == 0:
        other = _run_file(tmp_path, "hhh888", me, 800.0)
        os.chown(other, 4321, -1)  # another user's file
    (tmp_path / "unrelated").mkdir()

    runs = status.find_runs(str(tmp_path))
    assert [r.run_id for r in runs] == ["bbb222", "aaa111"]
    assert runs[0].key == bytes.fromhex("ab" * 32) and runs[0].program == "app.py"
    assert status.find_run(tmpdir=str(tmp_path)).run_id == "bbb222"
    assert status.find_run("aaa", tmpdir=str(tmp_path)).run_id == "aaa111"
    with pytest.raises(FiberError, match=r"no running program of yours with run id 'ccc333'.*bbb222, aaa111"):
        status.find_run("ccc333", tmpdir=str(tmp_path))
    _run_file(tmp_path, "aaa999", me, 50.0)
    with pytest.raises(FiberError, match="the beginning of several"):
        status.find_run("aaa", tmpdir=str(tmp_path))


def test_no_run_says_how_to_show_one(tmp_path: Path) -> None:
    with pytest.raises(FiberError, match="start it with FIBER_STATUS=1"):
        status.find_run(tmpdir=str(tmp_path))


# -- the status page's server --------------------------------------------------------------


def _get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=T)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def test_the_page_token_is_derived_from_the_key_and_reveals_nothing_of_it() -> None:
    key = os.urandom(32)
    token = status.page_token(key)
    assert token == status.page_token(key) and len(token) == 32 and int(token, 16) >= 0
    assert token != status.page_token(os.urandom(32))
    assert token not in key.hex()


def test_the_page_server_answers_only_with_the_token_on_loopback() -> None:
    token = status.page_token(os.urandom(32))
    state = {"run": {"id": "r1"}, "pools": [], "processes": []}
    page = StatusPage(lambda: state, token)
    # A token one character off (never the token itself, whatever its last character is).
    near = token[:-1] + ("1" if token[-1] == "0" else "0")
    try:
        port = page.port
        assert page.url == f"http://127.0.0.1:{port}/?token={token}"
        assert page._server.server_address[0] == "127.0.0.1"
        for path, headers in (("/", {}), ("/status.json", {}), (f"/?token={near}", {}),
                              ("/status.json", {"X-Fiber-Token": "x" * 32}), ("/nowhere", {}),
                              ("/status.json", {"X-Fiber-Token": token + "0"}),
                              ("/?token=%C3%A9t%C3%A9", {})):
            code, _, body = _get(port, path, headers)
            assert (code, body) == (403, FORBIDDEN), path
        # The right token but a Host of another name (a rebound DNS name): refused too.
        code, _, _ = _get(port, f"/?token={token}", {"Host": f"attacker.example:{port}"})
        assert code == 403

        code, headers, body = _get(port, f"/?token={token}")
        assert code == 200 and headers["Content-Type"].startswith("text/html")
        assert b"status.json" in body and token.encode() not in body
        assert headers["Cache-Control"] == "no-store" and headers["Referrer-Policy"] == "no-referrer"
        policy = headers["Content-Security-Policy"]
        assert "connect-src 'self'" in policy and "default-src 'none'" in policy
        # The page's own script and style only, by their hashes: no inline code of anyone else.
        assert "'unsafe-inline'" not in policy and "script-src 'sha256-" in policy
        code, headers, body = _get(port, "/status.json", {"X-Fiber-Token": token})
        assert code == 200 and headers["Content-Type"] == "application/json"
        assert json.loads(body) == state
        code, _, _ = _get(port, f"/status.json?token={token}", {"Host": f"localhost:{port}"})
        assert code == 200
        assert _get(port, f"/elsewhere?token={token}")[0] == 404
    finally:
        page.close()
    with pytest.raises(OSError):
        _get(port, "/")


def test_the_page_is_served_by_the_run_when_asked_and_its_state_is_the_runs() -> None:
    server = fiber_core.serve_status(page=True)
    url = server.url
    assert url is not None and url.startswith("http://127.0.0.1:")
    assert fiber_core.serve_status(page=True).url == url  # once per run
    token = status.page_token(runtime().authkey)
    assert url.endswith(f"/?token={token}")
    port = int(url.split(":")[2].split("/")[0])
    with open(server.path) as f:
        assert json.load(f)["page"] == url  # fiber top --list says there is one
    assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
    with Pool(1) as pool:
        code, _, body = _get(port, "/status.json", {"X-Fiber-Token": token})
        assert code == 200
        state = json.loads(body)
        assert state["run"]["id"] == runtime().run_id and state["run"]["backend"] == "local"
        assert _pool_in(state, pool)["size"] == 1


def test_a_viewer_that_goes_away_mid_answer_leaves_no_traceback(capfd: pytest.CaptureFixture[str]) -> None:
    token = status.page_token(os.urandom(32))
    state = {"run": {"id": "r1"}, "pools": [], "processes": [], "filler": "x" * (8 << 20)}
    page = StatusPage(lambda: state, token)
    try:
        sock = socket.create_connection(("127.0.0.1", page.port), timeout=T)
        sock.sendall(f"GET /status.json HTTP/1.1\r\nHost: 127.0.0.1:{page.port}\r\n"
                     f"X-Fiber-Token: {token}\r\n\r\n".encode())
        assert sock.recv(12) == b"HTTP/1.0 200"  # the answer began ...
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # ... and its reader is gone (a reset): the rest cannot be sent
        wait_until(lambda: not [t for t in threading.enumerate() if "process_request" in t.name],
                   "the answer's thread ended")
        assert _get(page.port, "/status.json", {"X-Fiber-Token": token})[0] == 200  # it serves on
    finally:
        page.close()
    assert "Traceback" not in capfd.readouterr().err
