"""Connections to the SSH hosts: resolving a host entry (``~/.ssh/config``), connecting with the
host key checked and a key login, probing the remote Python, and running one command. The
I/O edge of :mod:`fiber_ssh.backend`; paramiko is imported when a connection is made."""

from __future__ import annotations

import base64
import getpass
import hashlib
import json
import logging
import math
import os
import selectors
import shlex
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fiber_core.contract import BackendError, ConfigError, install_elsewhere, keepalive

from fiber_ssh import upload_dir
from fiber_ssh.hosts import HostSpec, parse_hosts

if TYPE_CHECKING:
    import paramiko

log = logging.getLogger("fiber")

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


class Unreachable(Exception):
    """The host did not answer (network, sshd down): it is lost, another may do."""


@dataclass(eq=False)
class Host:
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
    retry_at: float = 0.0
    """While lost: when it may be logged into again (at once, or ``retry_lost`` after a failed login)."""
    workdir: str | None = None
    uploaded: bool = False
    created_dir: str | None = None
    """A directory this run created there (the upload), removed by cleanup()."""

    @property
    def hostname(self) -> str:
        return (self.info or {}).get("hostname") or self.addr


class Connector:
    """Connects to hosts for one backend, with its settings; keeps the known hosts and keys it
    loaded. ``peer_timeout`` is read from the backend at each connection (Fiber sets it after
    the backend is made)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._known_lock = threading.Lock()
        self._known: tuple[paramiko.HostKeys, paramiko.HostKeys] | None = None
        self._pkeys: dict[str, Any] = {}

    @property
    def settings(self) -> Mapping[str, Any]:
        return self.backend.settings

    @property
    def timeout(self) -> float:
        """Seconds to connect, log in and run a command (``api_timeout``)."""
        return float(self.backend.api_timeout)

    @property
    def peer_timeout(self) -> float:
        return float(self.backend.peer_timeout)

    @property
    def run_id(self) -> str:
        return str(self.backend.run_id)

    def resolve(self, spec: HostSpec, ssh_config: Any) -> Host:
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
        return Host(spec=spec, addr=addr, port=port, user=user, key_files=keys, name=name)

    def load_hosts(self) -> list[Host]:
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
        return [self.resolve(s, ssh_config) for s in specs]

    def connect(self, host: Host) -> paramiko.Transport:
        import paramiko

        timeout = self.timeout
        try:
            sock = socket.create_connection((host.addr, host.port), timeout=timeout)
        except OSError as e:
            raise Unreachable(f"cannot connect to {host.addr} port {host.port}: {e}") from e
        self.tune(sock)
        t = paramiko.Transport(sock)
        t.banner_timeout = t.handshake_timeout = t.auth_timeout = timeout
        try:
            known = self.known_types(host)
            if known:
                options = t.get_security_options()
                options.key_types = [k for k in options.key_types if k in known] + [
                    k for k in options.key_types if k not in known]
            try:
                t.start_client(timeout=timeout)
            except (paramiko.SSHException, OSError, EOFError) as e:
                raise Unreachable(f"the SSH handshake with {host.name} failed: {e or type(e).__name__}") from e
            self.check_host_key(host, t.get_remote_server_key())
            self.authenticate(host, t)
            t.set_keepalive(self.settings["keepalive"])
            if host.info is None:
                host.info = self.probe(host, t)
                host.workdir = self.workdir(host)
            return t
        except BaseException:
            t.close()
            raise

    def tune(self, sock: socket.socket) -> None:
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

    # -- host keys and login ---------------------------------------------------------------

    def known_hosts(self) -> tuple[paramiko.HostKeys, paramiko.HostKeys]:
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
    def key_name(host: Host) -> str:
        return host.addr if host.port == 22 else f"[{host.addr}]:{host.port}"

    def known_types(self, host: Host) -> list[str]:
        out: list[str] = []
        for keys in self.known_hosts():
            entry = keys.lookup(self.key_name(host))
            if entry:
                out += [t for t in entry.keys() if t not in out]
        if "ssh-rsa" in out:
            out += ["rsa-sha2-512", "rsa-sha2-256"]
        return out

    def check_host_key(self, host: Host, key: paramiko.PKey) -> None:
        name, keytype = self.key_name(host), key.get_name()
        path = os.path.expanduser(self.settings["known_hosts"])
        shown = f"{keytype} {fingerprint(key)}"
        known = [k for keys in self.known_hosts() if (entry := keys.lookup(name)) for k in entry.values()]
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

    def keys(self, host: Host) -> Iterator[tuple[str, Any]]:
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

    def authenticate(self, host: Host, t: paramiko.Transport) -> None:
        import paramiko

        tried = []
        for desc, key in self.keys(host):
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
                raise Unreachable(f"the connection to {host.name} broke during login: {e}") from e
            if t.is_authenticated():
                return
        raise BackendError(
            f"{host.name} refused the login as {host.user!r} (tried: {', '.join(tried) or 'no key at all'}). "
            "Check the user ([ssh] user, or user@ in [ssh] hosts), the key ([ssh] key or ssh-agent), "
            f"and that the key is in ~{host.user}/.ssh/authorized_keys there"
        )

    # -- commands on a host -----------------------------------------------------------------

    def run(self, host: Host, t: paramiko.Transport, command: str) -> tuple[int, str, str]:
        """Run ``command`` and return (exit status, stdout, stderr), within ``timeout``."""
        import paramiko

        deadline = time.monotonic() + self.timeout
        try:
            chan = t.open_session(timeout=self.timeout)
            chan.exec_command(command)
            chan.shutdown_write()
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise Unreachable(f"{host.name} did not run a command: {e}") from e
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
                    raise Unreachable(f"{host.name} did not finish {command[:60]!r}... within "
                                       f"{self.timeout:g} s (see [ssh] api_timeout)")
                sel.select(left)
        status = chan.exit_status if chan.status_event.is_set() else -1
        chan.close()
        return status, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")

    def probe(self, host: Host, t: paramiko.Transport) -> dict[str, Any]:
        """Check the remote Python and fiber-core; learn the CPU count and temp directory."""
        python = self.settings["python"] or "python3"
        workdir = self.settings["workdir"]
        command = f"exec {shlex.quote(python)} -c {shlex.quote(_PROBE)}"
        if workdir and not self.settings["upload"]:
            command += " " + shlex.quote(workdir)
        status, out, err = self.run(host, t, command)
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

    def workdir(self, host: Host) -> str | None:
        if self.settings["workdir"]:
            return self.settings["workdir"]
        if self.settings["upload"]:
            assert host.info is not None
            return f"{host.info['tmp']}/{upload_dir.fresh_name(self.run_id)}"
        return None


def fingerprint(key: Any) -> str:
    fp = getattr(key, "fingerprint", None)
    if isinstance(fp, str):
        return fp
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")
