"""Backend registration and selection: plugins, names, the order of the sources."""

from __future__ import annotations

import os
import textwrap
import types
from pathlib import Path

import pytest

import fiber_core
from fiber_core.backends import local
from fiber_core.backends.local import LocalBackend
from fiber_core.base import install
from fiber_core.base.errors import PluginError, UnknownBackendError
from fiber_core.base.install import KNOWN_PACKAGES, install_command, install_elsewhere
from fiber_core.contract.backend import Backend
from fiber_core.runtime import registry
from fiber_core.runtime.config import plugins, selected_backend_name
from fiber_core.runtime.registry import ENV_DISABLE_AUTOLOAD, BackendRegistrar, Registry

T = 30.0


def _bare_registry(monkeypatch: pytest.MonkeyPatch) -> Registry:
    """A registry that sees only the built-in backend, whatever plugins are installed here."""
    monkeypatch.setenv(ENV_DISABLE_AUTOLOAD, "1")
    reg = Registry()
    reg.add_builtin(local, LocalBackend)
    return reg


@pytest.mark.parametrize("name, package", [
    ("kubernetes", "fiber-k8s"), ("k8s", "fiber-k8s"), ("docker", "fiber-docker"),
    ("ssh", "fiber-ssh"), ("aws", "fiber-aws"), ("aws-batch", "fiber-aws"),
])
def test_unknown_backend_says_what_to_install(name: str, package: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    assert KNOWN_PACKAGES[name] == package
    monkeypatch.setattr(registry, "installed_version", lambda dist: None)  # as if not installed here
    with pytest.raises(UnknownBackendError) as e:
        _bare_registry(monkeypatch).get_class(name)
    assert isinstance(e.value, LookupError)
    assert str(e.value) == (f"unknown backend {name!r} (installed: local); {package} provides it: "
                            f"{install_command(package)}")
    assert install_command(package).startswith("pip install ")


def test_unknown_backend_installed_but_not_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "installed_version", lambda dist: "9.9")
    with pytest.raises(UnknownBackendError) as e:
        _bare_registry(monkeypatch).get_class("k8s")
    assert str(e.value).endswith(
        "; fiber-k8s provides it: fiber-k8s 9.9 is installed; FIBER_DISABLE_PLUGIN_AUTOLOAD keeps it from loading")


def test_absent_backends(monkeypatch: pytest.MonkeyPatch, toy_backend: type) -> None:
    monkeypatch.setattr(registry, "installed_version", lambda dist: None)
    absent = _bare_registry(monkeypatch).absent()
    assert [(a.name, a.package) for a in absent] == [
        ("aws-batch", "fiber-aws"), ("docker", "fiber-docker"), ("kubernetes", "fiber-k8s"), ("ssh", "fiber-ssh")]
    assert [a.advice for a in absent] == [install_command(a.package) for a in absent]


def _elsewhere(tmp_path: Path) -> Path:
    (tmp_path / "elsewhere").mkdir()
    return tmp_path / "elsewhere"


def _fake_checkout(root: Path, *plugins: str) -> Path:
    for folder in plugins:
        (root / "plugins" / folder).mkdir(parents=True)
        (root / "plugins" / folder / "pyproject.toml").write_text("[project]\n")
    return root


def test_install_command_from_a_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _fake_checkout(tmp_path / "checkout", "fiber_k8s")
    monkeypatch.setattr(install, "CHECKOUT", root)
    monkeypatch.setattr(install, "_core_source", lambda: None)
    monkeypatch.chdir(root)
    assert install_command("fiber-k8s") == "pip install ./plugins/fiber_k8s"
    monkeypatch.chdir(_elsewhere(tmp_path))
    assert install_command("fiber-k8s") == f"pip install {root}/plugins/fiber_k8s"
    monkeypatch.chdir("/")  # everything is under /: not ./tmp/...
    assert install_command("fiber-k8s") == f"pip install {root}/plugins/fiber_k8s"
    assert install_command("fiber-ssh") == "pip install fiber-ssh"  # not in this checkout


def test_install_command_from_a_checkout_installed_without_e(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    root = _fake_checkout(tmp_path / "my checkout", "fiber_aws")
    monkeypatch.setattr(install, "CHECKOUT", tmp_path / "site-packages")
    monkeypatch.setattr(install, "_core_source", lambda: root)  # pip install ./checkout
    assert install_command("fiber-aws") == "pip install './my checkout/plugins/fiber_aws'"  # cwd: tmp_path
    monkeypatch.chdir(_elsewhere(tmp_path))
    assert install_command("fiber-aws") == f"pip install '{root}/plugins/fiber_aws'"


def test_install_command_from_a_wheelhouse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in ("fiber_core-0.1.0-py3-none-any.whl", "fiber_docker-0.1.0-py3-none-any.whl",
                 "fiber_ssh-0.1.0.tar.gz"):
        (wheels / name).write_bytes(b"")
    monkeypatch.setattr(install, "CHECKOUT", tmp_path / "site-packages")
    monkeypatch.setattr(install, "_core_source", lambda: wheels / "fiber_core-0.1.0-py3-none-any.whl")
    assert install_command("fiber-docker") == "pip install --find-links ./wheels fiber-docker"  # cwd: tmp_path
    monkeypatch.chdir(_elsewhere(tmp_path))
    assert install_command("fiber-docker") == f"pip install --find-links {wheels} fiber-docker"
    assert install_command("fiber-ssh") == f"pip install --find-links {wheels} fiber-ssh"
    assert install_command("fiber-aws") == "pip install fiber-aws"  # from the index fiber-core came from


def test_install_command_from_an_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(install, "CHECKOUT", tmp_path)
    monkeypatch.setattr(install, "_core_source", lambda: None)
    assert install_command("fiber-k8s") == "pip install fiber-k8s"


def test_install_elsewhere_from_a_checkout_builds_the_wheels(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """For an image or another host, a checkout's paths do not exist there: the hint builds the
    wheels with the checkout's build-dists.sh and installs them with --find-links."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    (root / "scripts" / "build-dists.sh").write_text("")
    monkeypatch.setattr(install, "CHECKOUT", root)
    monkeypatch.setattr(install, "_core_source", lambda: None)
    monkeypatch.chdir(root)
    assert install_elsewhere(image=True) == (
        "build the wheels: bash ./scripts/build-dists.sh <build context>/fiber-dist, then in the Dockerfile: "
        "COPY fiber-dist/ /tmp/fiber/ and RUN pip install --find-links /tmp/fiber fiber-core")
    monkeypatch.chdir(_elsewhere(tmp_path))
    assert install_elsewhere(("fiber-core", "fiber-k8s"), python="/opt/py/bin/python3") == (
        f"build the wheels: bash {root}/scripts/build-dists.sh fiber-dist here, copy fiber-dist to the host, "
        "and there run: /opt/py/bin/python3 -m pip install --find-links fiber-dist fiber-core fiber-k8s")
    # installed from the checkout without -e: the checkout is where pip took it from
    monkeypatch.setattr(install, "CHECKOUT", tmp_path / "site-packages")
    monkeypatch.setattr(install, "_core_source", lambda: root)
    assert f"bash {root}/scripts/build-dists.sh fiber-dist here" in install_elsewhere()


def test_install_elsewhere_from_a_wheelhouse_or_an_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "fiber_core-0.1.0-py3-none-any.whl").write_bytes(b"")
    monkeypatch.setattr(install, "CHECKOUT", tmp_path / "site-packages")
    monkeypatch.setattr(install, "_core_source", lambda: wheels / "fiber_core-0.1.0-py3-none-any.whl")
    monkeypatch.chdir(_elsewhere(tmp_path))
    assert install_elsewhere() == (f"copy the wheels of {wheels} to fiber-dist here, copy fiber-dist to the "
                                   "host, and there run: python3 -m pip install --find-links fiber-dist fiber-core")
    monkeypatch.setattr(install, "_core_source", lambda: None)
    version = fiber_core.__version__
    assert install_elsewhere() == f"python3 -m pip install fiber-core=={version}"
    assert install_elsewhere(("fiber-core", "fiber-k8s"), image=True) == (
        f"in the Dockerfile: RUN pip install fiber-core=={version} fiber-k8s")


def test_unknown_third_party_name() -> None:
    with pytest.raises(UnknownBackendError, match="its own package") as e:
        plugins().get_class("nomad")
    assert "pip install" not in str(e.value)


def test_unknown_backend_fails_process_start_at_once() -> None:
    p = fiber_core.Process(target=print, backend="no-such-backend")
    with pytest.raises(UnknownBackendError, match="no-such-backend"):
        p.start()
    assert not p.is_alive()


def test_unknown_backend_from_the_environment(run_script) -> None:  # noqa: ANN001
    out = run_script("""
        import fiber_core

        if __name__ == "__main__":
            fiber_core.Process(target=print).start()
    """, env={"FIBER_BACKEND": "nomad"}, timeout=T)
    assert out.returncode != 0
    assert "UnknownBackendError: unknown backend 'nomad' (installed: " in out.stderr
    assert "(backend set by env FIBER_BACKEND)" in out.stderr


def test_selection_order(monkeypatch: pytest.MonkeyPatch, toy_backend: type) -> None:
    assert selected_backend_name() == "local"
    with open(".fiberconfig", "w") as f:
        f.write("[fiber]\nbackend = toy\n")
    fiber_core.runtime.config.config.reset()
    assert selected_backend_name() == "toy"
    monkeypatch.setenv("FIBER_BACKEND", "local")
    assert selected_backend_name() == "local"
    fiber_core.init(backend="plaything")  # an alias
    assert selected_backend_name() == "toy"
    assert selected_backend_name("local") == "local"
    assert selected_backend_name("PlayThing") == "toy"


def test_unknown_selected_name_says_where_it_was_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FIBER_BACKEND", "nomad")
    with pytest.raises(UnknownBackendError, match="env FIBER_BACKEND"):
        selected_backend_name()


def _report_env(q: fiber_core.Queue) -> None:
    q.put(os.environ.get("FIBER_TOY_JOB"))


def test_plugin_backend_runs_a_process(toy_backend: type) -> None:
    fiber_core.init(toy_flavour="spicy")
    q = fiber_core.Queue()
    p = fiber_core.Process(target=_report_env, args=(q,), backend="toy")
    p.start()
    assert q.get(timeout=T) == "spicy"  # the job was created by ToyBackend, with its settings
    p.join(T)
    assert p.exitcode == 0
    assert isinstance(fiber_core.runtime.run.runtime().get_backend("toy"), toy_backend)


def test_entry_point_backend_end_to_end(run_script, toy_dist) -> None:  # noqa: ANN001
    out = run_script("""
        import os, fiber_core
        from fiber_core.runtime.config import plugins
        from fiber_core.runtime.config import selected_backend_name

        def report(q):
            q.put(os.environ.get("FIBER_TOY_JOB"))

        if __name__ == "__main__":
            print(selected_backend_name(), [b.package for b in plugins().backends() if b.name == "toy"])
            q = fiber_core.Queue()
            p = fiber_core.Process(target=report, args=(q,))
            p.start()
            print("job env", q.get(timeout=30))
            p.join()
            print("exitcode", p.exitcode)
    """, env={**toy_dist, "FIBER_BACKEND": "toy"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["toy ['fiber-toy']", "job env yes", "exitcode 0"]


class _Bad(LocalBackend):
    name = "Bad"


class _Other(LocalBackend):
    name = "local"


def test_registrar_rejects_bad_registrations() -> None:
    register = BackendRegistrar()
    with pytest.raises(TypeError, match="Backend subclass"):
        register(object)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="lowercase"):
        register(_Bad)
    register(LocalBackend)
    register(LocalBackend)  # the same class twice is fine
    with pytest.raises(ValueError, match="registered twice"):
        register(_Other)


def test_backend_contract_is_abstract() -> None:
    with pytest.raises(TypeError):
        Backend()  # type: ignore[abstract]


def test_init_backend_after_first_job_applies_to_later_jobs(toy_backend) -> None:  # noqa: ANN001
    import fiber_core

    first = fiber_core.Process(target=abs, args=(1,))
    first.start()
    first.join(30)
    fiber_core.init(backend="toy")
    second = fiber_core.Process(target=abs, args=(1,))
    second.start()
    second.join(30)
    assert second.exitcode == 0
    assert type(second._run.backend) is toy_backend
    assert type(first._run.backend).name == "local"


# -- what a plugin gets wrong, what a user turns off, what a plugin detects ----------------------


def _installed(tmp_path: Path, dist: str, module: str, source: str, entry_point: str) -> dict[str, str]:
    """A distribution ``dist`` installed under ``tmp_path``: the module ``module`` (``source``)
    and a ``fiber`` entry point ``entry_point``. Returns the environment a fresh interpreter
    finds it under."""
    site = tmp_path / "site"
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[fiber]\n{entry_point} = {module}\n")
    (info / "top_level.txt").write_text(f"{module}\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


TYPO_PLUGIN = """
    from fiber_core.contract import hookimpl


    @hookimpl
    def fiber_register_backend(register):  # the hook is fiber_register_backends
        raise AssertionError("never called")
"""


def test_misspelled_hook_is_an_error_naming_plugin_and_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = _bare_registry(monkeypatch)
    plugin = types.ModuleType("fiber_typo")
    exec(textwrap.dedent(TYPO_PLUGIN), plugin.__dict__)
    with pytest.raises(PluginError) as e:
        reg.register_plugin(plugin, name="typo")
    assert "fiber plugin 'typo' implements a hook that Fiber does not define" in str(e.value)
    assert "fiber_register_backend" in str(e.value)
    assert "fiber_core.contract.hookspecs" in str(e.value)  # where the right names are
    assert not reg.pm.has_plugin("typo")  # refused whole
    assert reg.get_class("local").name == "local"  # the others are unaffected


def test_misspelled_hook_of_an_installed_plugin(run_script, tmp_path: Path) -> None:  # noqa: ANN001
    env = _installed(tmp_path, "fiber-typo", "fiber_typo", TYPO_PLUGIN, "typo")
    out = run_script("""
        import fiber_core

        if __name__ == "__main__":
            p = fiber_core.Process(target=print, backend="nomad")
            p.start()
    """, env=env, timeout=T)
    assert out.returncode != 0
    assert "PluginError: fiber plugin 'typo' implements a hook that Fiber does not define" in out.stderr
    assert "fiber_register_backend" in out.stderr


TOY_PLUGIN = """
    from fiber_core.backends.local import LocalBackend
    from fiber_core.contract import hookimpl


    class ToyBackend(LocalBackend):
        name = "toy"
        aliases = ("plaything",)


    @hookimpl
    def fiber_register_backends(register):
        register(ToyBackend)


    @hookimpl
    def fiber_detect_backend():
        return "plaything"  # an alias is accepted
"""


@pytest.mark.parametrize("value, loaded", [("1", False), ("true", False), ("0", True), ("", True)])
def test_disable_plugin_autoload(run_script, tmp_path: Path, value: str, loaded: bool) -> None:  # noqa: ANN001
    env = _installed(tmp_path, "fiber-toy", "fiber_toy", TOY_PLUGIN, "toy")
    out = run_script("""
        from fiber_core.backends import local
        from fiber_core.backends.local import LocalBackend
        from fiber_core.contract import hookimpl
        from fiber_core.runtime.registry import Registry


        class ByHand(LocalBackend):
            name = "byhand"


        class Plugin:
            @hookimpl
            def fiber_register_backends(self, register):
                register(ByHand)


        reg = Registry()
        reg.add_builtin(local, LocalBackend)
        reg.register_plugin(Plugin(), name="byhand")
        names = [b.name for b in reg.backends()]
        print(" ".join(n for n in names if n in ("byhand", "local", "toy")))
        print("plugins other than ours:", any(n not in ("byhand", "local", "toy") for n in names))
    """, env={**env, ENV_DISABLE_AUTOLOAD: value}, timeout=T)
    assert out.returncode == 0, out.stderr
    if loaded:
        assert out.stdout.splitlines()[0] == "byhand local toy"
    else:
        assert out.stdout.splitlines() == ["byhand local", "plugins other than ours: False"]


def test_detected_backend_is_used_only_when_none_is_configured(run_script, tmp_path: Path) -> None:  # noqa: ANN001
    env = _installed(tmp_path, "fiber-toy", "fiber_toy", TOY_PLUGIN, "toy")
    out = run_script("""
        import os
        import fiber_core
        from fiber_core.runtime.config import config, selected_backend_name
        from fiber_core.runtime.run import runtime

        if __name__ == "__main__":
            print("nothing configured:", selected_backend_name())
            p = fiber_core.Process(target=abs, args=(-1,))
            p.start()
            p.join(30)
            print("the process ran on:", runtime().get_backend(None).name, p.exitcode)
            print("argument:", selected_backend_name("local"))
            with open(".fiberconfig", "w") as f:
                f.write("[fiber]\\nbackend = local\\n")
            config.reset()
            print(".fiberconfig:", selected_backend_name())
            os.remove(".fiberconfig")
            os.environ["FIBER_BACKEND"] = "local"
            config.reset()
            print("FIBER_BACKEND:", selected_backend_name())
            del os.environ["FIBER_BACKEND"]
            config.reset()
            fiber_core.init(backend="local")
            print("init():", selected_backend_name())
    """, env=env, timeout=2 * T)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "nothing configured: toy",
        "the process ran on: toy 0",
        "argument: local",
        ".fiberconfig: local",
        "FIBER_BACKEND: local",
        "init(): local",
    ]


def test_a_template_started_before_the_plugins_load_ends_when_one_detects_another_backend(
        run_script, tmp_path: Path) -> None:  # noqa: ANN001
    # Nothing is configured, so the local template starts before the plugins are loaded; the
    # toy plugin then detects its own backend, and the early template is closed unused.
    env = _installed(tmp_path, "fiber-toy", "fiber_toy", TOY_PLUGIN, "toy")
    out = run_script("""
        from fiber_core.backends import template
        from fiber_core.runtime.run import runtime

        started = []
        start = template.Template.__init__

        def recorded(self, *args, **kwargs):
            start(self, *args, **kwargs)
            started.append(self)

        template.Template.__init__ = recorded

        if __name__ == "__main__":
            backend = runtime().backend
            early = started[0]
            print(backend.name, len(started), early._popen.wait(30) is not None,
                  backend._template is started[-1] and backend._template is not early)
    """, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["toy", "2", "True", "True"]
