"""The least-privilege RBAC manifest of a Fiber parent process (``rbac.yaml`` beside this file).

``python -m fiber_k8s.rbac --namespace NS | kubectl apply -f -`` prints it for namespace ``NS``.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

MANIFEST = Path(__file__).with_name("rbac.yaml")
SERVICE_ACCOUNT = "fiber"
"""The service account the manifest creates, and the one ``fiber run`` gives the parent pod."""


def render(namespace: str) -> str:
    """The manifest with every ``NAMESPACE`` placeholder set to ``namespace``."""
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", namespace) or len(namespace) > 63:
        raise ValueError(f"{namespace!r} is not a valid namespace name (a DNS-1123 label)")
    return MANIFEST.read_text(encoding="utf-8").replace("NAMESPACE", namespace)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fiber_k8s.rbac", description=__doc__)
    parser.add_argument("-n", "--namespace", default="default", help="namespace of the run (default: default)")
    args = parser.parse_args(argv)
    try:
        print(render(args.namespace), end="")
    except ValueError as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
