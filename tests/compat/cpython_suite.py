"""Run CPython's multiprocessing test suite against Fiber, class by class, and tally the results.

Each test class runs in a fresh interpreter (``python cpython_suite.py class NAME``),
which imports :mod:`cpython_tests` (the suite with ``multiprocessing`` bound to
Fiber, or to the stdlib for the reference run) and streams one JSON line per event
on a private descriptor. The runner here starts those processes, two at a time by
default, and watches them: a test that reports nothing for ``hang_after`` seconds is
counted as hung, its process group is killed, and the class goes on with its
remaining tests in a new process. A class process that dies is treated the same
way, so every test gets a verdict: passed, failed, error, skipped or hung.

``scripts/cpython-suite.py`` is the command line; ``run_suite`` is what the pytest
entry (``test_cpython_suite.py``) calls.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import unittest
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STATUSES = ("passed", "failed", "error", "skipped", "hung")
FLAVOURS = {"processes": "WithProcesses", "manager": "WithManager", "threads": "WithThreads"}
"""The flavours CPython installs per start method, by the prefix of their class names."""

IMPL_VAR = "CPYTHON_SUITE_IMPL"  # as in cpython_tests, which the runner does not import
START_METHOD_VAR = "CPYTHON_SUITE_START_METHOD"
DETAIL_MAX = 300


def flavour_of(class_name: str) -> str:
    for flavour, prefix in FLAVOURS.items():
        if class_name.startswith(prefix):
            return flavour
    return "misc"


@dataclass
class TestResult:
    """The verdict on one test: ``status`` is one of :data:`STATUSES`."""

    test: str
    status: str
    detail: str = ""
    seconds: float = 0.0

    @property
    def cls(self) -> str:
        return self.test.split(".", 1)[0]


@dataclass
class ClassRun:
    """One class: its tests' verdicts, wall time, and what happened around the tests."""

    name: str
    results: list[TestResult] = field(default_factory=list)
    seconds: float = 0.0
    processes: int = 0
    notes: list[str] = field(default_factory=list)
    hung: bool = False


@dataclass
class SuiteRun:
    """A run of the suite on one ``multiprocessing``: ``impl`` is ``fiber`` or ``stdlib``."""

    impl: str
    backend: str
    start_method: str
    python: str
    classes: list[ClassRun] = field(default_factory=list)
    adjustments: dict[str, list[str]] = field(default_factory=dict)
    seconds: float = 0.0

    def results(self, flavour: str | None = None) -> list[TestResult]:
        return [r for c in self.classes for r in c.results
                if flavour is None or flavour_of(c.name) == flavour]

    def counts(self, flavour: str | None = None) -> Counter[str]:
        return Counter(r.status for r in self.results(flavour))

    def hung_classes(self) -> list[str]:
        return [c.name for c in self.classes if c.hung]


# -- in the class process --------------------------------------------------------------


def _first_line(err: Any) -> str:
    exc_type, exc, _tb = err
    text = traceback.format_exception_only(exc_type, exc)[-1].strip()
    return (text.splitlines() or [""])[0][:DETAIL_MAX]


class _Streaming(unittest.TestResult):
    """Writes one JSON line per test (``start``, then ``end`` with its verdict)."""

    def __init__(self, out: TextIO) -> None:
        super().__init__()
        self.out = out
        self.status: str | None = None
        self.detail = ""
        self.started = 0.0

    def emit(self, **event: Any) -> None:
        self.out.write(json.dumps(event) + "\n")
        self.out.flush()

    def _set(self, status: str, detail: str) -> None:
        if self.status in (None, "passed"):
            self.status, self.detail = status, detail

    def startTest(self, test: unittest.TestCase) -> None:  # noqa: N802 - unittest's names
        super().startTest(test)
        self.status, self.detail, self.started = None, "", time.monotonic()
        self.emit(event="start", test=test.id().split(".", 1)[1])

    def stopTest(self, test: unittest.TestCase) -> None:  # noqa: N802
        super().stopTest(test)
        self.emit(event="end", test=test.id().split(".", 1)[1], status=self.status or "error",
                  detail=self.detail if self.status else "no outcome reported",
                  seconds=round(time.monotonic() - self.started, 3))

    def _fixture(self, test: Any, status: str, detail: str) -> bool:
        """A class or module fixture's outcome (``unittest`` reports it as a pseudo-test)."""
        if isinstance(test, unittest.TestCase):
            return False
        self.emit(event="fixture", what=str(test), status=status, detail=detail)
        return True

    def addSuccess(self, test: unittest.TestCase) -> None:  # noqa: N802
        self._set("passed", "")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        if not self._fixture(test, "error", _first_line(err)):
            self._set("failed", _first_line(err))

    def addError(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        if not self._fixture(test, "error", _first_line(err)):
            self._set("error", _first_line(err))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:  # noqa: N802
        if not self._fixture(test, "skipped", reason[:DETAIL_MAX]):
            self._set("skipped", reason[:DETAIL_MAX])

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        self._set("passed", "expected failure")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:  # noqa: N802
        self._set("failed", "unexpected success")

    def addSubTest(self, test: unittest.TestCase, subtest: Any, err: Any) -> None:  # noqa: N802
        if err is not None:
            failure = issubclass(err[0], test.failureException)
            self._set("failed" if failure else "error", f"{subtest._subDescription()}: {_first_line(err)}")


def _class_main(class_name: str, tests: Sequence[str]) -> int:
    """Run ``tests`` (all when empty) of one class, streaming events on the original stdout."""
    out = os.fdopen(os.dup(1), "w", buffering=1)  # not inherited by children (os.dup)
    os.dup2(2, 1)  # what the tests print goes to the log, with stderr
    result = _Streaming(out)
    try:
        import cpython_tests
    except BaseException:
        result.emit(event="fixture", what="import of the suite", status="error",
                    detail=traceback.format_exc().strip().splitlines()[-1][:DETAIL_MAX])
        return 1
    result.emit(event="adjustments", adjustments=cpython_tests.adjustments)
    cls = getattr(cpython_tests, class_name)
    names = list(tests) or unittest.TestLoader().getTestCaseNames(cls)
    unittest.TestSuite([cls(name) for name in names]).run(result)
    for note in cpython_tests.notes:
        result.emit(event="note", note=note)
    result.emit(event="done")
    sys.stdout.flush()
    return 0


def _list_main() -> int:
    import cpython_tests

    loader = unittest.TestLoader()
    classes = {name: list(loader.getTestCaseNames(obj)) for name, obj in vars(cpython_tests).items()
               if isinstance(obj, type) and issubclass(obj, unittest.TestCase)
               and obj.__module__ == cpython_tests.__name__}
    json.dump({"classes": classes, "adjustments": cpython_tests.adjustments}, sys.stdout)
    return 0


# -- the runner ------------------------------------------------------------------------


def docker_service_env() -> dict[str, str]:
    """The test Docker daemon's variables (``scripts/services/docker.sh`` writes them)."""
    services = Path(os.environ.get("FIBER_SERVICES_DIR", "/tmp/fiber-services"))
    try:
        lines = (services / "docker" / "env").read_text().splitlines()
    except OSError as e:
        raise RuntimeError(f"the test Docker daemon is not up ({e}): "
                           "bash scripts/test-services.sh up docker") from e
    return dict(line.split("=", 1) for line in lines if "=" in line)


def suite_test_dir() -> str:
    """This Python's ``test`` package directory, which holds ``_test_multiprocessing.py``."""
    import importlib.util

    spec = importlib.util.find_spec("test._test_multiprocessing")
    if spec is None or not spec.origin:
        raise RuntimeError("this Python has no test._test_multiprocessing: install its test "
                           "suite (Debian: libpython3-testsuite; pyenv builds include it)")
    return str(Path(spec.origin).parent)


def environment(impl: str, backend: str | None, start_method: str,
                base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the class processes for ``impl`` on ``backend``.

    ``backend`` None keeps ``FIBER_BACKEND`` as it is. For ``docker``, a daemon or image
    not named already is the test service's (``fiber-test:latest``), and the containers
    get read-only mounts of this harness and of this Python's ``test`` package.
    """
    env = dict(os.environ if base is None else base)
    env[IMPL_VAR] = impl
    env[START_METHOD_VAR] = start_method
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if backend is not None:
        env["FIBER_BACKEND"] = backend
    if impl == "fiber" and env.get("FIBER_BACKEND") == "docker":
        if "DOCKER_HOST" not in env:
            env.update(docker_service_env())
        env.setdefault("FIBER_DOCKER_IMAGE", "fiber-test:latest")
        mounts = [f"{d}:{d}:ro" for d in (str(HERE), suite_test_dir())]
        env["FIBER_DOCKER_VOLUMES"] = ",".join(filter(None, [env.get("FIBER_DOCKER_VOLUMES"), *mounts]))
    return env


def _start(args: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen:
    with open(log, "ab") as err:
        return subprocess.Popen([sys.executable, str(HERE / "cpython_suite.py"), *args], env=env,
                                cwd=cwd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def list_tests(impl: str, env: dict[str, str], work: Path) -> tuple[dict[str, list[str]], dict]:
    """The suite's classes and their test names, as ``impl`` imports it."""
    work.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, str(HERE / "cpython_suite.py"), "list"], env=env, cwd=work,
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"importing the suite for {impl} failed:\n{done.stderr[-3000:]}")
    data = json.loads(done.stdout)
    return data["classes"], data["adjustments"]


def run_class(  # noqa: C901 - one verdict per test across crashes and hangs of the class's processes; test harness
    name: str, tests: Sequence[str], env: dict[str, str], work: Path, hang_after: float,
) -> ClassRun:
    """Run one class in as many processes as it takes to give each test a verdict."""
    run = ClassRun(name)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "output.log"
    remaining = list(tests)
    started = time.monotonic()
    while remaining:
        run.processes += 1
        proc = _start(["class", name, *remaining], env, work, log)
        events: queue.Queue[dict | None] = queue.Queue()

        def read(stream: Any = proc.stdout, events: queue.Queue = events) -> None:
            for line in stream:
                try:
                    events.put(json.loads(line))
                except ValueError:
                    pass
            events.put(None)

        threading.Thread(target=read, daemon=True).start()
        current: str | None = None
        ended = 0
        setup_failure: tuple[str, str] | None = None
        hung_now = False
        while True:
            try:
                event = events.get(timeout=hang_after)
            except queue.Empty:
                hung_now = True
                break
            if event is None:
                break
            kind = event["event"]
            if kind == "start":
                current = event["test"].split(".", 1)[1]
            elif kind == "end":
                run.results.append(TestResult(event["test"], event["status"], event["detail"],
                                              event["seconds"]))
                if current in remaining:
                    remaining.remove(current)
                current = None
                ended += 1
            elif kind == "fixture":
                run.notes.append(f"{event['what']}: {event['status']}: {event['detail']}")
                if not ended and current is None:
                    setup_failure = (event["status"], f"{event['what']}: {event['detail']}")
            elif kind == "note":
                run.notes.append(event["note"])
        if hung_now:
            _kill(proc)
            run.hung = True
            if current is not None:
                run.results.append(TestResult(f"{name}.{current}", "hung",
                                              f"no result within {hang_after:g} s; killed"))
                remaining.remove(current)
                continue
            where = "before its first test" if not ended else "after its tests"
            run.notes.append(f"hung {where} (class or module fixture, or exit); killed")
            status, detail = "hung", f"the class hung {where}; killed"
        else:
            try:
                code = proc.wait(timeout=hang_after)
            except subprocess.TimeoutExpired:
                _kill(proc)
                run.hung = True
                run.notes.append(f"did not exit within {hang_after:g} s of its last result; killed")
                code = proc.returncode
            if current is not None:  # died during a test
                run.results.append(TestResult(f"{name}.{current}", "error",
                                              f"the class process died during this test (exit code {code})"))
                remaining.remove(current)
                continue
            if not remaining:
                break
            if ended:  # died between tests: go on with the rest
                continue
            status, detail = setup_failure or ("error", f"not run: the class process exited with code {code}")
        run.results += [TestResult(f"{name}.{t}", status, detail) for t in remaining]
        remaining = []
    run.seconds = round(time.monotonic() - started, 1)
    order = {t: i for i, t in enumerate(tests)}
    run.results.sort(key=lambda r: order.get(r.test.split(".", 1)[1], len(order)))
    return run


def run_suite(impl: str = "fiber", flavours: Iterable[str] = ("processes",), *, backend: str | None = None,
              start_method: str = "spawn", jobs: int = 2, hang_after: float = 60.0,
              work: Path | None = None, only: Iterable[str] = (), progress: TextIO | None = None,
              base_env: dict[str, str] | None = None) -> SuiteRun:
    """Run the classes of ``flavours`` (or the classes named in ``only``) for ``impl``."""
    work = Path(tempfile.mkdtemp(prefix="cpython-suite-")) if work is None else work
    env = environment(impl, backend, start_method, base_env)
    # The suite's own waits end before the hang limit, as under regrtest --timeout, so a
    # test waiting for what never comes fails on its assertion rather than being killed.
    env.setdefault("CPYTHON_SUITE_TIMEOUT", f"{hang_after * 2 / 3:g}")
    if impl == "fiber" and env.get("FIBER_BACKEND") == "docker":
        # The suite's AF_UNIX listeners live in its temporary directory: mounted into
        # every container at the same path, so a job can dial them as a child can.
        shared = work / "shared-tmp"
        shared.mkdir(parents=True, exist_ok=True)
        env["CPYTHON_SUITE_SHARED_TMP"] = str(shared)
        env["FIBER_DOCKER_VOLUMES"] = ",".join(
            filter(None, [env.get("FIBER_DOCKER_VOLUMES"), f"{shared}:{shared}"]))
    began = time.monotonic()
    classes, adjustments = list_tests(impl, env, work / impl)
    wanted = set(flavours)
    chosen = set(only)
    selected = [(n, t) for n, t in classes.items()
                if (n in chosen if chosen else flavour_of(n) in wanted)]
    selected.sort(key=lambda c: -len(c[1]))  # the longer classes first, to fill both workers
    run = SuiteRun(impl, env.get("FIBER_BACKEND", "local") if impl == "fiber" else "stdlib",
                   start_method, sys.version.split()[0], adjustments=adjustments)
    done = 0
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        futures = {pool.submit(run_class, n, t, env, work / impl / n, hang_after): n for n, t in selected}
        for future in concurrent.futures.as_completed(futures):
            c = future.result()
            run.classes.append(c)
            done += 1
            if progress is not None:
                counts = Counter(r.status for r in c.results)
                summary = ", ".join(f"{counts[s]} {s}" for s in STATUSES if counts[s])
                progress.write(f"[{impl} {done}/{len(selected)}] {c.name}: {summary} ({c.seconds} s)\n")
                progress.flush()
    run.classes.sort(key=lambda c: c.name)
    run.seconds = round(time.monotonic() - began, 1)
    return run


# -- reports ---------------------------------------------------------------------------


def summary_line(run: SuiteRun, flavour: str) -> str:
    counts = run.counts(flavour)
    total = sum(counts.values())
    rest = ", ".join(f"{counts[s]} {s}" for s in STATUSES[1:] if counts[s])
    hung = [c.name for c in run.classes if c.hung and flavour_of(c.name) == flavour]
    tail = f"; classes that hung: {', '.join(hung)}" if hung else ""
    return f"{run.impl} ({run.backend}): {counts['passed']} of {total} passed ({rest or 'all'}){tail}"


def to_json(runs: Sequence[SuiteRun]) -> str:
    return json.dumps([asdict(r) for r in runs], indent=1)


def from_json(text: str) -> list[SuiteRun]:
    runs = []
    for data in json.loads(text):
        classes = [ClassRun(**{**c, "results": [TestResult(**r) for r in c["results"]]})
                   for c in data.pop("classes")]
        runs.append(SuiteRun(**data, classes=classes))
    return runs


def to_markdown(runs: Sequence[SuiteRun], flavours: Iterable[str]) -> str:
    """The summary, then a table with a row per test and a column per run."""
    lines = [f"Python {runs[0].python}, start method {runs[0].start_method!r}.", ""]
    flavours = list(flavours)
    for flavour in flavours:
        lines.append(f"**{flavour}**")
        lines += [f"- {summary_line(r, flavour)}" for r in runs]
        lines.append("")
    for r in runs:
        if any(r.adjustments.values()):
            lines.append(f"Adjustments for {r.impl}: " + "; ".join(
                f"{k}: {', '.join(v)}" for k, v in r.adjustments.items() if v))
        seen: dict[str, list[str]] = {}
        for c in r.classes:
            for note in c.notes:
                seen.setdefault(note, []).append(c.name)
        for note, where in seen.items():
            place = f"{len(where)} classes" if len(where) > 3 else ", ".join(where)
            lines.append(f"- {r.impl}: {note} ({place})")
    lines.append("")
    heads = [f"{r.impl} ({r.backend})" for r in runs]
    lines += ["| test | " + " | ".join(heads) + " | first line |",
              "|---|" + "---|" * len(runs) + "---|"]
    verdicts = [{t.test: t for t in r.results()} for r in runs]
    names = sorted({n for v in verdicts for n in v if flavour_of(n) in flavours})
    for name in names:
        cells = [v[name].status if name in v else "-" for v in verdicts]
        detail = next((v[name].detail for v in verdicts if name in v and v[name].status != "passed"), "")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {detail.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def slowest_classes(run: SuiteRun, n: int = 8) -> list[tuple[str, float]]:
    return sorted(((c.name, c.seconds) for c in run.classes), key=lambda x: -x[1])[:n]


if __name__ == "__mp_main__":
    # A child of a class process (a Fiber job or a spawned process) imports this file as its
    # main module first: load the suite now, before anything is unpickled, so that a task
    # named by reference (``test._test_multiprocessing.sqr``) finds it as the parent has it.
    import cpython_tests  # noqa: F401

if __name__ == "__main__":
    # CPython's suite runs in the foreground, where Ctrl-C raises KeyboardInterrupt; some of its
    # tests send SIGINT to themselves and expect that (test_wait_result). Started as background
    # work (nohup, or `&` in a script) this process inherits SIGINT ignored: restore Python's
    # handler, as a shell does for a foreground command.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if sys.argv[1:2] == ["class"]:
        sys.exit(_class_main(sys.argv[2], sys.argv[3:]))
    if sys.argv[1:2] == ["list"]:
        sys.exit(_list_main())
    sys.exit("usage: python scripts/cpython-suite.py --help (this module's own modes: list, class NAME)")
