"""``fiber run``: launch a program on Kubernetes, where its processes become pods.

``fiber run [--image IMG | --build] [--cpu N --memory MiB --gpu N] python app.py`` creates
one *parent pod* running the command with ``FIBER_BACKEND=kubernetes`` and the ``fiber``
service account (``rbac.yaml``), streams its logs until it ends, and exits with its exit
code. In the cluster the program's processes are pods that the parent pod creates and
owns. ``--build`` builds the project's Dockerfile with the docker SDK and pushes it to
``registry``; ``--dry-run`` prints the parent pod's manifest instead of creating it.
``--durable`` runs the parent pod as a Job that starts the program again when its pod is
evicted or its node lost (see :mod:`fiber_k8s.durable`); with a journal the program picks up
where it was.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import uuid
from typing import Any

from fiber_core.contract import (
    ENV_RUN_ID,
    BackendError,
    FiberError,
    JobSpec,
    install_elsewhere,
    parse_pairs,
)

# The one import of a plugin beyond the contract, named in its import contract (pyproject.toml):
# a command of the CLI, it forwards the settings made here, which only the runtime resolves.
from fiber_core.runtime.config import config

from fiber_k8s import durable
from fiber_k8s.backend import CONTAINER, KubernetesBackend, load_pod_template
from fiber_k8s.rbac import SERVICE_ACCOUNT

_NOT_FORWARDED = {"backend", "listen_host", "listen_port", "kubeconfig", "context", "registry", "image"}
"""Settings of this machine that mean nothing in the parent pod. (``image``: the jobs use
the parent pod's own image, the one of --image or --build.)"""


def add_options(p: argparse.ArgumentParser) -> None:
    """Add the options of ``fiber run`` on Kubernetes to its parser (which has ``--backend`` and the command)."""
    p.description = __doc__
    image = p.add_mutually_exclusive_group()
    image.add_argument("--image", help="image of the parent pod and, by default, of its jobs")
    image.add_argument("--build", action="store_true",
                       help="build the image from the Dockerfile (docker SDK) and push it to the registry setting")
    p.add_argument("--context", default=".", help="build context of --build (default: .)")
    p.add_argument("--dockerfile", default="Dockerfile", help="Dockerfile of --build, relative to the context")
    p.add_argument("--registry", help="where --build pushes (default: the kubernetes registry setting; none: no push)")
    p.add_argument("--cpu", type=float, help="CPUs of the parent pod")
    p.add_argument("--memory", type=int, help="memory of the parent pod, MiB")
    p.add_argument("--gpu", type=int, help="GPUs of the parent pod")
    p.add_argument("--gpu-type", help="GPU type of the parent pod (node label gpu_label)")
    p.add_argument("--namespace", help="namespace (default: the kubernetes namespace setting, else the kubeconfig's)")
    p.add_argument("--name", default="fiber-run", help="base of the parent pod's name")
    p.add_argument("--service-account", default=SERVICE_ACCOUNT,
                   help=f"service account of the parent pod (default: {SERVICE_ACCOUNT}, from rbac.yaml)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="set in the parent pod")
    p.add_argument("--volume", action="append", default=[], metavar="SOURCE:PATH[:ro]",
                   help="mount in the parent pod: a claim name or a /host/path")
    p.add_argument("--durable", action="store_true",
                   help="run the parent pod as a Job that starts the program again when its pod is evicted "
                        "or its node lost (give it a journal: --env FIBER_JOURNAL=PATH on a --volume)")
    p.add_argument("--retries", type=int, default=0,
                   help="with --durable: starts again after the program's own failures (default 0)")
    p.add_argument("--dry-run", action="store_true", help="print the parent pod's manifest and exit")
    p.add_argument("--detach", action="store_true", help="create the pod, print its name and exit")
    p.add_argument("--keep", action="store_true", help="keep the parent pod after it ends (for kubectl logs)")
    p.set_defaults(func=run)


def _forwarded_env() -> dict[str, str]:
    """The settings made on this machine (not defaults), as FIBER_* variables for the pod."""
    return {**config.made_here("fiber", _NOT_FORWARDED), **config.made_here(KubernetesBackend.settings_section(), _NOT_FORWARDED)}


def _number_like(text: str) -> bool:
    """Whether a YAML reader other than PyYAML's may take ``text``, left unquoted, for a
    number: PyYAML follows YAML 1.1, where ``12e345`` (no dot) is a string, and quotes only
    what its own rules would read otherwise; kubectl reads ``12e345`` as a number."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def _print_manifest(body: dict[str, Any]) -> None:
    """The manifest as YAML (JSON without PyYAML), every string one that any reader, kubectl's
    included, reads back as a string: a run id such as ``12e345678901`` is quoted."""
    try:
        import yaml
    except ImportError:
        print(json.dumps(body, indent=2))
        return

    class Dumper(yaml.SafeDumper):
        def represent_str(self, data: str) -> Any:
            if _number_like(data):
                return self.represent_scalar("tag:yaml.org,2002:str", data, style='"')
            return super().represent_str(data)

    Dumper.add_representer(str, Dumper.represent_str)
    print(yaml.dump(body, Dumper=Dumper, sort_keys=False), end="")


def image_repository(context: str, registry: str | None) -> str:
    """``[registry/]name`` of the image built from ``context``: named after its directory."""
    name = re.sub(r"[^a-z0-9._-]+", "-", os.path.basename(os.path.abspath(context)).lower()).strip("-._")
    name = name or "fiber-app"
    return f"{registry.rstrip('/')}/{name}" if registry else name


def build_image(context: str, dockerfile: str, registry: str | None) -> str:
    """Build ``context`` with the docker SDK, tag it by content, push it if ``registry``; return its name."""
    try:
        import docker
        from docker.errors import APIError, DockerException
    except ImportError:
        raise FiberError("fiber run --build needs the docker SDK: pip install docker") from None
    if not os.path.isfile(os.path.join(context, dockerfile)):
        raise FiberError(f"no {dockerfile} in {os.path.abspath(context)}: write one (FROM an image with "
                         f"Python; {install_elsewhere(('fiber-core', 'fiber-k8s'), image=True)}; then "
                         "COPY your code), or give --image")
    repo = image_repository(context, registry)
    try:
        client = docker.from_env()
        image_id = None
        print(f"fiber run: building {os.path.abspath(context)} ({dockerfile})", file=sys.stderr)
        for chunk in client.api.build(path=context, dockerfile=dockerfile, rm=True, decode=True):
            if "error" in chunk:
                raise BackendError(f"docker build failed: {chunk['error'].strip()}")
            if chunk.get("stream"):
                sys.stderr.write(chunk["stream"])
            image_id = (chunk.get("aux") or {}).get("ID", image_id)
        if not image_id:
            raise BackendError("docker build finished without an image id")
        tag = image_id.split(":")[-1][:12]  # by content: the same build gives the same tag
        client.api.tag(image_id, repo, tag)
        if registry:
            print(f"fiber run: pushing {repo}:{tag}", file=sys.stderr)
            for line in client.api.push(repo, tag, stream=True, decode=True):
                if "error" in line:
                    raise BackendError(f"docker push {repo}:{tag} failed: {line['error']}. Log in to the "
                                       f"registry (`docker login {registry.split('/')[0]}`) and check "
                                       "that the cluster can pull from it.")
        else:
            print(f"fiber run: no registry setting: {repo}:{tag} is only in the local Docker, which "
                  "works when the cluster's nodes use this Docker (minikube docker-env, Docker "
                  "Desktop); else set FIBER_KUBERNETES_REGISTRY", file=sys.stderr)
        return f"{repo}:{tag}"
    except DockerException as e:  # includes APIError
        if isinstance(e, APIError):
            raise BackendError(f"docker could not build or push {repo}: check the Dockerfile and the "
                               "registry", cause=e) from None
        raise BackendError("cannot reach Docker to build the image: start Docker, or point DOCKER_HOST "
                           "at a running daemon, or give --image", cause=e) from None


def run(args: argparse.Namespace) -> int:
    """The ``fiber run`` command; returns the parent pod's exit status."""
    settings = config.backend_settings(KubernetesBackend.name)
    if args.namespace:
        settings["namespace"] = args.namespace
    registry_name = args.registry if args.registry is not None else settings.get("registry")
    options: dict[str, Any] = {"service_account": args.service_account,
                               "volumes": [*settings.get("volumes", []), *args.volume]}
    image = _image(args, settings, registry_name, options)
    run_id = uuid.uuid4().hex[:12]
    # A durable run's every start is a run of its own (its pods, its key); the label ties them.
    own_id = {} if args.durable else {ENV_RUN_ID: run_id}
    if args.durable:  # a start after a lost node waits for the lease its predecessor left
        own_id["FIBER_JOURNAL_WAIT"] = str(durable.JOURNAL_WAIT)
    env = {**_forwarded_env(), "FIBER_BACKEND": KubernetesBackend.name, **own_id, **parse_pairs(args.env, "--env")}
    if settings.get("pod_template"):  # its file is on this machine: the parent pod gets its content
        env["FIBER_KUBERNETES_POD_TEMPLATE"] = json.dumps(load_pod_template(settings["pod_template"]),
                                                          separators=(",", ":"))
    spec = JobSpec(command=list(args.cmd), name=args.name, image=image, env=env, cpu=args.cpu,
                   memory=args.memory, gpu=args.gpu, gpu_type=args.gpu_type,
                   labels={"fiber.run": run_id, "fiber.role": "main"}, backend_options=options)
    backend = KubernetesBackend(settings, run_id)
    env["FIBER_KUBERNETES_NAMESPACE"] = backend.namespace  # the jobs go beside the parent pod
    if args.durable:
        return _run_durable(args, backend, spec, image, run_id)
    if args.dry_run:
        _print_manifest(backend.manifest(spec))
        return 0
    job = backend.create_job(spec)
    where = f"{backend.namespace}/{job.id}"
    if args.detach:
        print(where)
        return 0
    print(f"fiber run: pod {where} (image {image}, run {run_id})", file=sys.stderr)
    try:
        code = backend.wait_started(job)
        if code is None:
            _follow_logs(backend, job.id)
            code = backend.wait_for_job(job)
        if job.state.detail:
            print(f"fiber run: {job.state.detail}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"fiber run: interrupted: stopping pod {where}", file=sys.stderr)
        backend.stop_job(job)
        backend.wait_for_job(job, int(settings.get("grace_period") or 0) + backend.cluster.timeout)
        code = -signal.SIGINT
    finally:
        if not args.keep:
            backend.cleanup()
    assert code is not None
    return code if code >= 0 else 128 - code


def _image(args: argparse.Namespace, settings: dict[str, Any], registry_name: str | None,
           options: dict[str, Any]) -> str:
    """The parent pod's image: --image, the one --build makes, or the setting."""
    if args.build:
        if not registry_name:
            options["image_pull_policy"] = "IfNotPresent"  # only on this Docker: never pull it
        if args.dry_run:  # not built: the tag is the image id of a build
            return image_repository(args.context, registry_name) + ":dry-run"
        return build_image(args.context, args.dockerfile, registry_name)
    image = args.image or settings.get("image") or config.get("image")
    if not image:
        raise FiberError("fiber run needs an image: --image IMAGE, --build (from ./Dockerfile), or "
                         "the image setting (FIBER_KUBERNETES_IMAGE)")
    return image


def _run_durable(args: argparse.Namespace, backend: KubernetesBackend, spec: JobSpec, image: str,
                 run_id: str) -> int:
    """``fiber run --durable``: the parent pod as a Job; its pods' logs until it ends."""
    manifest = durable.job_manifest(backend.manifest(spec), args.retries)
    if args.dry_run:
        _print_manifest(manifest)
        return 0
    cluster = backend.cluster
    name = cluster.create_batch_job(manifest)["metadata"]["name"]
    where = f"{backend.namespace}/{name}"
    if args.detach:
        print(where)
        return 0
    print(f"fiber run: job {where} (image {image}, run {run_id}, durable)", file=sys.stderr)
    try:
        code = durable.follow(cluster, name, CONTAINER)
    except KeyboardInterrupt:
        print(f"fiber run: interrupted: deleting job {where}", file=sys.stderr)
        code = -signal.SIGINT
    finally:
        if not args.keep:
            try:
                cluster.delete_batch_job(name)
            except BackendError as e:
                print(f"fiber run: cannot delete job {where}: {e}", file=sys.stderr)
            backend.cleanup()
    return code if code >= 0 else 128 - code


def _follow_logs(backend: KubernetesBackend, name: str) -> None:
    """Copy the pod's log to stdout until the container ends."""
    cluster = backend.cluster
    resp = cluster.pod_log(name, CONTAINER, follow=True)
    out = sys.stdout.buffer
    try:
        for chunk in resp.stream(65536, decode_content=False):
            out.write(chunk)
            out.flush()
    finally:
        resp.release_conn()
