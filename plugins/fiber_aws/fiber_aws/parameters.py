"""The run's key and the variables a job marks secret, as SSM SecureString parameters of the run.

A job definition names each parameter in ``secrets``, so no value is in a job's description
(which anyone allowed ``batch:DescribeJobs`` reads). Parameters are named
``/fiber/<run>/<random>/authkey`` and ``/fiber/<run>/<random>/env-<NAME>-<n>``, made on first
use, deleted at cleanup, and found by name by ``fiber clean`` after a crash.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fiber_core.contract import ENV_AUTHKEY, BackendError

from fiber_aws.api import AwsError, call
from fiber_aws.spec import sanitise_tag

log = logging.getLogger("fiber")

ErrorFor = Callable[[AwsError, str, str], BackendError]


def _run_path(run_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "-", run_id)


class RunParameters:
    """The SSM parameters of one run: made on first use, deleted by :meth:`drop`."""

    def __init__(self, run_id: str, settings: Mapping[str, Any], ssm: Callable[[], Any],
                 error: ErrorFor, where: Callable[[], str]) -> None:
        self.run_id, self.settings = run_id, settings
        self._ssm, self._error, self._where = ssm, error, where
        self._lock = threading.Lock()
        self._key: tuple[str, str] | None = None  # (parameter, value) of the run's key, once made
        self._variables: dict[tuple[str, str], str] = {}  # (name, value) of a secret_env variable

    def key(self, value: str) -> str:
        """The parameter that holds the run's key ``value``, made on first use."""
        with self._lock:
            if self._key is not None:
                if value != self._key[1]:
                    raise BackendError("a job carries another run's key than this backend's: start it "
                                       "from a backend of its run")
                return self._key[0]
            name = self._put("authkey", value, f"fiber: the key of run {self.run_id}")
            self._key = (name, value)
            return name

    def for_job(self, env: Mapping[str, str], marked: Sequence[str]) -> dict[str, str]:
        """``{variable: parameter}`` for the run's key and the variables of ``env`` marked
        secret (``secret_env``), each made on first use."""
        out = {ENV_AUTHKEY: self.key(env[ENV_AUTHKEY])} if ENV_AUTHKEY in env else {}
        for variable in marked:
            if variable not in env:
                continue
            with self._lock:
                name = self._variables.get((variable, env[variable]))
                if name is None:
                    name = self._put(f"env-{variable}-{len(self._variables)}", env[variable],
                                     f"fiber: {variable} of run {self.run_id}")
                    self._variables[(variable, env[variable])] = name
            out[variable] = name
        return out

    def _put(self, leaf: str, value: str, description: str) -> str:
        """Store ``value`` in a new SecureString parameter ``/fiber/<run>/<random>/<leaf>``."""
        if not self.settings["execution_role"]:
            raise BackendError(
                "the aws-batch backend passes the run's key (and variables marked secret) through SSM "
                "Parameter Store, which needs an ECS execution role: set [aws] execution_role "
                "(FIBER_AWS_EXECUTION_ROLE) to the ARN of a role with ssm:GetParameters on "
                "arn:aws:ssm:*:*:parameter/fiber/*, or set key_from = environment (FIBER_AWS_KEY_FROM), "
                "which lets anyone allowed batch:DescribeJobs read them and reach this process")
        name = f"/fiber/{_run_path(self.run_id) or 'run'}/{os.urandom(4).hex()}/{leaf}"
        try:
            call(self._ssm(), "put_parameter", Name=name, Value=value, Type="SecureString",
                 Description=description, Tags=[{"Key": "fiber.run", "Value": sanitise_tag(self.run_id, 256)}])
        except AwsError as e:
            raise self._error(e, f"cannot store a secret in SSM Parameter Store ({name}) on "
                              f"{self._where()}", "allow ssm:PutParameter and ssm:DeleteParameter "
                              "on parameter/fiber/* to these credentials, or set key_from = "
                              "environment") from None
        return name

    def drop(self) -> None:
        """Delete every parameter made; safe to call twice."""
        with self._lock:
            names = ([self._key[0]] if self._key else []) + list(self._variables.values())
            self._key = None
            self._variables.clear()
        for name in names:
            try:
                call(self._ssm(), "delete_parameter", Name=name)
            except AwsError as e:
                if e.code != "ParameterNotFound":
                    log.warning("fiber: cannot delete SSM parameter %s holding a secret of run %s: %s "
                                "(`fiber clean --backend aws-batch --run %s` removes it)", name,
                                self.run_id, e, self.run_id)

    def clean(self, run_id: str | None) -> list[str]:
        """Delete the parameters of ``run_id`` (or of every fiber run) a crashed run left,
        found by name (DescribeParameters: their values are not read)."""
        run = _run_path(run_id) if run_id else ""
        path = f"/fiber/{run}/" if run else "/fiber/"
        ssm, removed, token = self._ssm(), [], None
        try:
            while True:
                page = call(ssm, "describe_parameters", ParameterFilters=[
                    {"Key": "Path", "Option": "Recursive", "Values": [path.rstrip("/")]}],
                    **({"NextToken": token} if token else {}))
                for p in page.get("Parameters", []):
                    leaf = p["Name"].rpartition("/")[2]
                    if p["Name"].startswith(path) and (leaf == "authkey" or leaf.startswith("env-")):
                        call(ssm, "delete_parameter", Name=p["Name"])
                        removed.append(f"SSM parameter {p['Name']}")
                token = page.get("NextToken")
                if not token:
                    return removed
        except AwsError as e:
            if self.settings["key_from"] == "ssm":
                log.warning("fiber: cannot list or delete the SSM parameters under %s: %s", path, e)
            return removed
