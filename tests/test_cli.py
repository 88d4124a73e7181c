"""The ``fiber`` command: ``fiber backends``, ``fiber config``, ``fiber --help``, run as a real command."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

T = 30.0
ROOT = Path(__file__).resolve().parent.parent
PLUGINS = {"aws-batch": "fiber-aws", "docker": "fiber-docker", "kubernetes": "fiber-k8s", "ssh": "fiber-ssh"}


def fiber(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fiber_core.cli", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, cwd=cwd, timeout=T)


def rows(output: str) -> dict[str, list[str]]:
    """The table lines of ``output``, by their first column."""
    return {line.split()[0]: line.split() for line in output.splitlines() if line.strip()}


def table(text: str) -> dict[str, list[str]]:
    """A table ``fiber`` printed, by its first column: each cell as printed, the lines of a
    wrapped cell joined by a space. The columns are where the header's words start."""
    lines = text.splitlines()
    starts = [m.start() for m in re.finditer(r"\S+(?: \S+)*", lines[0])]
    out: dict[str, list[str]] = {}
    last: list[str] = []
    for line in lines:
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None])]
        if cells[0]:
            last = out[cells[0]] = cells
        else:  # a wrapped cell goes on
            last[:] = [f"{old} {new}".strip() for old, new in zip(last, cells)]
    return out


@pytest.fixture(scope="module")
def core_only(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """A ``fiber`` command line that sees this environment without Fiber's plugin distributions:
    a Python without its site, given a copy (of symlinks) of site-packages that leaves them out."""
    view = tmp_path_factory.mktemp("site")
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not any(dist.replace("-", "_") in entry.name for dist in PLUGINS.values()):
            (view / entry.name).symlink_to(entry)
    code = "import site, sys; site.addsitedir(sys.argv.pop(1)); from fiber_core.cli import main; sys.exit(main())"
    return [sys.executable, "-S", "-c", code, str(view)]


def fiber_core_only(command: list[str], *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([*command, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=T)


def test_backends() -> None:
    out = fiber("backends")
    assert out.returncode == 0, out.stderr
    table = rows(out.stdout)
    assert table["NAME"] == ["NAME", "ALIASES", "PACKAGE", "VERSION"]
    assert table["local"] == ["local", "-", "fiber-core", importlib.metadata.version("fiber-core")]


def test_backends_lists_an_installed_plugin(toy_dist: dict[str, str]) -> None:
    out = fiber("backends", env=toy_dist)
    assert out.returncode == 0, out.stderr
    assert rows(out.stdout)["toy"] == ["toy", "plaything", "fiber-toy", "0.3"]


def test_console_script() -> None:
    script = Path(sys.executable).with_name("fiber")
    if not script.exists():
        pytest.skip("the fiber console script is not installed next to this python")
    out = subprocess.run([str(script), "backends"], capture_output=True, text=True, timeout=T)
    assert out.returncode == 0, out.stderr
    assert "local" in rows(out.stdout)


def test_config_shows_values_and_sources(tmp_path: Path) -> None:
    path = tmp_path / ".fiberconfig"
    path.write_text("[fiber]\nlisten_port = 4321\n")
    out = fiber("config", env={"FIBER_DEBUG": "yes"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "backend in use: local"
    cells = table("\n".join(lines[1:]))
    assert cells["debug"] == ["debug", "True", "env FIBER_DEBUG"]
    # a long source may be wrapped in its column
    assert [c.replace(" ", "") for c in cells["listen_port"]] == ["listen_port", "4321", f"{path}[fiber]"]
    assert cells["forward_output"] == ["forward_output", "True", "default"]
    assert cells["backend"] == ["backend", "local", "default"]


def test_config_fits_in_100_columns(tmp_path: Path, toy_dist: dict[str, str]) -> None:
    # A long value (and the site's plugins' settings: ssh.upload_exclude is 170 characters).
    image = "registry.example.com/" + "team/" * 30 + "app:1"
    (tmp_path / ".fiberconfig").write_text("[fiber]\nlisten_port = 4321\n")
    out = fiber("config", env={**toy_dist, "FIBER_IMAGE": image, "FIBER_GPU_TYPE": "a100 " * 25})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    cells = table("\n".join(lines[1:]))
    assert cells["image"][1].replace(" ", "") == image  # wrapped, nothing lost
    assert cells["image"][2] == "env FIBER_IMAGE"
    assert cells["gpu_type"][1] == ("a100 " * 25).strip()
    assert len(lines) > len(cells) + 1  # some cells did wrap


def test_config_of_a_plugin_backend(tmp_path: Path, toy_dist: dict[str, str]) -> None:
    (tmp_path / ".fiberconfig").write_text("[fiber]\nbackend = plaything\n")
    out = fiber("config", env=toy_dist)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "backend in use: toy"


@pytest.mark.parametrize("env, config_file, expected", [
    ({"FIBER_LISTEN_PORT": "eighty"}, None, "FIBER_LISTEN_PORT"),
    ({}, "[fiber]\nmemory = lots\n", "memory in [fiber]"),
    ({}, "[fiber\n", "malformed"),
    ({}, "[fiber]\nbakend = local\n", "'bakend'"),
    ({"FIBER_BACKEND": "nomad"}, None, "unknown backend 'nomad'"),
], ids=["bad-env", "bad-file-value", "malformed-file", "unknown-key", "unknown-backend"])
def test_config_errors(tmp_path: Path, env: dict[str, str], config_file: str | None, expected: str) -> None:
    if config_file is not None:
        (tmp_path / ".fiberconfig").write_text(config_file)
    out = fiber("config", env=env)
    assert out.returncode == 2
    assert out.stderr.startswith("fiber: error: ")
    assert expected in out.stderr
    assert "Traceback" not in out.stderr


def test_unknown_backend_hint() -> None:
    # The pip hints for the project's own backends are tested in test_registry.py with
    # the installed plugins hidden; here, that the command reports the error cleanly.
    out = fiber("config", env={"FIBER_BACKEND": "nomad"})
    assert out.returncode == 2
    assert "unknown backend 'nomad'" in out.stderr and "its own package" in out.stderr
    assert "Traceback" not in out.stderr


def test_backends_without_the_plugins_says_how_to_install_them(core_only: list[str], tmp_path: Path) -> None:
    out = fiber_core_only(core_only, "backends", cwd=ROOT)
    assert out.returncode == 0, out.stderr
    installed, other = out.stdout.split("\n\n")
    assert table(installed)["NAME"] == ["NAME", "ALIASES", "PACKAGE", "VERSION"]
    assert set(table(installed)) == {"NAME", "local"}
    heading, absent = other.split("\n", 1)
    assert heading == "Fiber's other backends, not available here:"
    cells = table(absent)
    assert cells.pop("NAME") == ["NAME", "PACKAGE", "TO GET IT"]
    # From a checkout, the plugins' directories, as the READMEs say them.
    assert cells == {name: [name, dist, f"pip install ./plugins/{dist.replace('-', '_')}"]
                     for name, dist in PLUGINS.items()}
    # Elsewhere, the same directories by their full path: each holds the named distribution.
    out = fiber_core_only(core_only, "backends", cwd=tmp_path)
    elsewhere = table(out.stdout.split("\n\n")[1].split("\n", 1)[1])
    for name, dist in PLUGINS.items():
        command = elsewhere[name][2].split()
        assert command[:2] == ["pip", "install"] and Path(command[2]).is_absolute()
        pyproject = (Path(command[2]) / "pyproject.toml").read_text()
        assert f'\nname = "{dist}"\n' in pyproject


@pytest.mark.parametrize("args", [["run", "--help"], ["run"], ["run", "--image", "x", "python", "app.py"]],
                         ids=["help", "bare", "args"])
def test_run_without_a_launching_plugin_names_both_that_launch(core_only: list[str], args: list[str]) -> None:
    out = fiber_core_only(core_only, *args, cwd=ROOT)
    assert out.returncode == 2
    assert out.stderr == ("fiber: error: `fiber run` comes with fiber-k8s or fiber-aws, neither of which is "
                          "available here: pip install ./plugins/fiber_k8s; or pip install ./plugins/fiber_aws\n")
    assert out.stdout == ""


def test_help_names_the_backends(core_only: list[str], toy_dist: dict[str, str]) -> None:
    bare = fiber_core_only(core_only, "--help", cwd=ROOT)
    assert bare.returncode == 0, bare.stderr
    assert "backends installed: local\n" in bare.stdout
    assert "other backends: aws-batch, docker, kubernetes, ssh (`fiber backends` says how" in bare.stdout
    assert re.search(r"run +run a program on Kubernetes or AWS Batch \(needs\s+fiber-k8s or\s+fiber-aws\)", bare.stdout)
    with_toy = fiber("--help", env=toy_dist)
    assert with_toy.returncode == 0, with_toy.stderr
    installed = re.search(r"backends installed: (.*)", with_toy.stdout)
    assert installed is not None and {"local", "toy"} <= set(installed.group(1).split(", "))


def test_unknown_options_are_still_refused() -> None:
    out = fiber("backends", "--bogus")
    assert out.returncode == 2
    assert "unrecognized arguments: --bogus" in out.stderr


LAUNCHER = """
import sys
from fiber_core import cli
from fiber_core.contract import hookimpl
from fiber_core.runtime.config import plugins


def add_options(parser):
    parser.add_argument("--image")
    parser.set_defaults(func=lambda args: print("launched", args.backend, args.image, *args.cmd) or 7)


class Launcher:
    @hookimpl
    def fiber_run_launchers(self):
        return {sys.argv[1]: add_options}


plugins().register_plugin(Launcher(), name="launcher")
sys.exit(cli.main(sys.argv[2:]))
"""


def launch(on: str, *args: str) -> subprocess.CompletedProcess:
    """``fiber ARGS`` with a plugin registered by hand that launches ``fiber run`` on backend ``on``."""
    return subprocess.run([sys.executable, "-c", LAUNCHER, on, *args], capture_output=True, text=True, timeout=T,
                          env={k: v for k, v in os.environ.items() if not k.startswith("FIBER_")})


def test_fiber_run_hands_its_arguments_to_the_launcher_of_the_backend_it_names() -> None:
    out = launch("local", "run", "--image", "img", "--backend", "local", "python", "app.py", "--image", "x")
    assert (out.returncode, out.stdout, out.stderr) == (7, "launched local img python app.py --image x\n", "")
    helped = launch("local", "run", "--backend", "local", "--help")
    assert helped.returncode == 0 and "--image IMAGE" in helped.stdout


def test_two_plugins_launching_on_one_backend_is_one_line_naming_it() -> None:
    out = launch("kubernetes", "run", "python", "app.py")
    assert out.returncode == 2
    assert out.stderr == "fiber: error: two plugins launch `fiber run` on backend 'kubernetes': uninstall one\n"


def test_readmes_give_the_commands_fiber_gives(core_only: list[str]) -> None:
    out = fiber_core_only(core_only, "backends", cwd=ROOT)
    hints = {name: cells[2] for name, cells in table(out.stdout.split("\n\n")[1].split("\n", 1)[1]).items()}
    readme = (ROOT / "README.md").read_text()
    for name, dist in PLUGINS.items():
        assert re.search(rf"FIBER_BACKEND={name} python app.py +# {re.escape(hints[name])}\n", readme), name
        plugin_readme = (ROOT / "plugins" / dist.replace("-", "_") / "README.md").read_text()
        first = re.search(r"^ *(pip install [^#\n]*?) *(#|$)", plugin_readme, re.M)
        assert first is not None and first.group(1) == hints[name], (dist, first)
