"""``fiber run`` against the Kubernetes API emulator (a real HTTP API server whose test kubelet
runs pods as host-network containers on the test dockerd; see ``k8s_emulator/README.md``).

The parent pod runs the ``fiber-test`` image, which has fiber-core but not this plugin: the
tests mount a directory holding fiber-k8s and its dependencies (``pod_site``) and put it on
the pod's PYTHONPATH, with the emulator's kubeconfig (the emulator mounts no service account
token). Children of the parent pod need neither.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from k8s_helpers import SERVICES, WAIT, Emu, start_emulator
from kubernetes import client, watch

pytestmark = pytest.mark.timeout(300)

PROGRAM = """
import sys
import fiber_core as multiprocessing


def square(x):
    return x * x


def hello(q):
    q.put("hello from a child pod")


if __name__ == "__main__":
    q = multiprocessing.Queue()
    p = multiprocessing.Process(target=hello, args=(q,))
    p.start()
    print(q.get(timeout=60), flush=True)
    p.join(60)
    with multiprocessing.Pool(2) as pool:
        print("squares", pool.map(square, range(8)), flush=True)
    sys.exit(3)
"""


def fiber(*args: str, env: dict[str, str], cwd: Path, timeout: float = 3 * WAIT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fiber_core.cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def env(k8s_env: dict[str, str]) -> dict[str, str]:
    """This machine's environment for `fiber run`: the emulator's kubeconfig and namespace."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("FIBER_") and k != "KUBERNETES_SERVICE_HOST"}
    return {**base, **k8s_env}


@pytest.fixture
def pod_args(emu: Emu, pod_site: Path) -> list[str]:
    """What the parent pod needs in this test setup: the plugin and a way to the API server."""
    kubeconfig = Path(emu.kubeconfig)
    return ["--volume", f"{pod_site}:{pod_site}:ro", "--env", f"PYTHONPATH={pod_site}",
            "--volume", f"{kubeconfig.parent}:{kubeconfig.parent}:ro",
            "--env", f"FIBER_KUBERNETES_KUBECONFIG={kubeconfig}"]


class PodLog:
    """Every pod of a namespace with a fiber.run label, as first seen, until the run's main pod is deleted."""

    def __init__(self, v1: client.CoreV1Api, ns: str) -> None:
        self.pods: dict[str, client.V1Pod] = {}
        self.deleted: set[str] = set()
        self.w = watch.Watch()
        listed = v1.list_namespaced_pod(ns, label_selector="fiber.run")
        self.stream = self.w.stream(v1.list_namespaced_pod, ns, label_selector="fiber.run",
                                    resource_version=listed.metadata.resource_version,
                                    timeout_seconds=3 * WAIT, _request_timeout=3 * WAIT + 5)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for ev in self.stream:
            p = ev["object"]
            self.pods.setdefault(p.metadata.name, p)
            if ev["type"] == "DELETED":
                self.deleted.add(p.metadata.name)
                if (p.metadata.labels or {}).get("fiber.role") == "main":
                    self.w.stop()
                    return

    def join(self) -> None:
        self.thread.join(3 * WAIT + 10)
        assert not self.thread.is_alive(), "the main pod was not deleted"


def run_id(stderr: str) -> str:
    m = re.search(r"run (\w+)\)", stderr)
    assert m, stderr
    return m.group(1)


def check_family(log: PodLog, run: str, image: str) -> None:
    """One main pod, children owned by it, everything labelled with the run and deleted."""
    pods = [p for p in log.pods.values() if p.metadata.labels.get("fiber.run") == run]
    mains = [p for p in pods if p.metadata.labels.get("fiber.role") == "main"]
    assert len(mains) == 1
    main = mains[0]
    assert main.spec.service_account_name == "fiber"
    env = {e.name: e.value for e in main.spec.containers[0].env}
    assert env["FIBER_BACKEND"] == "kubernetes" and env["FIBER_RUN_ID"] == run
    children = [p for p in pods if p is not main]
    assert len(children) == 3  # the Process and two pool workers
    for child in children:
        assert [(o.kind, o.name, o.uid) for o in child.metadata.owner_references] == [
            ("Pod", main.metadata.name, main.metadata.uid)]
        assert child.metadata.labels["fiber.parent"] == main.metadata.name
        assert child.spec.containers[0].image == image  # the parent pod's own image
    assert {p.metadata.name for p in pods} <= log.deleted  # nothing left behind


# -- --dry-run ------------------------------------------------------------------------------------


DRY_RUN_ARGS = ["run", "--dry-run", "--image", "fiber-test:latest", "--cpu", "1", "--memory", "512",
                "--gpu", "1", "--gpu-type", "a100", "--env", "A=B", "--volume", "data:/data",
                "python3", "app.py", "--epochs", "3"]


def test_dry_run_prints_a_pod_the_api_server_accepts(v1: client.CoreV1Api, ns: str, env: dict[str, str],
                                                     tmp_path: Path) -> None:
    out = fiber(*DRY_RUN_ARGS, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    body = yaml.safe_load(out.stdout)
    assert body["kind"] == "Pod" and body["apiVersion"] == "v1" and body["metadata"]["namespace"] == ns
    spec = body["spec"]
    container = spec["containers"][0]
    assert container["command"][-4:] == ["python3", "app.py", "--epochs", "3"]
    assert container["resources"]["limits"] == {"cpu": "1", "memory": "512Mi", "nvidia.com/gpu": "1"}
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "a100"}
    assert spec["serviceAccountName"] == "fiber" and spec["restartPolicy"] == "Never"
    env_in_pod = {e["name"]: e.get("value") for e in container["env"]}
    assert env_in_pod["FIBER_BACKEND"] == "kubernetes" and env_in_pod["A"] == "B"
    assert env_in_pod["FIBER_KUBERNETES_NAMESPACE"] == ns  # this machine's settings go along...
    assert "FIBER_LISTEN_HOST" not in env_in_pod and "FIBER_KUBERNETES_KUBECONFIG" not in env_in_pod  # ...not these
    # The API server validates and defaults it without creating it.
    accepted = v1.create_namespaced_pod(ns, body, dry_run="All")
    assert accepted.metadata.uid and accepted.spec.containers[0].resources.requests["nvidia.com/gpu"] == "1"
    assert v1.list_namespaced_pod(ns, field_selector=f"metadata.name={body['metadata']['name']}").items == []


def test_dry_run_carries_the_pod_template_to_the_parent_and_its_jobs(v1: client.CoreV1Api, ns: str,
                                                                     env: dict[str, str], tmp_path: Path) -> None:
    template = tmp_path / "pod.yaml"
    template.write_text("metadata:\n  labels: {kueue.x-k8s.io/queue-name: team-a}\n"
                        "spec:\n  tolerations: [{key: spot, operator: Exists}]\n")
    out = fiber(*DRY_RUN_ARGS, env={**env, "FIBER_KUBERNETES_POD_TEMPLATE": str(template)}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    body = yaml.safe_load(out.stdout)
    assert body["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"  # the parent pod
    assert {"key": "spot", "operator": "Exists"} in body["spec"]["tolerations"]
    env_in_pod = {e["name"]: e.get("value") for e in body["spec"]["containers"][0]["env"]}
    # The file is on this machine: its content goes along, for the parent's jobs.
    assert json.loads(env_in_pod["FIBER_KUBERNETES_POD_TEMPLATE"])["metadata"]["labels"] == {
        "kueue.x-k8s.io/queue-name": "team-a"}
    assert v1.create_namespaced_pod(ns, body, dry_run="All").metadata.uid


def test_dry_run_manifest_passes_kubectl(env: dict[str, str], tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    # kubectl sends no bearer token over plain HTTP, so it gets an emulator that asks for none;
    # it serves no OpenAPI document either, hence --validate=false (the API server check is above).
    proc, kubeconfig = start_emulator(tmp_path, "--instance", "kubectl-" + uuid.uuid4().hex[:6])
    try:
        manifest = fiber(*DRY_RUN_ARGS, env=env, cwd=tmp_path).stdout
        out = subprocess.run([kubectl, "--kubeconfig", str(kubeconfig), "apply", "--dry-run=client",
                              "--validate=false", "-f", "-"], input=manifest, capture_output=True, text=True,
                             timeout=WAIT)
        assert out.returncode == 0, out.stderr
        assert re.fullmatch(r"pod/fiber-run-\w+-\w+ created \(dry run\)\n", out.stdout)
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_run_id_that_reads_as_a_number_stays_a_string_for_kubectl(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A run id is 12 hex digits: "12e345678901" is a string to PyYAML (YAML 1.1 wants a dot in
    # a float), which left it unquoted, and a number to kubectl, which then refused the label.
    from fiber_k8s.run import _print_manifest

    labels = {"fiber.run": "12e345678901", "fiber.role": "main", "n": "123456789012"}
    body = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "fiber-run-12e345678901", "labels": labels},
            "spec": {"containers": [{"name": "main", "image": "fiber-test:latest"}]}}
    _print_manifest(body)
    manifest = capsys.readouterr().out
    assert yaml.safe_load(manifest) == body
    assert 'fiber.run: "12e345678901"' in manifest
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    proc, kubeconfig = start_emulator(tmp_path, "--instance", "kubectl-" + uuid.uuid4().hex[:6])
    try:
        out = subprocess.run([kubectl, "--kubeconfig", str(kubeconfig), "apply", "--dry-run=client",
                              "--validate=false", "-f", "-"], input=manifest, capture_output=True, text=True,
                             timeout=WAIT)
        assert out.returncode == 0, out.stderr
    finally:
        proc.terminate()
        proc.wait(30)


# -- running a program ----------------------------------------------------------------------------


def test_fiber_run_image(v1: client.CoreV1Api, ns: str, env: dict[str, str], pod_args: list[str],
                         image: str, tmp_path: Path) -> None:
    log = PodLog(v1, ns)
    out = fiber("run", "--image", image, *pod_args, "python3", "-c", PROGRAM, env=env, cwd=tmp_path)
    assert out.returncode == 3, out.stdout + out.stderr  # the program's exit code
    assert "hello from a child pod" in out.stdout
    assert "squares [0, 1, 4, 9, 16, 25, 36, 49]" in out.stdout
    log.join()
    check_family(log, run_id(out.stderr), image)


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Path]:
    """A project directory with a Dockerfile FROM the local test image (builds offline)."""
    d = tmp_path / f"fiber-k8s-e2e-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    (d / "app.py").write_text(textwrap.dedent(PROGRAM))
    (d / "Dockerfile").write_text("FROM fiber-test:latest\nWORKDIR /app\nCOPY app.py /app/app.py\n")
    yield d
    import docker

    client_ = docker.DockerClient(base_url=docker_host())
    for img in client_.images.list():  # built here, tagged <name>:<id> or <registry>/<name>:<id>
        if any(d.name in tag for tag in img.tags):
            try:
                client_.images.remove(img.id, force=True)
            except docker.errors.APIError:
                pass


def docker_host() -> str:
    return os.environ.get("FIBER_K8S_DOCKER_HOST") or f"unix://{SERVICES / 'docker' / 'docker.sock'}"


def test_fiber_run_build(v1: client.CoreV1Api, ns: str, env: dict[str, str], pod_args: list[str],
                         image: str, project: Path) -> None:
    # The test dockerd is the one the emulator's kubelet runs pods on, as with minikube's docker-env:
    # the image is used where it was built, so nothing is pushed (no registry setting).
    log = PodLog(v1, ns)
    out = fiber("run", "--build", "--context", str(project), *pod_args, "python3", "app.py",
                env={**env, "DOCKER_HOST": docker_host()}, cwd=project)
    assert out.returncode == 3, out.stdout + out.stderr
    assert "squares [0, 1, 4, 9, 16, 25, 36, 49]" in out.stdout
    built = re.search(rf"pod \S+ \(image ({project.name}:[0-9a-f]{{12}}),", out.stderr)
    assert built, out.stderr
    assert "no registry setting" in out.stderr
    log.join()
    check_family(log, run_id(out.stderr), built.group(1))


def test_fiber_run_build_push_failure_is_clear(env: dict[str, str], image: str, project: Path) -> None:
    # No registry runs here: a push to a closed port shows how a failed push is reported.
    out = fiber("run", "--build", "--context", str(project), "--registry", "127.0.0.1:9/fiber",
                "python3", "app.py", env={**env, "DOCKER_HOST": docker_host()}, cwd=project)
    assert out.returncode == 2
    assert f"docker push 127.0.0.1:9/fiber/{project.name}:" in out.stderr and "docker login 127.0.0.1:9" in out.stderr


def test_fiber_run_missing_image_fails_promptly(env: dict[str, str], image: str, tmp_path: Path) -> None:
    out = fiber("run", "--image", "fiber-no-such-image:3", "python3", "-c", "pass", env=env, cwd=tmp_path)
    assert out.returncode == 1
    assert "ErrImagePull" in out.stderr and "fiber-no-such-image:3" in out.stderr


def test_fiber_run_on_a_backend_no_plugin_launches_on_names_those_that_do(env: dict[str, str],
                                                                          tmp_path: Path) -> None:
    out = fiber("run", "--backend", "local", "--image", "x", "python3", env=env, cwd=tmp_path)
    assert out.returncode == 2 and "fiber run launches programs on aws-batch or kubernetes, not on 'local'" in out.stderr
    out = fiber("run", env=env, cwd=tmp_path)
    assert out.returncode == 2 and "give the command" in out.stderr


# -- --durable ------------------------------------------------------------------------------------

DURABLE_PROGRAM = """
import time
import fiber_core as multiprocessing


def slow_square(x):
    time.sleep(0.03)
    print("ran", x, flush=True)
    return x * x


if __name__ == "__main__":
    print("start", flush=True)
    with multiprocessing.Pool(2) as pool:
        total = sum(pool.map(slow_square, range(200), chunksize=1))
    print("result", total, flush=True)
"""


def test_dry_run_durable_is_a_job_that_ignores_disruptions(env: dict[str, str], tmp_path: Path) -> None:
    out = fiber("run", "--dry-run", "--durable", "--retries", "2", "--image", "fiber-test:latest", "python3", "app.py",
                env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    job = yaml.safe_load(out.stdout)
    assert (job["apiVersion"], job["kind"]) == ("batch/v1", "Job")
    assert job["spec"]["backoffLimit"] == 2
    assert job["spec"]["podFailurePolicy"]["rules"] == [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]
    pod = job["spec"]["template"]
    assert pod["spec"]["restartPolicy"] == "Never" and pod["metadata"]["labels"]["fiber.role"] == "main"
    env_names = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
    assert "FIBER_RUN_ID" not in env_names  # every start is a run of its own


def test_a_durable_run_survives_its_pod_evicted_and_then_its_node_lost(
        emu: Emu, v1: client.CoreV1Api, ns: str, env: dict[str, str], pod_args: list[str], image: str,
        tmp_path: Path, restore_config: None) -> None:
    """The program's pod is evicted mid-run (Eviction API), then the node of the pod that
    replaced it is lost: the Job starts the program a third time, which finishes; `fiber run`
    shows all three starts' output and exits 0, with the same result as an undisturbed run.
    Its journal (on a volume every start mounts) makes each start run only what the ones
    before it had not finished."""
    emu.admin("config", {"nodes": [{"name": "node-a"}, {"name": "node-b"}, {"name": "node-c"}]}, "PUT")
    journal = tmp_path / "journal"
    journal.mkdir()
    prog = subprocess.Popen([sys.executable, "-m", "fiber_core.cli", "run", "--durable", "--image", image,
                             *pod_args, "--volume", f"{journal}:{journal}", "--env", f"FIBER_JOURNAL={journal}",
                             "--env", "FIBER_PROGRAM=durable-test",
                             "python3", "-c", DURABLE_PROGRAM], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    errors: list[str] = []
    threading.Thread(target=lambda: errors.extend(prog.stderr), daemon=True).start()  # type: ignore[arg-type]
    assert prog.stdout is not None
    lines: list[str] = []

    def next_start(ran: int = 0) -> client.V1Pod:
        """Read the program's output until one more start and then ``ran`` of its tasks'
        lines, and give the pod that runs it."""
        started, seen = False, 0
        for line in prog.stdout:  # type: ignore[union-attr]
            lines.append(line)
            started = started or line.strip() == "start"
            seen += started and " ran " in line
            if started and seen >= ran:
                break
        else:
            raise AssertionError(f"fiber run ended: {''.join(lines)}{''.join(errors)}")
        running = [p for p in v1.list_namespaced_pod(ns, label_selector="fiber.role=main,job-name").items
                   if p.status.phase == "Running" and not p.metadata.deletion_timestamp]
        assert len(running) == 1, [p.metadata.name for p in running]
        return running[0]

    try:
        first = next_start(ran=30)
        v1.create_namespaced_pod_eviction(first.metadata.name, ns, client.V1Eviction(
            metadata=client.V1ObjectMeta(name=first.metadata.name),
            delete_options=client.V1DeleteOptions(grace_period_seconds=1)))
        second = next_start(ran=30)
        assert second.metadata.name != first.metadata.name
        emu.admin("lose-node", {"name": second.spec.node_name}, "POST")
        third = next_start()
        assert third.spec.node_name != second.spec.node_name
        lines.extend(prog.stdout)
        assert prog.wait(3 * WAIT) == 0, "".join(lines) + "".join(errors)
    finally:
        if prog.poll() is None:
            prog.kill()
    assert [line.split() for line in lines if line.startswith("result")] == [
        ["result", str(sum(x * x for x in range(200)))]]
    assert sum(1 for line in lines if line.strip() == "start") == 3
    runs, start = [0, 0, 0], -1
    for line in lines:
        start += line.strip() == "start"
        runs[start] += " ran " in line  # a worker's line: "[PoolWorker-1] ran 17"
    # each start went on from the results of those before it (at most what was in flight at a
    # loss runs twice)
    assert runs[0] >= 30 and runs[1] >= 30 and runs[1] < 200 and runs[2] < 200 - 30, runs
    assert sum(runs) <= 200 + 40, runs
    said = "".join(errors)
    assert "was disrupted (EvictionByEvictionAPI" in said and "start 3" in said
    assert not v1.list_namespaced_pod(ns, label_selector="fiber.role=main,job-name").items or all(
        p.metadata.deletion_timestamp for p in v1.list_namespaced_pod(ns, label_selector="fiber.role=main,job-name").items)
