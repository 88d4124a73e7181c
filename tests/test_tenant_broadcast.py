"""Another local user against broadcast values and named objects, played for real as ``nobody``.

The victim is a program of its own (a new run, so a new run id), driven step by step over
its stdin: it publishes, has a job read, publishes again, and exits. Between its steps
the other user does what a tenant of a shared host can: make the directories whose names
it can compute from public facts (the run id is listable in ``/tmp`` and ``/dev/shm``)
before the program does, plant a segment, leave symbolic links or files of its own at the
temporary names an older Fiber used, and look for the data. Each test asserts that no code
ran as the victim (a marker file that only the victim could make), that no file of the
victim's changed, that the other user read nothing of the values, that the run finished,
and that a warning names what Fiber refused where it fell back.

These tests switch uid: they run as root (see ``tests/tenant.py``).
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from tenant import T, as_other_user, needs_root, other_uid

import fiber_core
from fiber_core.parallel import broadcast as bc

pytestmark = needs_root()

SHM = bc.SHM_ROOT

SECRET = 1234.5
"""Every element of the victim's version ``v`` is ``SECRET + v``: what the other user looks for."""

VICTIM = r"""
import json, os, sys, threading
import numpy as np
import fiber_core
from fiber_core.runtime.run import runtime

def read(b, q):
    try:
        v = b.value
        q.put({"version": b.version, "tag": v["tag"], "values": sorted({float(x) for x in v["table"]}),
               "shared": b.shared})
    except Exception as e:
        q.put({"error": f"{type(e).__name__}: {e}"})

def reply(**kw):
    print(json.dumps(kw), flush=True)

if __name__ == "__main__":
    b, q = None, fiber_core.Queue()
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "info":
            reply(run=runtime().run_id, pid=os.getpid())
        elif cmd == "name":  # where this run keeps its copies: told to the other user as if leaked
            from fiber_core.parallel.broadcast import store_name
            reply(name=store_name(runtime().authkey, runtime().run_id))
        elif cmd == "publish":
            value = {"table": np.full(4096, SECRET + int(args[0])), "tag": f"secret-{args[0]}"}
            if b is None:
                b = fiber_core.broadcast(value)
            else:
                b.publish(value)
            reply(version=b.version, bid=b._bid, tid=threading.get_ident())
        elif cmd == "read":
            p = fiber_core.Process(target=read, args=(b, q))
            p.start()
            got = q.get(timeout=60)
            p.join(60)
            reply(exitcode=p.exitcode, **got)
        elif cmd == "quit":
            b.close()
            reply(done=True)
            break
""".replace("SECRET", repr(SECRET))

ATTACKER = r"""
import json, os, pickle, struct, sys

step, run, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
mine = [os.path.join("/dev/shm", n) for n in args.get("names", [])]
out = {}

if step == "make":  # first, at every name that public facts give
    for d in mine:
        os.mkdir(d)
        os.chmod(d, 0o777)
    out["made"] = mine

elif step == "plant":
    class Run:  # what a reader that unpickles it runs, as the victim
        def __reduce__(self):
            return (open, (args["marker"], "w"))
    def forged(version, magic, mac):
        head, region = struct.Struct("!4sQII"), struct.Struct("!QQ")
        stream = pickle.dumps(Run())
        offset = -(-(head.size + mac + region.size) // 64) * 64
        return (head.pack(magic, version, 0, 1) + os.urandom(mac) + region.pack(offset, len(stream))).ljust(offset, b"\0") + stream
    planted = []
    for d in mine:
        for name in os.listdir(d):
            if not name.endswith(".current"):
                continue
            bid = name[:-len(".current")]
            with open(os.path.join(d, name)) as f:
                version = int(f.read())
            if "forge" in args["what"]:  # the segment readers map, replaced (the directory is ours)
                seg = os.path.join(d, f"{bid}-{version}")
                if os.path.exists(seg):
                    os.unlink(seg)
                with open(seg, "wb") as f:
                    f.write(forged(version, args["magic"].encode(), args["mac"]))
                os.chmod(seg, 0o644)
                planted.append(seg)
            if "symlink" in args["what"]:  # the publisher's next temporary names, to a file of the victim's
                for tmp in (f"{bid}.current.{args['pid']}", f"{bid}-{version + 1}.new-{args['pid']}-{args['tid']}"):
                    os.symlink(args["precious"], os.path.join(d, tmp))
                    planted.append(tmp)
            if "file" in args["what"]:  # the next version's temporary name, made readable in advance
                tmp = os.path.join(d, f"{bid}-{version + 1}.new-{args['pid']}-{args['tid']}")
                fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666)
                os.fchmod(fd, 0o666)
                os.close(fd)
                planted.append(tmp)
    out["planted"] = planted

elif step == "look":  # every file of the run this user can open, searched for the values
    wanted = [struct.pack("=d", v) * 16 for v in args["secrets"]]
    out["found"], out["listed"] = [], {}
    for n in os.listdir("/dev/shm"):
        if run not in n:
            continue
        top = os.path.join("/dev/shm", n)
        try:
            names = os.listdir(top) if os.path.isdir(top) else [""]
        except OSError as e:
            out["listed"][n] = type(e).__name__
            continue
        out["listed"][n] = names
        for name in names:
            try:
                with open(os.path.join(top, name), "rb") as f:
                    data = f.read()
            except OSError:
                continue
            if any(w in data for w in wanted):
                out["found"].append(os.path.join(top, name))

print(json.dumps(out))
"""


class Victim:
    """The program under attack, one step per call."""

    def __init__(self, tmp_path: Path) -> None:
        script = tmp_path / "victim.py"
        script.write_text(VICTIM)
        env = {**os.environ, "TMPDIR": str(tmp_path)}
        env.pop("FIBER_JOB_HOST", None)
        self.proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=env, cwd=tmp_path)

    def ask(self, line: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise AssertionError(f"the victim ended at {line!r}: {self.finish()[1]}")
        return json.loads(answer)  # type: ignore[no-any-return]

    def finish(self) -> tuple[int, str]:
        """Its exit code and what it wrote to stderr (its warnings)."""
        try:
            _, err = self.proc.communicate(timeout=T)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=T)
        return self.proc.returncode, err


def attacker(step: str, run: str, **args: Any) -> dict[str, Any]:
    done = as_other_user(ATTACKER, step, run, json.dumps(args))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def public_names(run: str) -> list[str]:
    """Every name of a broadcast directory of ``run`` that public facts give: the run id
    (and a machine's name, which a job's environment or ``ps`` shows)."""
    return [f"fiber-bc-{run}", f"fiber-bc-{run}-{os.uname().nodename}", f"fiber-bc-{run}-hostx"]


@pytest.fixture
def precious(tmp_path: Path) -> Path:
    """A file of the victim's that the other user would like changed."""
    path = tmp_path / "precious"
    path.write_bytes(b"the victim's own data\n")
    return path


@pytest.fixture
def victim(tmp_path: Path) -> Any:
    v = Victim(tmp_path)
    yield v
    v.proc.kill()
    v.finish()


def _remove_as_root(paths: list[str]) -> None:
    import shutil

    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


def check_untouched(victim: Victim, tmp_path: Path, precious: Path, run: str, secrets: list[float],
                    names: list[str]) -> str:
    """The assertions every broadcast attack ends with; returns the victim's stderr."""
    assert victim.ask("quit") == {"done": True}
    code, err = victim.finish()
    assert code == 0, err  # the run finished
    assert not (tmp_path / "marker").exists(), "code of the other user's ran as the victim"
    assert precious.read_bytes() == b"the victim's own data\n", "a file of the victim's changed"
    seen = attacker("look", run, secrets=secrets, names=names)
    assert seen["found"] == [], f"the other user read the values in {seen['found']}"
    return err


def test_directories_made_first_at_every_name_another_user_can_compute_are_not_used(
        victim: Victim, tmp_path: Path, precious: Path) -> None:
    run = victim.ask("info")["run"]
    names = public_names(run)
    try:
        attacker("make", run, names=names)
        assert victim.ask("publish 1")["version"] == 1
        read = victim.ask("read")
        assert read["values"] == [SECRET + 1] and read["tag"] == "secret-1" and read["exitcode"] == 0
        assert read["shared"] is True  # in a directory of the run's own, not the other user's
        for name in names:
            assert os.listdir(os.path.join(SHM, name)) == [], f"the victim used {name}"
        theirs = {os.path.join(SHM, n) for n in names}
        ours = [os.path.join(SHM, n) for n in os.listdir(SHM) if n.startswith(f"fiber-bc-{run}")
                and os.path.join(SHM, n) not in theirs]
        assert len(ours) == 1
        st = os.lstat(ours[0])
        assert (st.st_uid, st.st_mode & 0o777) == (os.geteuid(), 0o700)
        check_untouched(victim, tmp_path, precious, run, [SECRET + 1], names)
    finally:
        _remove_as_root([os.path.join(SHM, n) for n in names])


@contextmanager
def attacked_store(victim: Victim) -> Iterator[tuple[str, int, list[str], int]]:
    """The other user made every store directory public facts name, then the victim published
    version 1: the run id, the victim's pid, those names and the publishing thread's id. The
    directories are removed (as root) however the test ends."""
    info = victim.ask("info")
    run, pid = info["run"], info["pid"]
    names = public_names(run)
    try:
        attacker("make", run, names=names)
        yield run, pid, names, victim.ask("publish 1")["tid"]
    finally:
        _remove_as_root([os.path.join(SHM, n) for n in names])


def test_a_segment_planted_by_another_user_is_never_unpickled(
        victim: Victim, tmp_path: Path, precious: Path) -> None:
    with attacked_store(victim) as (run, pid, names, tid):
        attacker("plant", run, names=names, what=["forge"], marker=str(tmp_path / "marker"),
                 magic=bc._MAGIC.decode(), mac=getattr(bc, "_MAC", 0), pid=pid, tid=tid)
        read = victim.ask("read")
        assert not (tmp_path / "marker").exists(), "code of the other user's ran as the victim"
        assert read.get("values") == [SECRET + 1], read
        check_untouched(victim, tmp_path, precious, run, [SECRET + 1], names)


def test_symlinks_at_the_formerly_predictable_temporary_names_leave_the_victim_s_file_unchanged(
        victim: Victim, tmp_path: Path, precious: Path) -> None:
    with attacked_store(victim) as (run, pid, names, tid):
        attacker("plant", run, names=names, what=["symlink"], precious=str(precious), pid=pid, tid=tid)
        assert victim.ask("publish 2")["version"] == 2
        assert precious.read_bytes() == b"the victim's own data\n", "publish() wrote through a link"
        read = victim.ask("read")
        assert read.get("values") == [SECRET + 2] and read["version"] == 2, read
        check_untouched(victim, tmp_path, precious, run, [SECRET + 1, SECRET + 2], names)


def test_a_file_made_in_advance_at_a_temporary_name_shows_another_user_no_later_version(
        victim: Victim, tmp_path: Path, precious: Path) -> None:
    with attacked_store(victim) as (run, pid, names, tid):
        attacker("plant", run, names=names, what=["file"], pid=pid, tid=tid)
        assert victim.ask("publish 2")["version"] == 2
        assert victim.ask("read")["values"] == [SECRET + 2]
        seen = attacker("look", run, secrets=[SECRET + 2], names=names)
        assert seen["found"] == [], f"the other user read version 2 in {seen['found']}"
        check_untouched(victim, tmp_path, precious, run, [SECRET + 1, SECRET + 2], names)


def test_a_forged_segment_in_the_run_s_own_directory_is_refused_before_it_is_unpickled(
        victim: Victim, tmp_path: Path, precious: Path) -> None:
    """A forger who knows the segment format exactly, but not the run's key."""
    info = victim.ask("info")
    run, pid = info["run"], info["pid"]
    bid = victim.ask("publish 1")["bid"]
    made = attacker("make", run, names=[f"forge-{run}"])["made"][0]  # a place of the other user's
    try:
        Path(made, f"{bid}.current").write_text("2")  # it plants next to a .current: give it one
        attacker("plant", run, names=[f"forge-{run}"], what=["forge"], marker=str(tmp_path / "marker"),
                 magic=bc._MAGIC.decode(), mac=getattr(bc, "_MAC", 0), pid=pid, tid=0)
        forged = Path(made, f"{bid}-2").read_bytes()
        # however it got there (the run's directory is closed to the other user), as version 2
        ours = [os.path.join(SHM, n) for n in os.listdir(SHM)
                if n.startswith(f"fiber-bc-{run}") and os.lstat(os.path.join(SHM, n)).st_uid == os.geteuid()]
        assert len(ours) == 1
        seg = os.path.join(ours[0], f"{bid}-2")
        cur = os.path.join(ours[0], f"{bid}.current.forged")
        for path, data in ((seg, forged), (cur, b"2")):  # as the run's own files: 0600
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, data)
            os.close(fd)
        os.rename(cur, os.path.join(ours[0], f"{bid}.current"))
        read = victim.ask("read")
        assert not (tmp_path / "marker").exists(), "code of the other user's ran as the victim"
        assert "not one this run wrote" in read.get("error", ""), read
        check_untouched(victim, tmp_path, precious, run, [SECRET + 1], [f"forge-{run}"])
    finally:
        _remove_as_root([made])


def test_a_directory_another_user_made_at_the_run_s_own_name_is_refused_with_a_warning(
        victim: Victim, tmp_path: Path, precious: Path) -> None:
    """As if the name had leaked: the program keeps its values in its own memory and says so."""
    run = victim.ask("info")["run"]
    name = victim.ask("name")["name"]
    try:
        attacker("make", run, names=[name])
        assert victim.ask("publish 1")["version"] == 1
        read = victim.ask("read")
        assert read["values"] == [SECRET + 1] and read["shared"] is False, read
        assert os.listdir(os.path.join(SHM, name)) == []
        err = check_untouched(victim, tmp_path, precious, run, [SECRET + 1], [name])
        assert f"{os.path.join(SHM, name)} is not this user's private directory" in err
        assert f"belongs to uid {other_uid()}" in err
    finally:
        _remove_as_root([os.path.join(SHM, name)])


# -- named objects ----------------------------------------------------------------------------

MAKE_SEMAPHORE = r"""
import sys, _multiprocessing
_multiprocessing.SemLock(1, 0, 1 << 30, sys.argv[1], False)  # SEMAPHORE, value 0: waits forever
print("made")
"""

MAKE_SEGMENT = r"""
import os, sys, _posixshmem
fd = _posixshmem.shm_open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o666)
os.write(fd, b"\x41" * 4096)
print("made")
"""


def _shm_file(name: str, kind: str) -> str:
    return os.path.join(SHM, ("sem." if kind == "s" else "") + name.lstrip("/"))


def test_a_semaphore_another_user_made_under_its_name_is_refused_with_a_clear_error() -> None:
    sem = fiber_core.Semaphore(3)
    sent = pickle.dumps(sem)  # what a late receiver gets
    name = sem._semlock.name
    del sem
    gc.collect()  # its creator dropped it: the name is free
    assert not os.path.exists(_shm_file(name, "s"))
    done = as_other_user(MAKE_SEMAPHORE, name)
    try:
        assert done.stdout.strip() == "made", done.stderr
        with pytest.raises(PermissionError, match="another user made one under its name") as e:
            pickle.loads(sent)
        assert type(e.value).__name__ == "ForeignObjectError" and f"uid {other_uid()}" in str(e.value)
        assert "Keep the object referenced" in str(e.value)
        fresh = fiber_core.Semaphore(1)  # the run goes on
        assert fresh.acquire(timeout=T)
    finally:
        os.unlink(_shm_file(name, "s"))


def test_a_shared_segment_another_user_made_under_its_name_is_refused_with_a_clear_error() -> None:
    value = fiber_core.RawValue("i", 42)
    sent = pickle.dumps(value)
    name = value.fiber_segment.name
    del value
    gc.collect()
    assert not os.path.exists(_shm_file(name, "m"))
    done = as_other_user(MAKE_SEGMENT, name)
    try:
        assert done.stdout.strip() == "made", done.stderr
        with pytest.raises(PermissionError, match="another user made one under its name") as e:
            pickle.loads(sent)
        assert type(e.value).__name__ == "ForeignObjectError" and f"uid {other_uid()}" in str(e.value)
        assert fiber_core.RawValue("i", 7).value == 7
    finally:
        os.unlink(_shm_file(name, "m"))


def test_only_a_private_file_of_this_user_passes_the_owner_check() -> None:
    from fiber_core.base.owned import not_ours

    st = os.stat_result((0o100600, 0, 0, 1, 1000, 1000, 0, 0, 0, 0))
    assert not_ours(st, 1000) is None
    assert "belongs to uid 1000, not 0" in (not_ours(st, 0) or "")
    open_to_group = os.stat_result((0o040770, 0, 0, 1, 1000, 1000, 0, 0, 0, 0))
    assert "mode 0770" in (not_ours(open_to_group, 1000) or "")
    assert not_ours(open_to_group, 1000, private=False) is None


def test_the_directory_name_depends_on_the_key_the_run_and_the_machine() -> None:
    names = {bc.store_name(k, r, h) for k in (b"k1", b"k2") for r in ("r1", "r2") for h in ("", "h")}
    assert len(names) == 8 and all(n.startswith("fiber-bc-r") for n in names)
    assert bc.store_name(b"k1", "r1", "h") == bc.store_name(b"k1", "r1", "h")

