"""The environment variables of a job: those Fiber sets, and what of the program's travels.

A backend copies ``JobSpec.env`` into the job as it is. Fiber puts there, besides its own
variables, the program's environment as :func:`program_environment` decides (what the
stdlib's children would inherit, less what describes this machine: :func:`denied`), with the
settings of :data:`ENV_SETTINGS` (per backend) and :data:`JOB_ENV_KEYS` (per job: ``meta``,
``Process``, ``Pool``). The names a user marks as secrets (``secret_env``) are listed in
``JobSpec.secret_env``: a backend passes them the way it passes the run's key. The run's key is a secret:
whoever reads it can reach the parent and have it unpickle what they send, so a backend
never logs it or shows it in anything others can list, and the job takes it out of its
environment once read (:data:`SECRET_VARIABLES` says what goes with it, and why the
tokens need not be hidden as the key is).
"""

from __future__ import annotations

from collections.abc import Mapping

TYPE_CHECKING = False  # typing's own, without importing typing: a job starts without it
if TYPE_CHECKING:
    from typing import Any

ENV_RUN_ID = "FIBER_RUN_ID"
"""The run's id: every process of one program shares it (and labels its jobs with it)."""
ENV_AUTHKEY = "FIBER_AUTHKEY"
"""The run's key, hex: every connection between its processes is authenticated with it."""
ENV_HUB = "FIBER_PARENT_HUB"
"""Where the job reaches its parent: ``unix:PATH,tcp:HOST:PORT``."""
ENV_TOKEN = "FIBER_PROCESS_TOKEN"
"""Which of its parent's processes the job is (a random token, one per job)."""

ENV_GROUP = "FIBER_GROUP"
"""Set instead of a token of its own for a job started in a group (``Backend.start_jobs``):
the group's secret, from which each member's token derives (:func:`group_token`)."""
ENV_GROUP_INDEX = "FIBER_GROUP_INDEX"
"""The job's place in its group (0, 1, ...). A backend that starts the group as one
platform job (an array job) may leave :data:`ENV_TOKEN` and this out of the children's
common environment and set this one from the platform's own index in each child."""

ENV_PARENT_PID = "FIBER_PARENT_PID"
"""Set by a backend whose jobs are child processes of the parent (the local backend): the
parent's pid. The job then ends the moment its parent does, whatever its own code is
doing (see :mod:`fiber_core.processes.worker`)."""

ENV_PARENT_CHANNEL = "FIBER_PARENT_CHANNEL"
"""Set in a local job forked by the local backend's template: the descriptor of its end of
a socket pair that its parent made for it (:attr:`~fiber_core.contract.backend.Job.channel`),
on which the job talks to its parent instead of dialing :data:`ENV_HUB`."""

ENV_PARENT_RUNDIR = "FIBER_PARENT_RUNDIR"
"""The parent's run directory (a path on the parent's machine). A job that finds it (a
directory of its user) keeps its own run files there, and multiprocessing's temp files
too, so that the parent's exit removes them whatever the job's end; elsewhere it is unused."""

ENV_JOB_HOST = "FIBER_JOB_HOST"
"""Set by a backend that runs jobs on machines other than the parent's, where its jobs on
one machine share that machine's ``/dev/shm``: the machine's name (as in ``Job.host``).
Processes of a run with the same value (unset: the parent's machine, or a machine of
its own, like a pod or a container with a ``/dev/shm`` of its own) keep one copy of a
broadcast value between them (:mod:`fiber_core.parallel.broadcast`). A backend that
leaves it unset on other machines costs one copy per job, never a wrong value."""

SECRET_VARIABLES = frozenset({ENV_AUTHKEY, ENV_TOKEN, ENV_GROUP})
"""What a job takes out of its environment once read, so that nothing it starts inherits it;
and what a backend hides from those who can list its jobs where that costs nothing.

Only the key must be hidden. A token (or a group's secret, from which the tokens of its
members derive) names one process of the parent, and the parent reads it only from a
client that has proved it holds the key: without the key a token opens nothing, and with
the key it adds nothing (the key alone lets its holder send the parent what it unpickles).
So a backend that gives its jobs the key by a channel of its own may leave the tokens in
the plain job definition: the kubernetes backend's pod spec and AWS Batch's
``DescribeJobs`` show them; docker's and ssh's channel carries them with the key."""

PER_MEMBER_VARIABLES = frozenset({ENV_TOKEN, ENV_GROUP_INDEX})
"""What differs between the environments of a group's members: a backend that starts the
group as one array job drops these and sets :data:`ENV_GROUP_INDEX` in each child."""


DENIED_VARIABLES = frozenset({
    # Fiber's own (its secrets, and what the job's spec sets anew for each job)
    ENV_AUTHKEY, ENV_TOKEN, ENV_GROUP, ENV_GROUP_INDEX, ENV_HUB, ENV_RUN_ID, ENV_PARENT_PID,
    ENV_PARENT_CHANNEL, ENV_PARENT_RUNDIR, ENV_JOB_HOST,
    # this machine, its account and its interpreter: the job's machine has its own
    "PATH", "HOME", "HOSTNAME", "USER", "LOGNAME", "SHELL", "MAIL", "TMPDIR", "PWD", "OLDPWD",
    "SHLVL", "_", "VIRTUAL_ENV", "PYTHONHOME", "KUBECONFIG", "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    # the terminal, display and session
    "TERM", "COLORTERM", "COLUMNS", "LINES", "LS_COLORS", "DISPLAY", "WAYLAND_DISPLAY", "WINDOWID",
    "SESSION_MANAGER", "DESKTOP_SESSION", "TMUX", "TMUX_PANE", "STY",
})
"""Variables of the program's environment that never reach a job on another machine: Fiber's
own, and those that describe this machine, its account, terminal or session (the job's
machine, image or platform sets its own). :data:`DENIED_PATTERNS` adds families of names."""

DENIED_PATTERNS = ("SSH_*", "XDG_*", "DBUS_*", "TERM_*", "GNOME_*", "KDE_*", "VTE_*", "BASH_FUNC_*",
                   "CONDA_*", "DOCKER_*", "KUBERNETES_*", "AWS_*", "ECS_*")
"""Families of names that never reach a job on another machine (``fnmatch`` patterns): the
SSH session, the desktop, exported shell functions, the parent's conda environment, and the
platforms' own variables and credentials (``DOCKER_HOST``, ``KUBERNETES_SERVICE_HOST``,
``AWS_BATCH_JOB_ID``, ``AWS_SECRET_ACCESS_KEY``, ``ECS_CONTAINER_METADATA_URI``): a job gets
its platform's, and its credentials from its role, or as a marked secret (``secret_env``)."""

ENV_SETTINGS = ("env_pass", "env_exclude", "extra_env", "secret_env")
"""The settings of a backend that shape its jobs' environments (the contract's
``ENV_OPTIONS`` declares them): pass the program's environment or not, names or patterns it
leaves out, ``KEY=VALUE`` pairs added, names passed as secrets."""

JOB_ENV_KEYS = ("env_pass", "env_exclude", "env", "secret_env")
"""The same choices for one job (``meta(...)``, ``Process(...)``, ``Pool(...)``): ``env`` is a
mapping of the variables added; ``env_pass`` replaces the backend's; the others add to its."""

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_PATTERN = r"[A-Za-z0-9_*?\[\]!-]+"


def denied(name: str) -> bool:
    """Whether the program's variable ``name`` stays on this machine (:data:`DENIED_VARIABLES`,
    :data:`DENIED_PATTERNS`, or a name that is not an identifier, which some platforms refuse)."""
    return name in DENIED_VARIABLES or not _matcher(DENIED_PATTERNS, _NAME)(name)


_matchers: dict[tuple[tuple[str, ...], str | None], Any] = {}


def _matcher(patterns: tuple[str, ...], shape: str | None = None) -> Any:
    """A function telling whether a name matches one of ``patterns`` (``fnmatch``, case
    sensitive), or, given ``shape``, whether it has that shape and matches none: one regular
    expression, compiled once."""
    key = (patterns, shape)
    found = _matchers.get(key)
    if found is None:
        import fnmatch
        import re

        alternatives = "|".join(fnmatch.translate(p) for p in patterns) or "(?!)"
        if shape is None:
            found = re.compile(f"(?:{alternatives})").match
        else:
            found = re.compile(f"(?!(?:{alternatives}))(?:{shape})\\Z").match
        if len(_matchers) < 64:
            _matchers[key] = found
    return found


def check_name(name: object, what: str) -> str:
    """``name`` if it is a variable name a job can be given, else a ConfigError saying so."""
    import re

    from fiber_core.base.errors import ConfigError

    if not isinstance(name, str) or not re.fullmatch(_NAME, name):
        raise ConfigError(f"{what}: {name!r} is not a variable name (letters, digits and _, not first a digit)")
    if name in SECRET_VARIABLES or name in DENIED_VARIABLES and name.startswith("FIBER_"):
        raise ConfigError(f"{what}: {name} is Fiber's own variable, set by Fiber in every job")
    return name


def check_value(name: str, value: object, what: str) -> str:
    """``value`` if it is a string a variable can hold, else a ConfigError saying so."""
    from fiber_core.base.errors import ConfigError

    if not isinstance(value, str):
        raise ConfigError(f"{what}: the value of {name} is {type(value).__name__} {value!r}; give a string "
                          f"(str({value!r}) if that is what is meant)")
    if "\0" in value:
        raise ConfigError(f"{what}: the value of {name} holds a NUL character, which no variable can")
    return value


def check_patterns(patterns: object, what: str) -> tuple[str, ...]:
    """Names or ``fnmatch`` patterns (``MY_*``) as a tuple, else a ConfigError saying so."""
    import re

    from fiber_core.base.errors import ConfigError

    items = [patterns] if isinstance(patterns, str) else patterns
    if not isinstance(items, (list, tuple, set, frozenset)):
        raise ConfigError(f"{what}: expected names or patterns (a list of strings), got {type(patterns).__name__}")
    for p in items:
        if not isinstance(p, str) or not re.fullmatch(_PATTERN, p):
            raise ConfigError(f"{what}: {p!r} is not a variable name or pattern (letters, digits, _ and "
                              "the wildcards * ? [...])")
    return tuple(sorted(items))


def check_job_env(choices: Mapping[str, Any], what: str) -> dict[str, Any]:
    """One job's choices (:data:`JOB_ENV_KEYS`) checked and made canonical: ``env`` a dict of
    strings, ``env_exclude`` and ``secret_env`` tuples, ``env_pass`` a bool. A bad one is a
    :class:`~fiber_core.base.errors.ConfigError` naming ``what`` it was given to."""
    from fiber_core.base.errors import ConfigError

    out: dict[str, Any] = {}
    for key, value in choices.items():
        if value is None:
            continue
        where = f"{what}({key}=...)"
        if key == "env_pass":
            if not isinstance(value, bool):
                raise ConfigError(f"{where}: expected True or False, got {value!r}")
            out[key] = value
        elif key == "env":
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where}: expected a mapping of names to strings, got {type(value).__name__}")
            out[key] = {check_name(k, where): check_value(k, v, where) for k, v in value.items()}
        elif key == "env_exclude":
            out[key] = check_patterns(value, where)
        elif key == "secret_env":
            names = [value] if isinstance(value, str) else value
            if not isinstance(names, (list, tuple, set, frozenset)):
                raise ConfigError(f"{where}: expected variable names, got {type(value).__name__}")
            out[key] = tuple(sorted(check_name(n, where) for n in names))
        else:
            raise ConfigError(f"{what}: unknown environment choice {key!r} (known: {', '.join(JOB_ENV_KEYS)})")
    return out


def check_env_settings(settings: Mapping[str, Any], where: str) -> None:
    """Check a backend's :data:`ENV_SETTINGS` (as resolved), so that a bad one fails when the
    backend is made, naming ``where`` it is set."""
    from fiber_core.base.options import parse_pairs

    for name, value in parse_pairs(settings.get("extra_env") or (), f"extra_env in {where}").items():
        check_value(check_name(name, f"extra_env in {where}"), value, f"extra_env in {where}")
    check_patterns(settings.get("env_exclude") or (), f"env_exclude in {where}")
    for name in settings.get("secret_env") or ():
        check_name(name, f"secret_env in {where}")


def program_environment(environ: Mapping[str, str], settings: Mapping[str, Any],
                        job: Mapping[str, Any] | None = None, *,
                        same_machine: bool = False) -> tuple[dict[str, str], tuple[str, ...]]:
    """What a job gets of the program's environment, and which of its names are secrets.

    ``settings`` are the backend's (:data:`ENV_SETTINGS`, checked), ``job`` the job's own
    choices (:func:`check_job_env`), which win. The program's variables pass unless
    ``env_pass`` is false, less the :func:`denied` ones and those ``env_exclude`` names; then
    ``extra_env`` and the job's ``env`` are set over them. A name marked ``secret_env`` passes
    (from ``env`` if given there, else from ``environ``) whatever the rest says, and is
    listed in the second part. With ``same_machine`` (a job on this machine, which inherits
    the environment whole), only what is added or marked is returned.
    """
    from fiber_core.base.options import parse_pairs

    job = job or {}
    passing = job.get("env_pass")
    if passing is None:
        passing = settings.get("env_pass", True) is not False
    exclude = (*(settings.get("env_exclude") or ()), *job.get("env_exclude", ()))
    out: dict[str, str] = {}
    if passing and not same_machine:
        out = {k: v for k, v in environ.items() if not denied(k)}
        if exclude:
            excluded = _matcher(tuple(exclude))
            out = {k: v for k, v in out.items() if not excluded(k)}
    added = {**parse_pairs(settings.get("extra_env") or (), "extra_env"), **job.get("env", {})}
    out.update(added)
    secret = sorted({*(settings.get("secret_env") or ()), *job.get("secret_env", ())})
    for name in secret:
        if name not in added and name in environ:
            out[name] = environ[name]
    return out, tuple(n for n in secret if n in out)


def group_token(group: str, index: int) -> str:
    """The token of member ``index`` of the group whose secret is ``group``."""
    import hashlib

    return hashlib.sha256(f"{group}:{index}".encode()).hexdigest()[:32]


def job_token(environ: dict[str, str] | None = None) -> str:
    """This job's token: its own, or the one its group's secret and its index give."""
    import os

    env = os.environ if environ is None else environ
    token = env.get(ENV_TOKEN)
    if token:
        return token
    if env.get(ENV_GROUP) and env.get(ENV_GROUP_INDEX, "").isdigit():
        return group_token(env[ENV_GROUP], int(env[ENV_GROUP_INDEX]))
    raise KeyError(f"{ENV_TOKEN} (or {ENV_GROUP} and {ENV_GROUP_INDEX}) is not set: "
                   "this process was not started by Fiber")

__all__ = ["DENIED_PATTERNS", "DENIED_VARIABLES", "ENV_SETTINGS", "JOB_ENV_KEYS", "check_env_settings",
           "check_job_env", "check_name", "check_patterns", "check_value", "denied", "program_environment",
           "ENV_AUTHKEY", "ENV_GROUP", "ENV_GROUP_INDEX", "ENV_HUB", "ENV_JOB_HOST", "ENV_PARENT_CHANNEL", "ENV_PARENT_PID",
           "ENV_PARENT_RUNDIR", "ENV_RUN_ID",
           "ENV_TOKEN", "PER_MEMBER_VARIABLES", "SECRET_VARIABLES", "group_token", "job_token"]
