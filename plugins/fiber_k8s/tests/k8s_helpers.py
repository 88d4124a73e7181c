"""What the fiber-k8s tests share: the emulator handle and the files pods need.

The emulator (``k8s_emulator/``) is a Kubernetes API server served over real HTTP plus a
test kubelet that runs pods as host-network containers on the private test dockerd: the
tests talk to it with the official client and the plugin through a kubeconfig, as they
would to a cluster. Named ``k8s_helpers`` (not ``conftest``) so that test modules can
import it: pytest loads several ``conftest`` modules under one name.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fiber_core.testing.job_site import build_job_site

HERE = Path(__file__).parent
PLUGIN = HERE.parent
EMULATOR = HERE / "k8s_emulator"
SERVICES = Path(os.environ.get("FIBER_SERVICES_DIR", "/tmp/fiber-services"))
IMAGE = os.environ.get("FIBER_K8S_TEST_IMAGE", "fiber-test:latest")
POD_PYTHON = (3, 11)
"""The Python of the test image (Debian bookworm's python3)."""
WAIT = 60
"""Seconds: the upper bound of every wait on a pod (a test that needs it has failed)."""


def unschedulable(pod: Any) -> bool:
    """Whether the scheduler found no node for ``pod`` (a ``V1Pod``): PodScheduled is False."""
    return any(c.type == "PodScheduled" and c.status == "False" for c in pod.status.conditions or [])


class Emu:
    """The emulator in use: its kubeconfig, an API client, and its admin endpoints."""

    def __init__(self, kubeconfig: str) -> None:
        from kubernetes import config

        self.kubeconfig = kubeconfig
        self.api_client = config.new_client_from_config(kubeconfig)
        self.url = self.api_client.configuration.host
        ca = self.api_client.configuration.ssl_ca_cert
        self.ssl = ssl.create_default_context(cadata=Path(ca).read_text()) if ca else None

    def admin(self, path: str, body: Any = None, method: str = "GET") -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + "/_emulator/" + path, data=data, method=method)
        with urllib.request.urlopen(req, timeout=10, context=self.ssl) as resp:
            return json.load(resp)


def answers(kubeconfig: Path) -> bool:
    """The kubeconfig exists and its server answers /version."""
    try:
        url = next(line.split()[1] for line in kubeconfig.read_text().splitlines() if "server:" in line)
        # Only whether it answers: the certificate is checked by the clients that use it.
        with urllib.request.urlopen(url + "/version", timeout=2, context=ssl._create_unverified_context()):
            return True
    except (OSError, StopIteration, IndexError):
        return False


def start_emulator(tmp: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    """A private emulator on a free port (``args``: e.g. ``--token T``); waits until it answers."""
    kubeconfig = tmp / "kubeconfig"
    docker = os.environ.get("FIBER_K8S_DOCKER_HOST") or f"unix://{SERVICES / 'docker' / 'docker.sock'}"
    log = open(tmp / "emulator.log", "w")
    proc = subprocess.Popen([sys.executable, str(EMULATOR), "--port", "0", "--docker-host", docker,
                             "--kubeconfig", str(kubeconfig), *args], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    deadline = time.monotonic() + 20
    while not answers(kubeconfig):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("emulator did not answer in 20 s:\n" + (tmp / "emulator.log").read_text())
        time.sleep(0.1)  # nothing to wait on but the port: poll it
    return proc, kubeconfig


def make_tls(tmp: Path) -> tuple[Path, Path, Path]:
    """A self-signed CA and a certificate it signed for 127.0.0.1: (cert, key, CA cert) files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    valid = (now - datetime.timedelta(hours=1), now + datetime.timedelta(days=1))

    def cert(subject: str, key: Any, issuer: str, signer: Any, ca: bool) -> x509.Certificate:
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(valid[0]).not_valid_after(valid[1])
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ca:
            builder = builder.add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False,
                encipher_only=False, decipher_only=False), critical=True)
        else:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_cert = cert("fiber-emulator-ca", ca_key, "fiber-emulator-ca", ca_key, True)
    server_cert = cert("fiber-emulator", key, "fiber-emulator-ca", ca_key, False)
    paths = tmp / "server.crt", tmp / "server.key", tmp / "ca.crt"
    paths[0].write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    paths[2].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    return paths


def build_pod_site(target: Path) -> Path:
    """A directory that gives a pod's Python the fiber-k8s plugin, ``kubernetes`` and what it
    requires, and this tree's fiber_core, for ``PYTHONPATH=<target>`` (or the image built from it):
    a parent process that starts pods (:func:`fiber_core.testing.job_site.build_job_site`)."""
    return build_job_site(target, PLUGIN / "fiber_k8s", "fiber-k8s", "kubernetes")


def use_environment(env: dict[str, str], monkeypatch: Any) -> None:
    """Make ``env`` this process's only ``FIBER_*`` settings (outside any pod), for one test,
    and load the plugins so that the kubernetes settings are known."""
    from fiber_core.runtime.config import config, plugins

    for key in list(os.environ):
        if key.startswith("FIBER_") and key not in env:
            monkeypatch.delenv(key)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config.reset()
    plugins().backends()


@contextmanager
def emulator_with_nodes(tmp: Path, nodes: list[dict[str, Any]]) -> Iterator[Emu]:
    """An emulator of a test module's own, with ``nodes``; skips when the test dockerd or its
    image is missing (the emulator runs the pods' containers there)."""
    import uuid

    import pytest

    proc, kubeconfig = start_emulator(tmp, "--token", uuid.uuid4().hex, "--config", json.dumps({"nodes": nodes}))
    try:
        emu = Emu(str(kubeconfig))
        docker = emu.admin("state")["docker"]
        if not docker["reachable"] or IMAGE not in docker["images"]:
            pytest.skip(f"the test dockerd or its image {IMAGE} is missing (scripts/test-services.sh up docker)")
        yield emu
    finally:
        proc.terminate()
        proc.wait(30)


def tree_in_pods_environment(emu: Emu, repo: Path, **settings: str) -> dict[str, str]:
    """The kubernetes backend's settings for ``emu`` with this tree's fiber_core mounted in the
    pods and first on their PYTHONPATH (with the tests' directory, for the functions they run),
    plus ``settings`` (``fallback_wait="5"`` is ``FIBER_KUBERNETES_FALLBACK_WAIT=5``)."""
    env = {
        "FIBER_KUBERNETES_KUBECONFIG": emu.kubeconfig,
        "FIBER_KUBERNETES_NAMESPACE": "default",
        "FIBER_KUBERNETES_IMAGE": IMAGE,
        "FIBER_KUBERNETES_VOLUMES": f"{repo}:{repo}:ro",
        "FIBER_KUBERNETES_EXTRA_ENV": f"PYTHONPATH={repo}:{Path(__file__).parent}",
        "FIBER_LISTEN_HOST": "127.0.0.1",
    }
    env.update({f"FIBER_KUBERNETES_{key.upper()}": value for key, value in settings.items()})
    return env
