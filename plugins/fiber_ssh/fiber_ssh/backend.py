"""The ``ssh`` backend: every Fiber job is a process on one of a list of SSH hosts.

How a job starts, whole: :meth:`SshBackend.create_job` places the job on the live host
with the most free slots (GPU jobs only on hosts that declare GPUs, see
:mod:`fiber_ssh.hosts`), opens a channel on the one SSH connection it keeps to that host
(a paramiko ``Transport``, opened the first time with the host key checked, a key
login, and a probe of the remote Python), and execs the job supervisor
(:mod:`fiber_ssh.supervisor`) there. The job itself (argv, environment, working
directory) travels over the channel's stdin; the supervisor starts it in a new
session and reports its process group and, at the end, its exit code on stdout.

One watcher (:meth:`~fiber_core.contract.Backend.watch`) reads every channel (paramiko
signals a channel through a pipe when data arrives or it closes): it keeps each job's
log (the channel's stderr) in ``job.state.log`` and finishes ``job.state`` as exit codes
arrive, so polling never makes a round trip, and sends each supervisor a heartbeat.
``terminate_job`` and ``kill_job`` write ``T`` or ``K`` to the supervisor, which signals
the whole process group.

Why a job ended (:class:`~fiber_core.contract.EndReason`): its own exit, or a signal
Fiber did not send, is ``EXITED``; a SIGKILL while the kernel counted an out-of-memory
kill in the supervisor's memory cgroup is ``OOM``; a command the supervisor could not
start (or a supervisor that did not run) is ``NEVER_STARTED``; a lost host is
``HOST_LOST``; what Fiber stopped is ``STOPPED``.

A host that stops answering (keepalives every ``keepalive`` seconds, and the kernel
gives up on the connection after ``keepalive_count`` of them go unanswered, or after
``peer_timeout`` if that is shorter) is *lost*: its jobs end with ``-1`` (SIGHUP: the
line to them hung up), placement skips it, and a watcher tries it again every
``retry_lost`` seconds. Its supervisors, cut off from the parent, kill their jobs after
``orphan_timeout`` seconds without a heartbeat.

paramiko is imported when a backend is created, never when the plugin is loaded.
"""

from __future__ import annotations

import base64
import fnmatch
import getpass
import hashlib
import itertools
import json
import logging
import marshal
import math
import os
import selectors
import shlex
import signal
import socket
import stat
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fiber_core.contract import (
    ENV_JOB_HOST,
    Backend,
    BackendError,
    ConfigError,
    EndReason,
    Job,
    JobSpec,
    Option,
    Watcher,
    exitcode_from_status,
    install_elsewhere,
    keepalive,
)

from fiber_ssh import upload_dir
from fiber_ssh.hosts import HostSpec, Placement, Slots, parse_hosts, place, release

if TYPE_CHECKING:
    import paramiko

log = logging.getLogger("fiber")

DEFAULT_EXCLUDE = [".git", ".hg", ".svn", "__pycache__", "*.pyc", ".venv", "venv", ".tox",
                   ".mypy_cache", ".pytest_cache", ".ruff_cache", "node_modules", ".fiberconfig"]

OPTIONS: tuple[Option, ...] = (
    Option("hosts", str, None,
           "hosts that run the jobs, comma- or space-separated: "
           "[user@]host[:port][*slots][[gpu=N,gpu_type=T]]"),
    Option("user", str, None, "login for hosts that name none (default: ~/.ssh/config, then the local user)"),
    Option("port", int, None, "SSH port for hosts that name none (default: ~/.ssh/config, then 22)"),
    Option("key", str, None,
           "private key file to log in with (default: ~/.ssh/config's IdentityFile, then ~/.ssh/id_*)"),
    Option("agent", bool, True, "also try the keys of a running ssh-agent (SSH_AUTH_SOCK); a key with a passphrase "
           "is used through the agent"),
    Option("known_hosts", str, "~/.ssh/known_hosts", "known_hosts file that host keys are checked against (and /etc/ssh/ssh_known_hosts)"),
    Option("host_key_policy", str, "strict",
           "strict: an unknown or changed host key is an error; accept-new: unknown keys are "
           "added to known_hosts (a changed key is still an error)", choices=("strict", "accept-new")),
    Option("ssh_config", str, "~/.ssh/config",
           "OpenSSH client configuration read for HostName, User, Port, IdentityFile (empty: none)"),
    Option("python", str, "python3",
           "Python on the hosts, with fiber-core installed: give a full path (login shells change PATH: "
           "pyenv, conda); the global python setting, if set, wins"),
    Option("workdir", str, None,
           "working directory of the jobs on the hosts (default: the upload directory, else the home)"),
    Option("upload", bool, False, "copy this process's working directory to every host (sftp) before its first "
           "job there, into workdir (an existing one only if it is the login's and others cannot write "
           "in it), else a new directory in the host's temp directory, with a random name and mode 0700, "
           "that cleanup removes; the jobs run there, so its modules import"),
    Option("upload_exclude", list, DEFAULT_EXCLUDE, "names and glob patterns that upload skips"),
    Option("upload_max_mb", float, 100.0, "refuse to upload a working directory larger than this (MiB)"),
    Option("timeout", float, 15.0,
           "seconds to connect, log in and run the first command on a host before it counts as unreachable"),
    Option("keepalive", float, 1.0, "seconds between keepalives on each connection, and heartbeats to each job"),
    Option("keepalive_count", int, 3, "keepalive intervals without an answer before a host is lost (the global "
           "peer_timeout, if shorter, wins)"),
    Option("retry_lost", float, 60.0, "seconds before a lost host is tried again, in the background (0: never)"),
    Option("orphan_timeout", float, 30.0,
           "seconds a remote job lives on without a heartbeat from this process (0: forever)"),
)

LOST = -signal.SIGHUP
"""Exit code of a job whose host was lost: the line to it hung up."""

_EXIT_GRACE = 2.0  # seconds to wait for the rest of a job's log after its exit code
_IDLE = 3600.0  # a watcher's pause when only a wake() or a stop() has something for it
_SUPERVISOR = Path(__file__).with_name("supervisor.py").read_text().split('"""\n', 1)[1].lstrip()
"""The supervisor's code without its docstring: it is on the command line of every job."""
_PROBE = r"""
import json, os, socket, sys, tempfile
info = {"python": sys.version.split()[0], "new_enough": sys.version_info >= (3, 10),
        "cpus": os.cpu_count() or 1, "tmp": tempfile.gettempdir(), "hostname": socket.gethostname(),
        "uid": os.getuid()}
try:
    import fiber_core
    info["fiber_core"] = getattr(fiber_core, "__version__", "?")
except Exception as e:
    info["fiber_core_error"] = f"{type(e).__name__}: {e}"
if sys.argv[1:]:
    info["workdir"] = os.path.isdir(os.path.expanduser(sys.argv[1]))
print("\n@fiber probe " + json.dumps(info), flush=True)
"""


class _Unreachable(Exception):
    """The host did not answer (network, sshd down): it is lost, another may do."""


@dataclass(eq=False)
class _Host:
    """One host of the list: how to reach it and the connections to it."""

    spec: HostSpec
    addr: str
    port: int
    user: str
    key_files: list[str]
    name: str
    """``user@addr:port`` as far as it differs from the defaults: for messages."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    transports: list[paramiko.Transport] = field(default_factory=list)
    info: dict[str, Any] | None = None
    """What the probe found: python version, cpus, tmp, hostname."""
    error: BackendError | None = None
    """A configuration problem (host key, login, Python): raised on every use."""
    lost_reason: str = ""
    lost_at: float = 0.0
    workdir: str | None = None
    uploaded: bool = False
    created_dir: str | None = None
    """A directory this run created there (the upload), removed by cleanup()."""

    @property
    def hostname(self) -> str:
        return (self.info or {}).get("hostname") or self.addr


@dataclass(eq=False)
class _Run:
    """One job's channel and what its supervisor said (``Job.handle``)."""

    host: _Host
    index: int
    placement: Placement
    transport: paramiko.Transport
    chan: paramiko.Channel
    pgid: int | None = None  # the job's process group on the host, once it runs
    reported: int | None = None  # the exit code the supervisor reported, and when
    reported_at: float = 0.0
    error: str = ""  # why the supervisor could not start the job
    oom: bool = False  # the supervisor saw the kernel's OOM killer end it
    ended: bool = False  # its end is recorded (the slots given back), under the backend's lock
    out: bytes = b""

    def feed_out(self, data: bytes) -> None:
        self.out += data
        *lines, self.out = self.out.split(b"\n")
        for line in lines:
            if not line.startswith(b"@fiber "):
                continue  # a login shell's chatter
            kind, _, value = line[7:].decode("utf-8", "replace").partition(" ")
            try:
                if kind == "pid":
                    self.pgid = int(value)
                elif kind == "error":
                    self.error = value
                elif kind == "oom":
                    self.oom = True
                elif kind == "exit":
                    self.reported = int(value)
                    self.reported_at = time.monotonic()
            except ValueError:
                pass

    def send(self, command: bytes) -> None:
        try:
            self.chan.send(command)
        except Exception:  # the channel or its connection is gone: nothing to signal
            pass


class SshBackend(Backend):
    """Jobs are processes on SSH hosts: one connection per host, one channel per job."""

    name = "ssh"
    package = "fiber-ssh"
    options = OPTIONS
    create_concurrency = 16  # a group start opens channels on several hosts at once
    spare_jobs = 1  # an idle worker holds one slot of a host

    def __init__(self, settings: Mapping[str, Any] | None = None, run_id: str = "",
                 rundir: str | None = None) -> None:
        super().__init__(settings, run_id, rundir)
        import paramiko  # noqa: F401  (fail here, clearly, if it is missing)

        for o in OPTIONS:
            self.settings.setdefault(o.name, o.default)
        self._lock = threading.RLock()
        self._hosts: list[_Host] = []
        self._slots: list[Slots] = []
        self._start_lock = threading.Lock()
        self._channels: _Channels | None = None
        self._reviver: Watcher | None = None
        self._count = itertools.count(1)
        self._known_lock = threading.Lock()
        self._known: tuple[paramiko.HostKeys, paramiko.HostKeys] | None = None
        self._pkeys: dict[str, Any] = {}
        self._warned_full = False
        self._listen_addr: str | None = None

    # -- settings -----------------------------------------------------------------------

    @property
    def _timeout(self) -> float:
        return float(self.settings["timeout"])

    def worker_command(self) -> list[str]:
        return [self.settings["python"] or "python3"]

    def _resolve(self, spec: HostSpec, ssh_config: Any) -> _Host:
        """Apply ~/.ssh/config and the defaults to one host entry."""
        cfg: dict[str, Any] = dict(ssh_config.lookup(spec.host)) if ssh_config is not None else {}
        addr = cfg.get("hostname") or spec.host
        port = spec.port or self.settings["port"] or int(cfg.get("port") or 22)
        user = spec.user or self.settings["user"] or cfg.get("user") or getpass.getuser()
        if self.settings["key"]:
            keys = [self.settings["key"]]
        else:
            keys = list(cfg.get("identityfile") or [])
            keys += [f"~/.ssh/id_{kind}" for kind in ("ed25519", "ecdsa", "rsa")]
        keys = [os.path.expanduser(k) for k in keys]
        if not self.settings["key"]:
            keys = [k for k in keys if os.path.exists(k)]
        name = f"{user}@{addr}" + (f":{port}" if port != 22 else "")
        return _Host(spec=spec, addr=addr, port=port, user=user, key_files=keys, name=name)

    def _load_hosts(self) -> list[_Host]:
        specs = parse_hosts(self.settings["hosts"])
        ssh_config = None
        path = os.path.expanduser(self.settings["ssh_config"] or "")
        if path and os.path.isfile(path):
            import paramiko

            try:
                ssh_config = paramiko.SSHConfig.from_path(path)
            except Exception as e:
                raise ConfigError(f"cannot read the SSH client configuration {path}: fix it, or set "
                                  "[ssh] ssh_config to another file", cause=e) from None
        return [self._resolve(s, ssh_config) for s in specs]

    # -- the contract -------------------------------------------------------------------

    def get_listen_addr(self) -> str:
        """This machine's address on the route to the first host (what the hosts can reach)."""
        if self._listen_addr is not None:
            return self._listen_addr
        host = self._load_hosts()[0]
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(host.addr, host.port, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)  # a route lookup: UDP sends nothing on connect
                self._listen_addr = str(s.getsockname()[0])
                return self._listen_addr
        except OSError as e:
            raise BackendError(
                f"cannot find this machine's address on the route to {host.addr}: set listen_host "
                "(FIBER_LISTEN_HOST) to an address the SSH hosts can reach", cause=e) from None

    def create_job(self, spec: JobSpec) -> Job:
        if spec.volumes:
            raise BackendError(
                f"the ssh backend cannot mount volumes ({', '.join(spec.volumes)}) for {spec.name}: "
                "use a filesystem the hosts share, or [ssh] upload"
            )
        self._start()
        for _ in range(len(self._hosts) + 1):
            with self._lock:
                try:
                    gpu = spec.gpu or (1 if spec.gpu_type else 0)  # a type alone means one GPU
                    placement = place(self._slots, spec.cpu, gpu, spec.gpu_type)
                except BackendError as e:
                    raise BackendError(f"{e}{self._lost_summary()}") from None
                self._warn_if_full(placement)
            host = self._hosts[placement.index]
            try:
                return self._launch(host, placement, spec)
            except _Unreachable as e:
                with self._lock:
                    release(self._slots, placement)
                self._lose(host, str(e))
            except BaseException:
                with self._lock:
                    release(self._slots, placement)
                raise
        raise BackendError(f"could not start {spec.name} on any SSH host{self._lost_summary()}")

    def terminate_job(self, job: Job) -> None:
        if not job.state.done():
            job.handle.send(b"T\n")

    def kill_job(self, job: Job) -> None:
        if not job.state.done():
            job.handle.send(b"K\n")

    def cleanup(self) -> None:
        """Kill the jobs still running, remove uploaded directories, close the connections."""
        jobs = self.take_jobs()
        running = [j for j in jobs if not j.state.done()]
        for job in running:
            job.state.stop_requested = True
            self.kill_job(job)
        deadline = time.monotonic() + max(5.0, self._timeout)
        for job in running:
            job.state.wait(max(0.0, deadline - time.monotonic()))
        with self._start_lock:
            hosts, self._hosts = self._hosts, []
            with self._lock:
                self._slots = []
            channels, self._channels = self._channels, None
        if channels is not None:
            channels.close()  # it finishes the jobs it follows, closed by cleanup
        dirs = [h for h in hosts if h.created_dir and any(t.is_active() for t in h.transports)]
        if dirs:
            with ThreadPoolExecutor(len(dirs)) as pool:
                list(pool.map(self._remove_upload, dirs))
        for host in hosts:
            for t in host.transports:
                t.close()
        for job in running:
            self._finish(job, closing=True)  # if the channels watcher has not: first finish wins
        super().cleanup()

    # -- hosts: connecting, losing, reviving ---------------------------------------------

    def _start(self) -> None:
        """Connect to every host at once, the first time a job is created."""
        with self._start_lock:
            if self._hosts:
                return
            hosts = self._load_hosts()
            with ThreadPoolExecutor(min(len(hosts), 32)) as pool:
                results = list(pool.map(self._first_connect, hosts))
            errors = [h.error for h in hosts if h.error is not None]
            if errors:
                for h in hosts:
                    for t in h.transports:
                        t.close()
                if len(errors) == 1:
                    raise errors[0]
                raise BackendError("; ".join(str(e) for e in errors))
            if all(r is not None for r in results):
                raise BackendError(
                    "no SSH host is reachable. Check that the hosts are up and run sshd, and the "
                    "[ssh] hosts setting (FIBER_SSH_HOSTS): "
                    + "; ".join(f"{h.name}: {r}" for h, r in zip(hosts, results))
                )
            slots = []
            for h, reason in zip(hosts, results):
                n = h.spec.slots or (h.info or {}).get("cpus") or 1
                slots.append(Slots(h.name, n, h.spec.gpu, h.spec.gpu_type, alive=reason is None))
                if reason is not None:
                    h.lost_reason, h.lost_at = reason, time.monotonic()
                    log.warning("fiber-ssh: host %s is unreachable: %s", h.name, reason)
            with self._lock:
                self._slots = slots
            self._hosts = hosts
            self._channels = _Channels(self)
            self.watch(self._channels.follow, "channels", max_backoff=5.0)
            retry = self.settings["retry_lost"]
            if retry:
                self._reviver = self.watch(self._revive_lost, "revive", interval=retry, max_backoff=retry)

    def _first_connect(self, host: _Host) -> str | None:
        """Connect, check and probe one host; return why it is unreachable, or None."""
        try:
            t = self._connect(host)
        except _Unreachable as e:
            return str(e)
        except BackendError as e:
            host.error = e
            return None
        host.transports.append(t)
        return None

    def _connect(self, host: _Host) -> paramiko.Transport:
        import paramiko

        timeout = self._timeout
        try:
            sock = socket.create_connection((host.addr, host.port), timeout=timeout)
        except OSError as e:
            raise _Unreachable(f"cannot connect to {host.addr} port {host.port}: {e}") from e
        self._tune(sock)
        t = paramiko.Transport(sock)
        t.banner_timeout = t.handshake_timeout = t.auth_timeout = timeout
        try:
            known = self._known_types(host)
            if known:
                options = t.get_security_options()
                options.key_types = [k for k in options.key_types if k in known] + [
                    k for k in options.key_types if k not in known]
            try:
                t.start_client(timeout=timeout)
            except (paramiko.SSHException, OSError, EOFError) as e:
                raise _Unreachable(f"the SSH handshake with {host.name} failed: {e or type(e).__name__}") from e
            self._check_host_key(host, t.get_remote_server_key())
            self._authenticate(host, t)
            t.set_keepalive(self.settings["keepalive"])
            if host.info is None:
                host.info = self._probe(host, t)
                host.workdir = self._workdir(host)
            return t
        except BaseException:
            t.close()
            raise

    def _tune(self, sock: socket.socket) -> None:
        """Make the kernel give up on a connection whose keepalives go unanswered.

        After ``keepalive_count`` intervals of ``keepalive`` seconds, or ``peer_timeout``
        (Fiber's bound for any silent peer) when that is shorter.
        """
        interval = max(1, math.ceil(self.settings["keepalive"]))
        count = self.settings["keepalive_count"]
        if self.peer_timeout > 0:  # probes start after one interval: (1 + count) intervals in all
            count = min(count, max(1, int(self.peer_timeout // interval) - 1))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        keepalive(sock, interval, interval, count)

    def _lose(self, host: _Host, reason: str) -> None:
        """Mark a host lost: placement skips it until the reviver reconnects."""
        index = self._hosts.index(host) if host in self._hosts else -1
        with self._lock:
            if index < 0 or not self._slots[index].alive:
                return
            self._slots[index].alive = False
            host.lost_reason, host.lost_at = reason, time.monotonic()
        log.warning("fiber-ssh: lost host %s (%s); its jobs end with %d", host.name, reason, LOST)
        if self._reviver is not None:
            self._reviver.wake()  # to wait for this host's retry time

    def _revive_lost(self) -> float:
        """One round of the reviver: reconnect to the lost hosts whose retry time came.

        Returns the seconds until the next one is due (a loss wakes it sooner).
        """
        retry = self.settings["retry_lost"]
        with self._lock:
            lost = [(i, h) for i, (h, s) in enumerate(zip(self._hosts, self._slots)) if not s.alive]
        due = [(i, h) for i, h in lost if time.monotonic() - h.lost_at >= retry]
        if due:
            with ThreadPoolExecutor(len(due)) as pool:
                list(pool.map(lambda ih: self._revive(*ih), due))
        with self._lock:
            waits = [h.lost_at + retry - time.monotonic()
                     for h, s in zip(self._hosts, self._slots) if not s.alive]
        return max(0.0, min(waits)) if waits else _IDLE

    def _revive(self, index: int, host: _Host) -> None:
        try:
            t = self._connect(host)
        except (_Unreachable, BackendError) as e:
            with self._lock:
                host.lost_reason, host.lost_at = str(e), time.monotonic()
            return
        with host.lock:
            host.transports = [x for x in host.transports if x.is_active()] + [t]
        with self._lock:
            current = index < len(self._slots) and self._hosts[index] is host
            if current:
                if host.spec.slots is None and host.info:  # unreachable at start: now we know
                    self._slots[index].slots = host.info.get("cpus") or 1
                self._slots[index].alive = True
        if not current:
            t.close()  # cleanup came meanwhile
            return
        log.warning("fiber-ssh: host %s is back", host.name)

    def _lost_summary(self) -> str:
        with self._lock:
            lost = [f"{h.name}: {h.lost_reason}" for h, s in zip(self._hosts, self._slots) if not s.alive]
        return f" (lost hosts: {'; '.join(lost)})" if lost else ""

    def _warn_if_full(self, placement: Placement) -> None:
        s = self._slots[placement.index]
        if s.free < 0 and not self._warned_full:
            self._warned_full = True
            total = sum(x.slots for x in self._slots if x.alive)
            log.warning("fiber-ssh: every host is full (%d slots); placing jobs over the limit", total)

    # -- host keys and login ---------------------------------------------------------------

    def _known_hosts(self) -> tuple[paramiko.HostKeys, paramiko.HostKeys]:
        """(this user's known_hosts, the system's), loaded once."""
        import paramiko

        with self._known_lock:
            if self._known is None:
                user, system = paramiko.HostKeys(), paramiko.HostKeys()
                path = os.path.expanduser(self.settings["known_hosts"])
                for keys, file in ((user, path), (system, "/etc/ssh/ssh_known_hosts")):
                    if os.path.isfile(file):
                        try:
                            keys.load(file)
                        except (OSError, paramiko.SSHException) as e:
                            raise ConfigError(f"cannot read known_hosts file {file}: fix or remove "
                                              "the bad line", cause=e) from None
                self._known = (user, system)
            return self._known

    @staticmethod
    def _key_name(host: _Host) -> str:
        return host.addr if host.port == 22 else f"[{host.addr}]:{host.port}"

    def _known_types(self, host: _Host) -> list[str]:
        out: list[str] = []
        for keys in self._known_hosts():
            entry = keys.lookup(self._key_name(host))
            if entry:
                out += [t for t in entry.keys() if t not in out]
        if "ssh-rsa" in out:
            out += ["rsa-sha2-512", "rsa-sha2-256"]
        return out

    def _check_host_key(self, host: _Host, key: paramiko.PKey) -> None:
        name, keytype = self._key_name(host), key.get_name()
        path = os.path.expanduser(self.settings["known_hosts"])
        shown = f"{keytype} {_fingerprint(key)}"
        known = [k for keys in self._known_hosts() if (entry := keys.lookup(name)) for k in entry.values()]
        if any(k == key for k in known):
            return
        if known:
            raise BackendError(
                f"the host key of {host.name} has CHANGED: it presented {shown}, which is not the "
                f"key known for {name} in {path}. If the host was reinstalled, remove the old key "
                f"(ssh-keygen -R '{name}' -f {path}); otherwise someone may be intercepting the connection"
            )
        if self.settings["host_key_policy"] != "accept-new":
            raise BackendError(
                f"the host key of {host.name} is unknown: {name} is not in {path} (it presented "
                f"{shown}). Check the key and add it (ssh-keyscan -p {host.port} {host.addr} >> {path}), "
                "or set [ssh] host_key_policy = accept-new to add new keys automatically"
            )
        with self._known_lock:
            assert self._known is not None
            entry = self._known[0].lookup(name)
            if entry is not None and entry.get(keytype) == key:
                return  # another connection to the host added it meanwhile
            self._known[0].add(name, keytype, key)
            os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            with os.fdopen(fd, "a", encoding="utf-8") as f:
                f.write(f"{name} {keytype} {key.get_base64()}\n")
        log.warning("fiber-ssh: added the host key of %s (%s) to %s", host.name, shown, path)

    def _keys(self, host: _Host) -> Iterator[tuple[str, Any]]:
        """(description, key) pairs to offer: the key files, then the agent's keys."""
        import paramiko

        for path in host.key_files:
            with self._known_lock:
                pkey = self._pkeys.get(path)
            if pkey is None:
                try:
                    pkey = paramiko.PKey.from_path(path)
                except FileNotFoundError as e:
                    raise BackendError(f"the key file {path} for {host.name} does not exist: fix [ssh] key "
                                       "(FIBER_SSH_KEY)", cause=e) from None
                except paramiko.PasswordRequiredException:
                    log.warning("fiber-ssh: skipping %s: it needs a passphrase (load it into ssh-agent)", path)
                    continue
                except (OSError, paramiko.SSHException, ValueError) as e:
                    raise BackendError(f"cannot read the key file {path} for {host.name}: give a private "
                                       "key in OpenSSH or PEM format in [ssh] key (FIBER_SSH_KEY)",
                                       cause=e) from None
                with self._known_lock:
                    self._pkeys[path] = pkey
            yield path, pkey
        if self.settings["agent"] and os.environ.get("SSH_AUTH_SOCK"):
            try:
                agent_keys = paramiko.Agent().get_keys()
            except Exception:
                agent_keys = ()
            for i, key in enumerate(agent_keys):
                yield f"ssh-agent key {i + 1} ({key.get_name()})", key

    def _authenticate(self, host: _Host, t: paramiko.Transport) -> None:
        import paramiko

        tried = []
        for desc, key in self._keys(host):
            try:
                t.auth_publickey(host.user, key)
            except paramiko.BadAuthenticationType as e:
                raise BackendError(
                    f"{host.name} does not accept key login (it allows: {', '.join(e.allowed_types)}); "
                    "fiber-ssh logs in with keys only: enable PubkeyAuthentication in its sshd", cause=e
                ) from None
            except paramiko.AuthenticationException:
                tried.append(desc)
                continue
            except (paramiko.SSHException, OSError, EOFError) as e:
                raise _Unreachable(f"the connection to {host.name} broke during login: {e}") from e
            if t.is_authenticated():
                return
        raise BackendError(
            f"{host.name} refused the login as {host.user!r} (tried: {', '.join(tried) or 'no key at all'}). "
            "Check the user ([ssh] user, or user@ in [ssh] hosts), the key ([ssh] key or ssh-agent), "
            f"and that the key is in ~{host.user}/.ssh/authorized_keys there"
        )

    # -- commands on a host -----------------------------------------------------------------

    def _run(self, host: _Host, t: paramiko.Transport, command: str) -> tuple[int, str, str]:
        """Run ``command`` and return (exit status, stdout, stderr), within ``timeout``."""
        import paramiko

        deadline = time.monotonic() + self._timeout
        try:
            chan = t.open_session(timeout=self._timeout)
            chan.exec_command(command)
            chan.shutdown_write()
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise _Unreachable(f"{host.name} did not run a command: {e}") from e
        out, err = bytearray(), bytearray()
        with selectors.DefaultSelector() as sel:
            sel.register(chan, selectors.EVENT_READ)
            while True:
                closed = chan.closed
                while chan.recv_ready():
                    out += chan.recv(65536)
                while chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536)
                if closed:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    chan.close()
                    raise _Unreachable(f"{host.name} did not finish {command[:60]!r}... within "
                                       f"{self._timeout:g} s (see [ssh] timeout)")
                sel.select(left)
        status = chan.exit_status if chan.status_event.is_set() else -1
        chan.close()
        return status, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")

    def _probe(self, host: _Host, t: paramiko.Transport) -> dict[str, Any]:
        """Check the remote Python and fiber-core; learn the CPU count and temp directory."""
        python = self.settings["python"] or "python3"
        workdir = self.settings["workdir"]
        command = f"exec {shlex.quote(python)} -c {shlex.quote(_PROBE)}"
        if workdir and not self.settings["upload"]:
            command += " " + shlex.quote(workdir)
        status, out, err = self._run(host, t, command)
        info = None
        for line in out.splitlines():
            if line.startswith("@fiber probe "):
                info = json.loads(line[len("@fiber probe "):])
        said = " ".join(err.strip().splitlines()[-3:])[-300:]
        if info is None:
            if status in (126, 127):
                why = "not found" if status == 127 else "not executable"
                raise BackendError(
                    f"Python {python!r} is {why} on {host.name} (the shell said: {said or 'nothing'}). "
                    "Set [ssh] python to the full path of a Python that has fiber-core installed"
                )
            raise BackendError(f"{python} failed on {host.name} (exit status {status}): {said or 'no output'}")
        if not info.get("new_enough"):
            raise BackendError(f"{python} on {host.name} is Python {info.get('python')}; fiber-core needs 3.10+")
        if "fiber_core_error" in info:
            raise BackendError(
                f"fiber-core is not installed for {python} on {host.name} ({info['fiber_core_error']}); "
                f"install it there: {install_elsewhere(python=python)}"
            )
        if info.get("workdir") is False:
            raise BackendError(f"the working directory {workdir!r} does not exist on {host.name}; "
                               "create it or fix [ssh] workdir")
        from fiber_core import __version__ as here

        if info.get("fiber_core") not in (here, "?"):
            log.warning("fiber-ssh: %s has fiber-core %s, this process %s", host.name,
                        info.get("fiber_core"), here)
        return info

    def _workdir(self, host: _Host) -> str | None:
        if self.settings["workdir"]:
            return self.settings["workdir"]
        if self.settings["upload"]:
            assert host.info is not None
            return f"{host.info['tmp']}/{upload_dir.fresh_name(self.run_id)}"
        return None

    # -- starting a job ---------------------------------------------------------------------

    def _channel(self, host: _Host) -> tuple[paramiko.Transport, paramiko.Channel]:
        """A new session channel to ``host``, on a shared connection (a new one if needed)."""
        import paramiko

        with host.lock:
            host.transports = [t for t in host.transports if t.is_active()]
            transports = list(host.transports)
        problem: Exception | None = None
        for t in reversed(transports):
            try:
                return t, t.open_session(timeout=self._timeout)
            except paramiko.ChannelException as e:  # sshd's MaxSessions: another connection
                problem = e
            except (paramiko.SSHException, OSError, EOFError) as e:
                problem = e
                t.close()
        if transports and not isinstance(problem, paramiko.ChannelException):
            raise _Unreachable(f"no new channel on the connection to {host.name}: {problem}")
        with host.lock:
            t = self._connect(host)
            host.transports.append(t)
        try:
            return t, t.open_session(timeout=self._timeout)
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise _Unreachable(f"{host.name} opens no channel: {e}") from e

    def _launch(self, host: _Host, placement: Placement, spec: JobSpec) -> Job:
        import paramiko

        if host.error is not None:
            raise host.error
        if self.settings["upload"] and not host.uploaded:
            self._upload(host)
        t, chan = self._channel(host)
        env = dict(spec.env)
        env[ENV_JOB_HOST] = host.hostname  # its jobs share one copy of a broadcast value there
        if placement.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, placement.gpus))
        job_line = base64.b64encode(marshal.dumps({  # see supervisor.py
            "argv": list(spec.command),
            "env": env,
            "cwd": spec.cwd or host.workdir,
            "orphan_timeout": self.settings["orphan_timeout"] or None,
        }, 4))
        python = self.settings["python"] or "python3"
        command = (f"exec {shlex.quote(python)} -I -S -c {shlex.quote(_SUPERVISOR)} "
                   f"fiber-ssh {shlex.quote(self.run_id or '-')}")
        try:
            chan.exec_command(command)
            chan.sendall(job_line + b"\n")
        except (paramiko.SSHException, OSError, EOFError) as e:
            chan.close()
            raise _Unreachable(f"{host.name} did not start the job: {e}") from e
        run = _Run(host=host, index=placement.index, placement=placement, transport=t, chan=chan)
        job = Job(id=f"{host.addr}#{next(self._count)}", spec=spec, handle=run, host=host.hostname)
        assert self._channels is not None
        self._channels.add(job)
        return job

    def _finish(self, job: Job, closing: bool = False) -> None:
        """Record how and why a job ended: once its channel closed, its exit code is in, or
        cleanup (``closing``) closes it."""
        run: _Run = job.handle
        with self._lock:
            if run.ended:
                return
            run.ended = True
            if self._slots and run.index < len(self._slots) and self._hosts[run.index] is run.host:
                release(self._slots, run.placement)
        host = run.host.name
        code, reason, detail = run.reported, None, ""
        if code is not None:
            if run.error:
                reason, detail = EndReason.NEVER_STARTED, f"{host}: {run.error}"
            elif run.oom and not job.state.stop_requested:
                reason, detail = EndReason.OOM, f"the kernel's out-of-memory killer ended the job on {host}"
        elif closing:
            code, reason, detail = LOST, EndReason.STOPPED, f"the connection to {host} was closed by cleanup()"
        elif not run.transport.is_active():
            why = f"the connection broke ({run.transport.get_exception() or 'closed'})"
            code, reason, detail = LOST, EndReason.HOST_LOST, f"lost {host}: {why}"
            self._lose(run.host, why)
        elif run.chan.status_event.is_set() and run.chan.exit_status >= 0:
            code = exitcode_from_status(run.chan.exit_status)
            detail = f"the job supervisor on {host} exited with status {code}"
            if run.pgid is None:  # it never said that the job runs
                reason = EndReason.NEVER_STARTED
        else:
            code, reason = LOST, EndReason.HOST_LOST
            detail = f"the channel to {host} closed without an exit status"
        if detail and not run.error:  # (the supervisor's own words are in the log already)
            text = job.state.log.text()
            job.state.log.append(("\n" if text and not text.endswith("\n") else "") + "fiber-ssh: " + detail)
        job.state.finish(code if code is not None else LOST, reason, detail)

    # -- upload ---------------------------------------------------------------------------

    def _upload(self, host: _Host) -> None:
        """Copy this process's working directory to the host's workdir (once per host)."""
        import paramiko

        with host.lock:
            if host.uploaded:
                return
            files = _upload_list(Path.cwd(), self.settings["upload_exclude"] or [])
            total = sum(size for _, _, size in files)
            limit = self.settings["upload_max_mb"] * 2**20
            if total > limit:
                raise BackendError(
                    f"the working directory {Path.cwd()} holds {total / 2**20:.1f} MiB to upload, over "
                    f"[ssh] upload_max_mb = {self.settings['upload_max_mb']:g}; exclude more "
                    "([ssh] upload_exclude) or raise the limit"
                )
            target = host.workdir
            assert target is not None
            t = next((x for x in host.transports if x.is_active()), None)
            if t is None:
                raise _Unreachable(f"no connection to {host.name} to upload over")
            try:
                sftp = paramiko.SFTPClient.from_transport(t)
                assert sftp is not None
                try:
                    home = sftp.normalize(".")
                    if not target.startswith("/"):
                        target = f"{home}/{target[2:] if target.startswith('~/') else target}"
                    if host.created_dir != target:  # (else this run made it, at an earlier try)
                        created = upload_dir.prepare(sftp, target, (host.info or {})["uid"],
                                                     bool(self.settings["workdir"]), host.name)
                        if created and not self.settings["workdir"]:
                            host.created_dir = target  # cleanup() removes it, even if the copy fails
                    for rel, path, _ in files:
                        remote = f"{target}/{rel}"
                        if path is None:
                            upload_dir.makedirs(sftp, remote)
                        else:
                            sftp.put(str(path), remote)
                            sftp.chmod(remote, stat.S_IMODE(path.stat().st_mode))
                finally:
                    sftp.close()
            except (paramiko.SSHException, OSError, EOFError) as e:
                raise BackendError(f"uploading {Path.cwd()} to {host.name}:{target} failed: check the "
                                   "space and permissions there, or [ssh] workdir", cause=e) from None
            host.workdir = target
            host.uploaded = True

    def _remove_upload(self, host: _Host) -> None:
        t = next((x for x in host.transports if x.is_active()), None)
        if t is None or not host.created_dir:
            return
        try:
            self._run(host, t, f"rm -rf -- {shlex.quote(host.created_dir)}")
        except Exception as e:
            log.warning("fiber-ssh: could not remove %s on %s: %s", host.created_dir, host.name, e)


class _Channels:
    """Reads every job's channel and sends the heartbeats, in the ``channels`` watcher.

    :meth:`follow` runs until :meth:`close`, then finishes the jobs it still follows;
    should it fail, the watcher runs it again and it takes up the same jobs.
    """

    def __init__(self, backend: SshBackend) -> None:
        self.backend = backend
        self.interval = max(0.1, float(backend.settings["keepalive"]))
        self.lock = threading.Lock()
        self.new: list[Job] = []
        self.jobs: set[Job] = set()  # only follow() touches it
        self.closed = False
        self._wake_w: socket.socket | None = None

    def add(self, job: Job) -> None:
        with self.lock:
            self.new.append(job)
            self._wake()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self._wake()

    def _wake(self) -> None:  # holding self.lock
        try:
            if self._wake_w is not None:
                self._wake_w.send(b"x")
        except OSError:
            pass

    def follow(self) -> float:
        wake_r, wake_w = socket.socketpair()
        wake_w.setblocking(False)
        with wake_r, wake_w, selectors.DefaultSelector() as sel:
            sel.register(wake_r, selectors.EVENT_READ, None)
            for job in self.jobs:
                sel.register(job.handle.chan, selectors.EVENT_READ, job)
            with self.lock:
                self._wake_w = wake_w
            try:
                self._loop(sel, wake_r)
            except Exception:
                log.exception("fiber-ssh: reading the jobs' channels failed (it starts again)")
                raise
            finally:
                with self.lock:
                    self._wake_w = None
            for job in list(self.jobs):
                self._read(sel, job)
                if job in self.jobs:
                    self._close(sel, job)
        return _IDLE

    def _loop(self, sel: selectors.BaseSelector, wake_r: socket.socket) -> None:
        next_beat = time.monotonic() + self.interval
        while True:
            with self.lock:
                new, self.new = self.new, []
            for job in new:
                self.jobs.add(job)
                sel.register(job.handle.chan, selectors.EVENT_READ, job)
                self._read(sel, job)
            if self.closed:
                return
            now = time.monotonic()
            for job in [j for j in self.jobs if j.handle.reported is not None
                        and now - j.handle.reported_at > _EXIT_GRACE]:
                self._close(sel, job)  # its exit code is in; something holds its output open
            if now >= next_beat:
                next_beat = now + self.interval
                for job in self.jobs:
                    if job.handle.chan.send_ready():
                        job.handle.send(b"h\n")
            timeout = next_beat - time.monotonic()
            if any(j.handle.reported is not None for j in self.jobs):
                timeout = min(timeout, _EXIT_GRACE / 4)
            for key, _ in sel.select(max(0.0, timeout)):
                if key.data is None:
                    wake_r.recv(4096)
                else:
                    self._read(sel, key.data)

    def _read(self, sel: selectors.BaseSelector, job: Job) -> None:
        if job not in self.jobs:
            return
        chan = job.handle.chan
        closed = chan.closed
        while chan.recv_ready():
            data = chan.recv(65536)
            if not data:
                break
            job.handle.feed_out(data)
        while chan.recv_stderr_ready():
            data = chan.recv_stderr(65536)
            if not data:
                break
            job.state.log.append(data)
        if closed:
            self._close(sel, job)

    def _close(self, sel: selectors.BaseSelector, job: Job) -> None:
        self.jobs.discard(job)
        try:
            sel.unregister(job.handle.chan)
        except (KeyError, ValueError):
            pass
        try:
            job.handle.chan.close()
        except Exception:
            pass
        self.backend._finish(job, self.closed)


# -- helpers ----------------------------------------------------------------------------


def _fingerprint(key: Any) -> str:
    fp = getattr(key, "fingerprint", None)
    if isinstance(fp, str):
        return fp
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def _excluded(name: str, rel: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(rel, p) for p in patterns)


def _upload_list(root: Path, exclude: list[str]) -> list[tuple[str, Path | None, int]]:
    """(relative path, local path or None for a directory, size) of what upload copies."""
    out: list[tuple[str, Path | None, int]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        base = Path(dirpath)
        rel_base = base.relative_to(root).as_posix()
        keep = []
        for d in sorted(dirnames):
            rel = d if rel_base == "." else f"{rel_base}/{d}"
            if not _excluded(d, rel, exclude) and not (base / d).is_symlink():
                keep.append(d)
                out.append((rel, None, 0))
        dirnames[:] = keep
        for f in sorted(filenames):
            rel = f if rel_base == "." else f"{rel_base}/{f}"
            path = base / f
            if _excluded(f, rel, exclude) or not path.is_file():
                continue
            out.append((rel, path, path.stat().st_size))
    return out
