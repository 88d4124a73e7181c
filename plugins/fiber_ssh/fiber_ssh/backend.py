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
``HOST_LOST`` (``PREEMPTED`` for a host labelled ``capacity=spot``: a spot machine taken
back); what Fiber stopped is ``STOPPED``.

A host that stops answering (keepalives every ``keepalive`` seconds, and the kernel
gives up on the connection after ``keepalive_count`` of them go unanswered, or after
``peer_timeout`` if that is shorter) is *lost*: its jobs end with
:data:`~fiber_core.contract.HOST_LOST_EXITCODE` (``-1``, SIGHUP: the line to them hung up),
placement skips it, and a watcher tries it again every
``retry_lost`` seconds. Its supervisors, cut off from the parent, kill their jobs after
``orphan_timeout`` seconds without a heartbeat.

The parts: :mod:`fiber_ssh.connect` (connections, host keys, login, the probe),
:mod:`fiber_ssh.channels` (reading the jobs' channels), :mod:`fiber_ssh.upload`, and the pure
:mod:`fiber_ssh.spec` (the job line) and :mod:`fiber_ssh.status` (why a job ended).
paramiko is imported when a backend is created, never when the plugin is loaded.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import socket
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from fiber_core.contract import (
    ENV_OPTIONS,
    HOST_LOST_EXITCODE,
    TIMEOUT_ALIAS,
    Alternative,
    Backend,
    BackendError,
    EndReason,
    Job,
    JobSpec,
    Option,
    Watcher,
    gpu_count,
    resources_env,
)

from fiber_ssh.channels import IDLE, Channels, Run
from fiber_ssh.connect import Connector, Host, Unreachable
from fiber_ssh.hosts import Placement, Slots, crowding, place, place_alternative, release
from fiber_ssh.spec import job_env, job_line, supervisor_command
from fiber_ssh.status import Seen, job_end
from fiber_ssh.upload import DEFAULT_EXCLUDE, remove_upload, upload

if TYPE_CHECKING:
    import paramiko

log = logging.getLogger("fiber")

OPTIONS: tuple[Option, ...] = (
    Option("hosts", str, None,
           "hosts that run the jobs, comma- or space-separated: "
           "[user@]host[:port][*slots][[gpu=N,gpu_type=T,cost=C,capacity=spot|on-demand]]"),
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
    Option("api_timeout", float, 15.0,
           "seconds to connect, log in and run the first command on a host before it counts as unreachable"),
    TIMEOUT_ALIAS,
    Option("keepalive", float, 1.0, "seconds between keepalives on each connection, and heartbeats to each job"),
    Option("keepalive_count", int, 3, "a host whose connection stays unanswered for keepalive x (1 + "
           "keepalive_count) seconds is lost: about 5 s after a cut by default (the global peer_timeout, if "
           "shorter, wins)"),
    Option("retry_lost", float, 60.0, "a lost host is probed every keepalive seconds (a TCP connection to its "
           "sshd) and logged into as soon as it answers; after a failed login, not again for this many "
           "seconds (0: a lost host is never tried again)"),
    Option("orphan_timeout", float, 30.0,
           "seconds a remote job lives on without a heartbeat from this process (0: forever)"),
    *ENV_OPTIONS,  # the whole environment travels on the supervisor's stdin, secrets or not
)

def _answers(host: Host, timeout: float) -> bool:
    """Whether ``host``'s sshd accepts a TCP connection within ``timeout`` seconds."""
    try:
        socket.create_connection((host.addr, host.port), timeout=timeout).close()
        return True
    except OSError:
        return False


class SshBackend(Backend):
    """Jobs are processes on SSH hosts: one connection per host, one channel per job."""

    name = "ssh"
    package = "fiber-ssh"
    options = OPTIONS
    gpu_alternatives = True  # the first alternative with free room on a host (hosts.place_alternative)
    capacity_kinds = True  # hosts labelled capacity=spot or on-demand (hosts.place_alternative)
    renamed_options = {"timeout": "api_timeout"}
    create_concurrency = 16  # a group start opens channels on several hosts at once
    spare_jobs = 1  # an idle worker holds one slot of a host

    def __init__(self, settings: Mapping[str, Any] | None = None, run_id: str = "",
                 rundir: str | None = None) -> None:
        super().__init__(settings, run_id, rundir)
        import paramiko  # noqa: F401  (fail here, clearly, if it is missing)

        self._lock = threading.RLock()
        self._hosts: list[Host] = []
        self._slots: list[Slots] = []
        self._start_lock = threading.Lock()
        self._channels: Channels | None = None
        self._reviver: Watcher | None = None
        self._count = itertools.count(1)
        self._conn = Connector(self)
        self._warned_full = False
        self._listen_addr: str | None = None

    def worker_command(self) -> list[str]:
        return [self.settings["python"] or "python3"]

    # -- the contract -------------------------------------------------------------------

    def get_listen_addr(self) -> str:
        """This machine's address on the route to the first host (what the hosts can reach)."""
        if self._listen_addr is not None:
            return self._listen_addr
        host = self._conn.load_hosts()[0]
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
                    placement, placed = self._place(spec)
                except BackendError as e:
                    raise BackendError(f"{e}{self._lost_summary()}") from None
                self._warn_if_full(placement)
            host = self._hosts[placement.index]
            try:
                return self._launch(host, placement, placed)
            except Unreachable as e:
                with self._lock:
                    release(self._slots, placement)
                self._lose(host, str(e))
            except BaseException:
                with self._lock:
                    release(self._slots, placement)
                raise
        raise BackendError(f"could not start {spec.name} on any SSH host{self._lost_summary()}")

    def _place(self, spec: JobSpec) -> tuple[Placement, JobSpec]:
        """Where ``spec`` runs (under the lock), and what runs there: the spec of the GPU
        alternative chosen, its environment saying what the job got (the host's cost too)."""
        if spec.alternatives:
            placement, alt = place_alternative(self._slots, spec.cpu, spec.alternatives, gpu_count(spec) or 0)
            return placement, spec.choosing(alt, cost_per_hour=self._slots[placement.index].cost)
        placement = place(self._slots, spec.cpu, gpu_count(spec), None)
        cost = self._slots[placement.index].cost  # the host's label, else the prices setting's
        got = resources_env(None, gpu=len(placement.gpus), cost_per_hour=spec.costs.get(Alternative()) if cost is None
                            else cost)
        return placement, dataclasses.replace(spec, env={**spec.env, **got})

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
        deadline = time.monotonic() + max(5.0, self.api_timeout)
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
                list(pool.map(lambda h: remove_upload(self._conn, h), dirs))
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
            hosts = self._conn.load_hosts()
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
                slots.append(Slots(h.name, n, h.spec.gpu, h.spec.gpu_type, alive=reason is None, cost=h.spec.cost,
                                   capacity=h.spec.capacity))
                if reason is not None:
                    h.lost_reason, h.lost_at = reason, time.monotonic()
                    log.warning("fiber-ssh: host %s is unreachable: %s", h.name, reason)
            with self._lock:
                self._slots = slots
            self._hosts = hosts
            self._channels = Channels(self.settings["keepalive"], self._finish)
            self.watch(self._channels.follow, "channels", max_backoff=5.0)
            retry = self.settings["retry_lost"]
            if retry:
                self._reviver = self.watch(self._revive_lost, "revive", interval=self.settings["keepalive"],
                                           max_backoff=retry)

    def _first_connect(self, host: Host) -> str | None:
        """Connect, check and probe one host; return why it is unreachable, or None."""
        try:
            t = self._conn.connect(host)
        except Unreachable as e:
            return str(e)
        except BackendError as e:
            host.error = e
            return None
        host.transports.append(t)
        return None

    def _lose(self, host: Host, reason: str) -> None:
        """Mark a host lost: placement skips it until the reviver reconnects."""
        index = self._hosts.index(host) if host in self._hosts else -1
        with self._lock:
            if index < 0 or not self._slots[index].alive:
                return
            self._slots[index].alive = False
            host.lost_reason, host.lost_at = reason, time.monotonic()
            host.retry_at = host.lost_at  # logged into again as soon as it answers
        log.warning("fiber-ssh: lost host %s (%s); its jobs end with %d", host.name, reason, HOST_LOST_EXITCODE)
        if self._reviver is not None:
            self._reviver.wake()  # to wait for this host's retry time

    def _revive_lost(self) -> float:
        """One round of the reviver: probe the lost hosts, log in again to those that answer.

        A probe is a TCP connection to the host's sshd, every ``keepalive`` seconds, so a host
        that answers again is back within about that; a host that answers but where logging
        in fails is not logged into again for ``retry_lost`` seconds. Returns the seconds
        until the next round (a loss wakes it sooner).
        """
        step = max(0.2, float(self.settings["keepalive"]))
        with self._lock:
            lost = [(i, h) for i, (h, s) in enumerate(zip(self._hosts, self._slots)) if not s.alive]
        if not lost:
            return IDLE
        with ThreadPoolExecutor(len(lost)) as pool:
            answers = list(pool.map(lambda ih: _answers(ih[1], min(step, 1.0)), lost))
        now = time.monotonic()
        due = [(i, h) for (i, h), up in zip(lost, answers) if up and now >= h.retry_at]
        if due:
            with ThreadPoolExecutor(len(due)) as pool:
                list(pool.map(lambda ih: self._revive(*ih), due))
        return step

    def _revive(self, index: int, host: Host) -> None:
        try:
            t = self._conn.connect(host)
        except (Unreachable, BackendError) as e:
            with self._lock:
                host.lost_reason = str(e)
                host.retry_at = time.monotonic() + self.settings["retry_lost"]
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
        self._warned_full = False  # crowded again later: say so again
        log.warning("fiber-ssh: host %s is back after %.1f s", host.name, time.monotonic() - host.lost_at)

    def crowded_jobs(self) -> list[Job]:
        """The jobs that run over a host's slots while another live host has free ones
        (:func:`~fiber_ssh.hosts.crowding`): after a lost host is back, a Pool moves them there."""
        with self._lock:
            jobs = [j for j in self.jobs if isinstance(j.handle, Run) and not j.handle.ended
                    and j.handle.index < len(self._hosts) and self._hosts[j.handle.index] is j.handle.host]
            return [jobs[n] for n in crowding(self._slots, [j.handle.placement for j in jobs])]

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

    # -- starting a job ---------------------------------------------------------------------

    def _channel(self, host: Host) -> tuple[paramiko.Transport, paramiko.Channel]:
        """A new session channel to ``host``, on a shared connection (a new one if needed)."""
        import paramiko

        with host.lock:
            host.transports = [t for t in host.transports if t.is_active()]
            transports = list(host.transports)
        problem: Exception | None = None
        for t in reversed(transports):
            try:
                return t, t.open_session(timeout=self.api_timeout)
            except paramiko.ChannelException as e:  # sshd's MaxSessions: another connection
                problem = e
            except (paramiko.SSHException, OSError, EOFError) as e:
                problem = e
                t.close()
        if transports and not isinstance(problem, paramiko.ChannelException):
            raise Unreachable(f"no new channel on the connection to {host.name}: {problem}")
        with host.lock:
            t = self._conn.connect(host)
            host.transports.append(t)
        try:
            return t, t.open_session(timeout=self.api_timeout)
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise Unreachable(f"{host.name} opens no channel: {e}") from e

    def _launch(self, host: Host, placement: Placement, spec: JobSpec) -> Job:
        import paramiko

        if host.error is not None:
            raise host.error
        if self.settings["upload"] and not host.uploaded:
            upload(self._conn, host)
        t, chan = self._channel(host)
        env = job_env(self.job_env(spec), host.hostname, placement.gpus)
        line = job_line(spec.command, env, spec.cwd or host.workdir, self.settings["orphan_timeout"])
        try:
            chan.exec_command(supervisor_command(self.settings["python"] or "python3", self.run_id))
            chan.sendall(line)
        except (paramiko.SSHException, OSError, EOFError) as e:
            chan.close()
            raise Unreachable(f"{host.name} did not start the job: {e}") from e
        run = Run(host=host, index=placement.index, placement=placement, transport=t, chan=chan)
        job = Job(id=f"{host.addr}#{next(self._count)}", spec=spec, handle=run, host=host.hostname)
        assert self._channels is not None
        self._channels.add(job)
        return job

    def _finish(self, job: Job, closing: bool = False) -> None:
        """Record how and why a job ended: once its channel closed, its exit code is in, or
        cleanup (``closing``) closes it."""
        run: Run = job.handle
        with self._lock:
            if run.ended:
                return
            run.ended = True
            if self._slots and run.index < len(self._slots) and self._hosts[run.index] is run.host:
                release(self._slots, run.placement)
        seen = Seen(host=run.host.name, reported=run.reported, error=run.error, oom=run.oom, killed=run.killed,
                    started=run.pgid is not None, stop_requested=job.state.stop_requested, closing=closing,
                    connected=run.transport.is_active(), broke=str(run.transport.get_exception() or "closed"),
                    spot=run.host.spec.capacity == "spot",
                    exit_status=run.chan.exit_status if run.chan.status_event.is_set() else None)
        code, reason, detail = job_end(seen)
        if reason in (EndReason.HOST_LOST, EndReason.PREEMPTED) and not seen.connected and not closing:
            self._lose(run.host, f"the connection broke ({seen.broke})")
        if detail and not run.error:  # (the supervisor's own words are in the log already)
            text = job.state.log.text()
            job.state.log.append(("\n" if text and not text.endswith("\n") else "") + "fiber-ssh: " + detail)
        job.state.finish(code, reason, detail)
