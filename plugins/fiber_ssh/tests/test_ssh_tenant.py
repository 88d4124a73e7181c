"""What another user of an SSH host can do to a run's jobs there: nothing.

The other user is played for real (``nobody``, by ``tests/tenant.py``). The uploads go to an
sshd of the test's own in fiber-h1's network namespace, whose SFTP server has umask 000 and
which shares this machine's /tmp with the other user. They pre-create the upload directory at every name they
could predict, with a ``fiber_core`` package in it that would run as the program; the run
must not use it, must upload into a directory only it can enter (even when the host's
umask takes nothing away), and the other user must read nothing of what was uploaded.
The jobs must not leave the run's key or their token to what they start.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import fiber_core
import pytest
import test_ssh
from fiber_core.base.errors import BackendError
from test_ssh import T, fresh_runtime, private_sshd, ssh_env

hosts = test_ssh.hosts  # the fixture of the SSH test hosts

REPO = Path(__file__).resolve().parents[3]


def _core_test_helper(name: str):  # noqa: ANN202
    """A helper module of the core tests (``tests/<name>.py``)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tests" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tenant = _core_test_helper("tenant")

pytestmark = [pytest.mark.timeout(240), tenant.needs_root()]

PORT = 2226  # an sshd of this module's own whose SFTP server has umask 000 (test_ssh.py's: 2222)

PLANTED = '''
import os, sys
with open(MARKER, "w") as f:  # proof that this ran, and as whom
    f.write(str(os.getuid()))
# Then step aside for the real package, so that the run goes on as if nothing happened.
here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
del sys.modules["fiber_core"]
import fiber_core
'''

PLANT = '''
import os, sys
directory, marker, code = sys.argv[1:]
for d in (directory, directory + "/fiber_core"):
    os.mkdir(d)
    os.chmod(d, 0o777)  # so that the program can upload into it
with open(directory + "/fiber_core/__init__.py", "w") as f:
    f.write(code.replace("MARKER", repr(marker)))
os.chmod(directory + "/fiber_core/__init__.py", 0o644)
'''

SNOOP = '''
import json, os, sys
seen = {}
for path in sys.argv[1:]:
    try:
        seen[path] = sorted(os.listdir(path)) if os.path.isdir(path) else open(path).read()
    except OSError as e:
        seen[path] = type(e).__name__
print(json.dumps(seen))
'''


def where_the_job_runs() -> str:
    return os.getcwd()


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The program's working directory, which upload copies: it holds a secret."""
    path = tmp_path / "project"
    path.mkdir()
    (path / "settings.env").write_text("API_TOKEN=not-for-others\n")
    (path / "settings.env").chmod(0o644)
    (path / "data").mkdir()
    monkeypatch.chdir(path)
    return path


@pytest.fixture
def predicted(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The upload directory where the other user expects it, planted; and where the planted
    code would leave its marker."""
    run_id = "t" + os.urandom(4).hex()
    name = f"/tmp/fiber-{run_id}-{os.getpid()}"  # the run id is public: ls /tmp, ps on the hosts
    marker = tmp_path / "planted-code-ran"
    planted = tenant.as_other_user(PLANT, name, str(marker), PLANTED)
    assert planted.returncode == 0, planted.stderr
    try:
        yield run_id, marker
    finally:
        shutil.rmtree(name, ignore_errors=True)


@contextlib.contextmanager
def open_host(hosts: dict[str, str], tmp_path: Path, **settings: str) -> Iterator[dict[str, str]]:
    """A host whose SFTP server takes no bit away from what it creates (umask 000) and which
    shares this machine's /tmp with the other user; yields the settings of a run that
    uploads there."""
    with private_sshd(hosts, tmp_path, PORT, "Subsystem sftp internal-sftp -u 000") as host:
        env = ssh_env(hosts, upload="1", known_hosts=str(tmp_path / "known_hosts"),
                      host_key_policy="accept-new", **settings)
        env["FIBER_SSH_HOSTS"] = f"{host}*2"
        yield env


def test_a_planted_upload_directory_is_never_used_and_ours_is_closed_to_others(
        hosts: dict[str, str], tmp_path: Path, project: Path, predicted: tuple[str, Path]) -> None:
    run_id, marker = predicted
    with open_host(hosts, tmp_path) as env:
        with fresh_runtime({**env, "FIBER_RUN_ID": run_id}):
            with fiber_core.Pool(1) as pool:
                cwd = pool.apply_async(where_the_job_runs).get(timeout=T)
            st, sub = os.lstat(cwd), os.lstat(f"{cwd}/data")
            snooped = tenant.as_other_user(
                SNOOP, cwd, f"{cwd}/settings.env", f"/tmp/fiber-{run_id}-{os.getpid()}/settings.env")
    assert not marker.exists(), f"the planted code ran, as uid {marker.read_text()}"
    assert stat.S_IMODE(sub.st_mode) == 0o777  # the host's umask takes no bit away
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert snooped.returncode == 0, snooped.stderr
    assert set(json.loads(snooped.stdout).values()) <= {"PermissionError", "FileNotFoundError"}
    assert not os.path.exists(cwd)  # removed at the run's end


def test_a_configured_upload_directory_that_another_user_made_is_refused(
        hosts: dict[str, str], tmp_path: Path, project: Path) -> None:
    name = f"/tmp/fiber-work-{os.urandom(4).hex()}"  # a name the user chose, known to others
    made = tenant.as_other_user("import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o777)", name)
    assert made.returncode == 0, made.stderr
    try:
        with open_host(hosts, tmp_path, workdir=name) as env, fresh_runtime(env):
            p = fiber_core.Process(target=where_the_job_runs)
            with pytest.raises(BackendError, match=rf"{name} \(\[ssh\] workdir\) is not safe to upload "
                                                   rf"to: it belongs to uid {tenant.other_uid()}, not to"):
                p.start()
        assert os.listdir(name) == []  # nothing was uploaded there
    finally:
        shutil.rmtree(name, ignore_errors=True)


def test_a_configured_upload_directory_that_does_not_exist_is_made_private(
        hosts: dict[str, str], tmp_path: Path, project: Path) -> None:
    name = f"/tmp/fiber-work-{os.urandom(4).hex()}/jobs"
    try:
        with open_host(hosts, tmp_path, workdir=name) as env, fresh_runtime(env):
            with fiber_core.Pool(1) as pool:
                assert pool.apply_async(where_the_job_runs).get(timeout=T) == name
        st = os.lstat(name)  # a configured directory stays
        assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
        assert sorted(os.listdir(name)) == ["data", "settings.env"]
    finally:
        shutil.rmtree(os.path.dirname(name), ignore_errors=True)


def secrets_seen(key: str) -> dict[str, list[str]]:
    """Where this job shows a secret variable or the key: its environment, a command's, its
    ``/proc/self/environ``."""
    from fiber_core.contract.env import SECRET_VARIABLES

    wanted = [*(f"{n}=" for n in sorted(SECRET_VARIABLES)), key]
    shown = {
        "os.environ": "\n".join(f"{k}={v}" for k, v in os.environ.items()),
        "env": subprocess.run(["env"], capture_output=True, text=True, timeout=T).stdout,
        "/proc/self/environ": open("/proc/self/environ", "rb").read().decode(errors="replace"),
    }
    return {where: [w for w in wanted if w in text] for where, text in shown.items()}


def report(q: fiber_core.Queue, key: str) -> None:
    q.put(secrets_seen(key))


NOTHING = {"os.environ": [], "env": [], "/proc/self/environ": []}


def test_jobs_on_the_hosts_leave_neither_key_nor_token_to_what_they_start(hosts: dict[str, str]) -> None:
    with fresh_runtime(ssh_env(hosts)) as rt:
        key = rt.authkey.hex()
        q = fiber_core.Queue()
        p = fiber_core.Process(target=report, args=(q, key))
        p.start()
        assert q.get(timeout=T) == NOTHING
        p.join(T)
        assert p.exitcode == 0
        with fiber_core.Pool(2) as pool:
            assert pool.map(secrets_seen, [key] * 4) == [NOTHING] * 4
