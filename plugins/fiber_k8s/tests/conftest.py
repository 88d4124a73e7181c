"""Fixtures of the fiber-k8s tests: the Kubernetes API emulator and the settings that point
the ``kubernetes`` backend at it.

The emulator of `scripts/test-services.sh up k8s` is used when its kubeconfig answers
($FIBER_K8S_KUBECONFIG or $FIBER_SERVICES_DIR/k8s/kubeconfig) and it runs this tree's emulator
code; else a private one is started on a free port. Tests that run containers need the test dockerd and its `fiber-test:latest` image
($FIBER_K8S_TEST_IMAGE); they skip, saying why, when either is missing.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fiber_core.testing import service_missing

pytest.importorskip("kubernetes")
from fiber_core.runtime.config import (
    config,  # noqa: E402
)
from fiber_core.runtime.run import runtime  # noqa: E402
from k8s_emulator.server import source_revision  # noqa: E402
from k8s_helpers import (
    IMAGE,
    POD_PYTHON,
    SERVICES,
    Emu,
    answers,
    build_pod_site,
    make_tls,
    start_emulator,
    use_environment,  # noqa: E402
)
from kubernetes import client  # noqa: E402


@pytest.fixture(scope="session")
def emu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emu]:
    shared = Path(os.environ.get("FIBER_K8S_KUBECONFIG") or SERVICES / "k8s" / "kubeconfig")
    if answers(shared):
        emu = Emu(str(shared))
        if emu.admin("state").get("revision") == source_revision():
            yield emu
            return
    proc, kubeconfig = start_emulator(tmp_path_factory.mktemp("k8s-emulator"), "--token", uuid.uuid4().hex)
    try:
        yield Emu(str(kubeconfig))
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="session")
def tls_emu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emu]:
    """A private emulator served over HTTPS with a CA of its own, whose kubeconfig embeds the
    CA certificate (``certificate-authority-data``), as kind, GKE and EKS write it."""
    tmp = tmp_path_factory.mktemp("k8s-emulator-tls")
    cert, key, ca = make_tls(tmp)
    proc, kubeconfig = start_emulator(tmp, "--token", uuid.uuid4().hex, "--tls", str(cert), str(key), str(ca))
    try:
        yield Emu(str(kubeconfig))
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="session")
def v1(emu: Emu) -> client.CoreV1Api:
    return client.CoreV1Api(emu.api_client)


@pytest.fixture(scope="session")
def ns(v1: client.CoreV1Api) -> Iterator[str]:
    """A namespace of this session, so a shared emulator's other users are not disturbed."""
    name = "emutest-" + uuid.uuid4().hex[:8]
    v1.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    v1.delete_collection_namespaced_pod(name, grace_period_seconds=0)


@pytest.fixture
def restore_config(emu: Emu) -> Iterator[None]:
    before = emu.admin("config")
    yield
    emu.admin("config", {k: before[k] for k in ("rbac", "nodes")}, "PUT")


@pytest.fixture(scope="session")
def image(emu: Emu) -> str:
    docker = emu.admin("state")["docker"]
    if not docker["reachable"]:
        service_missing(f"test dockerd {docker['host']} not reachable (scripts/test-services.sh up docker)")
    if IMAGE not in docker["images"]:
        service_missing(f"image {IMAGE} not on the test dockerd (scripts/test-services.sh up docker)")
    return IMAGE


@pytest.fixture(scope="session")
def pod_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """fiber-k8s and its dependencies for a pod's PYTHONPATH (see ``build_pod_site``)."""
    if sys.version_info[:2] != POD_PYTHON:
        pytest.skip(f"pods run Python {'.'.join(map(str, POD_PYTHON))} (the test image); the compiled "
                    f"dependencies of kubernetes cannot be copied there from Python {sys.version.split()[0]}")
    return build_pod_site(tmp_path_factory.mktemp("pod-site") / "site")


@pytest.fixture
def k8s_env(emu: Emu, ns: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """The kubernetes backend pointed at the emulator, in this process's environment.

    Pods are host-network containers here, so jobs reach this process at 127.0.0.1. The tests
    directory is mounted at the same path in every pod (hostPath), so that job functions
    defined in ``pod_functions.py`` import there. Yields the variables set. Tests whose pods
    must run also ask for the ``image`` fixture, which skips them when the test dockerd or
    its image is missing.
    """
    env = {
        "FIBER_KUBERNETES_KUBECONFIG": emu.kubeconfig,
        "FIBER_KUBERNETES_NAMESPACE": ns,
        "FIBER_KUBERNETES_IMAGE": IMAGE,
        "FIBER_KUBERNETES_VOLUMES": f"{Path(__file__).parent}:{Path(__file__).parent}:ro",
        "FIBER_LISTEN_HOST": "127.0.0.1",
    }
    use_environment(env, monkeypatch)
    yield env
    # Processes of this test ran on the process-wide backend: remove their pods now, while
    # the emulator surely runs, rather than at exit.
    runtime().get_backend("kubernetes").cleanup()
    config.reset()
