"""``fiber_core.wire.serialize``: pickling for another process, safe from any thread at any time."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

T = 30.0  # bound of every wait: reaching it is a failure, never a measure of speed

_HALF_IMPORT = """
import sys, threading
from fiber_core.wire import serialize

def f(x):
    return x

mid_import = threading.Event()
errors = []

class Pause:
    # Holds the import of cloudpickle half done (the package in sys.modules, its
    # submodule not yet loaded) until the other thread has finished or waits in the import machinery.
    def find_spec(self, name, path=None, target=None):
        if name == "cloudpickle.cloudpickle":
            mid_import.set()
            while other.is_alive() and not waiting_for_import(other):
                other.join(0.001)
        return None

def waiting_for_import(thread):
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if "importlib._bootstrap" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False

def send():
    mid_import.wait(30)
    try:
        serialize.loads(serialize.dumps(f))
    except Exception as e:
        errors.append(repr(e))

other = threading.Thread(target=send)
sys.meta_path.insert(0, Pause())
other.start()
serialize.dumps(lambda: 0)  # imports cloudpickle here
other.join(30)
assert not other.is_alive(), "the second thread hangs"
print(errors or "ok")
"""


def test_dumps_while_another_thread_imports_cloudpickle(run_script) -> None:  # noqa: ANN001
    r = run_script(_HALF_IMPORT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok", r.stdout


_FIRST_MAP = """
import time
import fiber_core

def double(x):
    return 2 * x

if __name__ == "__main__":
    with fiber_core.Pool(8) as pool:
        time.sleep(0.3)  # the master thread starts workers while map first pickles double
        assert pool.map(double, range(20)) == [2 * x for x in range(20)]
    print("ok")
"""


def test_first_map_of_a_main_function_in_fresh_interpreters(tmp_path: Path) -> None:
    # A map's first pickling imports cloudpickle while the pool's master thread pickles too.
    (tmp_path / "first_map.py").write_text(_FIRST_MAP)
    runs = 20

    def run(_: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "first_map.py"], capture_output=True, text=True,
                              cwd=tmp_path, timeout=2 * T)

    with ThreadPoolExecutor(2) as ex:
        results = list(ex.map(run, range(runs)))
    failures = [r.stderr[-500:] for r in results if r.returncode != 0 or r.stdout.strip() != "ok"]
    assert failures == [], f"{len(failures)} of {runs} runs failed; first: {failures[:1]}"
