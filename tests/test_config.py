"""Configuration: init() > FIBER_* > .fiberconfig > default, typed values, clear errors.

The autouse fixture of conftest.py runs every test in its own working directory,
with no FIBER_* variable and a reset configuration.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import fiber_core
from fiber_core.base.errors import ConfigError
from fiber_core.runtime.config import Value, config, create_backend

T = 30.0


def write_config(text: str) -> Path:
    path = Path(".fiberconfig").resolve()
    path.write_text(text)
    config.reset()
    return path


def test_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    assert config.lookup("listen_port") == Value(0, "default")
    path = write_config("[fiber]\nlisten_port = 1111\n")
    assert config.lookup("listen_port").value == 1111
    assert str(path) in config.lookup("listen_port").source
    monkeypatch.setenv("FIBER_LISTEN_PORT", "2222")
    assert config.get("listen_port") == 2222
    assert config.lookup("listen_port").source == "env FIBER_LISTEN_PORT"
    fiber_core.init(listen_port=3333)
    assert config.lookup("listen_port").value == 3333
    assert config.lookup("listen_port").source == "init()"
    config.reset()
    assert config.get("listen_port") == 2222
    monkeypatch.delenv("FIBER_LISTEN_PORT")
    assert config.get("listen_port") == 1111
    path.unlink()
    config.reset()
    assert config.lookup("listen_port").source == "default"


@pytest.mark.parametrize("text, value", [
    ("0", False), ("false", False), ("No", False), ("off", False), ("", False),
    ("1", True), ("true", True), ("YES", True), ("on", True),
])
def test_booleans(monkeypatch: pytest.MonkeyPatch, text: str, value: bool) -> None:
    monkeypatch.setenv("FIBER_DEBUG", text)
    assert config.get("debug") is value


def test_types_are_parsed() -> None:
    write_config("[fiber]\ncpu = 1.5\nmemory = 512\nforward_output = no\npython = /usr/bin/python3\n")
    assert config.get("cpu") == 1.5
    assert config.get("memory") == 512
    assert config.get("forward_output") is False
    assert config.get("python") == "/usr/bin/python3"
    fiber_core.init(cpu=2)
    assert config.get("cpu") == 2.0 and isinstance(config.get("cpu"), float)


@pytest.mark.parametrize("key, env, value", [
    ("listen_port", "FIBER_LISTEN_PORT", "eighty"),
    ("debug", "FIBER_DEBUG", "maybe"),
    ("cpu", "FIBER_CPU", "lots"),
])
def test_bad_env_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, key: str, env: str,
                                          value: str) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(ConfigError, match=env) as e:
        config.get(key)
    assert value in str(e.value) and "environment" in str(e.value)


def test_bad_file_value_names_the_key_and_file() -> None:
    path = write_config("[fiber]\nmemory = a lot\n")
    with pytest.raises(ConfigError, match="memory") as e:
        config.get("memory")
    assert str(path) in str(e.value) and "a lot" in str(e.value)


def test_malformed_file_names_the_file() -> None:
    path = write_config("this is not an INI file\n[fiber\n")
    with pytest.raises(ConfigError, match="malformed") as e:
        config.get("debug")
    assert str(path) in str(e.value)


def test_unknown_key_in_file() -> None:
    write_config("[fiber]\nbackedn = local\n")
    with pytest.raises(ConfigError, match="backedn"):
        config.check_file()


@pytest.mark.parametrize("key", ["bogus", "start_timout", "listen_hots"])
def test_unknown_init_key(key: str) -> None:
    with pytest.raises(ConfigError, match=key) as e:
        fiber_core.init(**{key: 1})
    assert "start_timeout" in str(e.value)  # the known keys are listed


def test_bad_init_value() -> None:
    with pytest.raises(ConfigError, match="listen_port"):
        fiber_core.init(listen_port="eighty")
    with pytest.raises(ConfigError, match="debug"):
        fiber_core.init(debug=3.5)


def test_init_of_a_backend_not_installed_is_kept() -> None:
    fiber_core.init(docker_image="app:1")  # fiber-docker may be installed later in the run


def _exit_zero() -> None:
    pass


def test_bad_value_fails_process_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FIBER_CPU", "lots")
    p = fiber_core.Process(target=_exit_zero)
    with pytest.raises(ConfigError, match="FIBER_CPU"):
        p.start()
    assert not p.is_alive()


def test_malformed_file_fails_process_start() -> None:
    path = write_config("[fiber\n")
    with pytest.raises(ConfigError, match=str(path)):
        fiber_core.Process(target=_exit_zero).start()


def test_init_values_reach_the_child(toy_backend: type) -> None:
    fiber_core.init(memory=321, toy_slots=5)  # the child knows no "toy" backend: no matter
    q = fiber_core.Queue()
    p = fiber_core.Process(target=_put_config, args=(q, "memory"))
    p.start()
    assert q.get(timeout=T) == (321, "init()")
    p.join(T)
    assert p.exitcode == 0


def _put_config(q: fiber_core.Queue, key: str) -> None:
    v = config.lookup(key)
    q.put((v.value, v.source))


# -- backend sections -------------------------------------------------------------------


def test_backend_options_default_file_env_init(monkeypatch: pytest.MonkeyPatch, toy_backend: type) -> None:
    assert config.backend_settings("toy") == {"flavour": "plain", "slots": 1, "token": None}
    write_config("[toy]\nflavour = spicy\nslots = 2\n")
    assert config.backend_settings("toy") == {"flavour": "spicy", "slots": 2, "token": None}
    monkeypatch.setenv("FIBER_TOY_SLOTS", "3")
    monkeypatch.setenv("FIBER_TOY_TOKEN", "s3cret")
    assert config.backend_settings("toy") == {"flavour": "spicy", "slots": 3, "token": "s3cret"}
    fiber_core.init(toy_slots=4, toy_flavour="sweet")
    assert config.backend_settings("toy") == {"flavour": "sweet", "slots": 4, "token": "s3cret"}
    backend = create_backend("toy", "run1")
    assert backend.settings == {"flavour": "sweet", "slots": 4, "token": "s3cret"}
    shown = {key: value for key, value, _ in config.describe()}
    assert shown["toy.slots"] == "4" and shown["toy.token"] == "********"


def test_backend_option_errors(monkeypatch: pytest.MonkeyPatch, toy_backend: type) -> None:
    path = write_config("[toy]\nslots = many\n")
    with pytest.raises(ConfigError, match=r"slots in \[toy\]") as e:
        config.backend_settings("toy")
    assert str(path) in str(e.value)
    write_config("[toy]\ncolour = red\n")
    with pytest.raises(ConfigError, match="colour"):
        config.check_file()
    monkeypatch.setenv("FIBER_TOY_FLAVOUR", "bitter")
    with pytest.raises(ConfigError, match="FIBER_TOY_FLAVOUR") as e:
        config.get("flavour", "toy")
    assert "plain" in str(e.value)  # the allowed choices are listed
    with pytest.raises(ConfigError, match="toy_colour"):
        fiber_core.init(toy_colour="red")
    with pytest.raises(ConfigError, match="toy_slots"):
        fiber_core.init(toy_slots="many")


def test_key_value_entries_parse_or_name_the_bad_one() -> None:
    from fiber_core.base.options import parse_pairs

    assert parse_pairs(["A=1", " B =x=y", "C="], "extra_env") == {"A": "1", "B": "x=y", "C": ""}
    for bad in ("NOEQUALS", "=value", " =v"):
        with pytest.raises(ConfigError, match=f"bad extra_env entry {bad!r}: expected KEY=VALUE"):
            parse_pairs(["A=1", bad], "extra_env")


def test_a_builtin_backends_settings_come_from_its_variables(tmp_path: Path) -> None:
    # In a fresh interpreter: the plugins are not loaded there, as in any program that
    # uses the local backend only (in this session another test may have loaded them).
    program = ("from fiber_core.runtime.run import runtime\n"
               "b = runtime().get_backend('local')\n"
               "print(b.settings['start'], b.settings['preload'])\n")
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, env={**os.environ, "FIBER_LOCAL_START": "fresh",
                                            "FIBER_LOCAL_PRELOAD": "json,decimal"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["fresh", "['json',", "'decimal']"]


def test_without_a_config_file_its_parser_is_not_loaded(tmp_path: Path) -> None:
    # Every job looks settings up as it starts; with no .fiberconfig, that costs no import.
    program = ("import sys\n"
               "from fiber_core.runtime.config import config\n"
               "print(config.get('peer_timeout'), 'configparser' in sys.modules)\n")

    def run() -> list[str]:
        out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                             timeout=60, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    assert run() == ["30.0", "False"]
    (tmp_path / ".fiberconfig").write_text("[fiber]\npeer_timeout = 7\n")
    assert run() == ["7.0", "True"]
