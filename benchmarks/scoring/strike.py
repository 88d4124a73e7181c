"""Fires a scorecard cell's fault schedule: signals as ``tests/chaos.py`` sends them, and the
faults beyond signals (partitions and packet loss on the SSH test hosts, an API restart).

A partition or a loss is an ``iptables`` rule in the hosts' network namespaces matched on
the run's hub port only, made by fiber-ssh's fault tests' own ``Rules``
(``plugins/fiber_ssh/tests/test_ssh_faults.py``), so other runs on the shared test hosts see
nothing. An API restart is the backend's :class:`~fiber_core.testing.outage.Outage` cut,
then restored. Every rule is removed and the API restored when the cell's run ends.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from scoring.backends import ROOT, netns_of, ssh_tests
from scoring.kinds import HEAL_SECONDS, LOSS_PROBABILITY, RESTART_SECONDS


@functools.cache
def load_chaos() -> Any:
    """``tests/chaos.py``, the one thing that fires a schedule (loaded by path: the name
    ``chaos`` is also ``benchmarks/chaos.py``)."""
    spec = importlib.util.spec_from_file_location("tests_chaos", ROOT / "tests" / "chaos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["tests_chaos"] = module
    spec.loader.exec_module(module)
    return module


class Network:
    """The SSH test hosts' links to this run's hub: partitions and loss, undone by :meth:`close`."""

    def __init__(self) -> None:
        ssh_tests()
        from test_ssh import ENV_FILE
        from test_ssh_faults import Rules, hub_port

        from fiber_core.runtime.run import runtime
        from scoring.backends import read_env

        facts = read_env(ENV_FILE)
        self.addresses = dict(zip(facts["FIBER_SSH_HOSTNAMES"].split(), facts["FIBER_SSH_HOSTS"].split()))
        self.port = hub_port(runtime())
        self._rules = Rules
        self._lock = threading.Lock()
        self._added: list[Any] = []

    def _new(self) -> Any:
        rules = self._rules()
        with self._lock:
            self._added.append(rules)
        return rules

    def partition(self, host: str) -> Callable[[], None]:
        """Drops every packet between ``host`` and the hub; returns what heals it."""
        rules = self._new()
        rules.partition(host, self.port)

        def heal() -> None:
            with self._lock:
                rules.clear()
        return heal

    def lossy(self) -> None:
        rules = self._new()
        for host, address in self.addresses.items():
            rules.lossy(host, address, self.port, LOSS_PROBABILITY)

    def close(self) -> None:
        with self._lock:
            for rules in self._added:
                rules.clear()
            self._added = []


class Striker:
    """Strikes as ``schedule`` says while ``progress`` counts results: ``with Striker(...):``.

    ``candidates`` lists the pids of the workers to strike, in a stable order; ``network``
    (SSH hosts) and ``api`` (an Outage) are there where the backend has them.
    """

    def __init__(self, progress: Any, schedule: Any, candidates: Callable[[], list[int]],
                 network: Network | None = None, api: Any = None) -> None:
        chaos = load_chaos()
        self._signals = chaos.SIGNALS
        self._poll = chaos.POLL_SECONDS
        self.progress, self.schedule, self.candidates = progress, schedule, candidates
        self.network, self.api = network, api
        self.struck: list[tuple[int, str, int | str]] = []  # (after, kind, pid or host)
        self._stop = threading.Event()
        self._timers: list[threading.Timer] = []
        self._thread = threading.Thread(target=self._run, daemon=True, name="scorecard-striker")

    def __enter__(self) -> Striker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        for timer in self._timers:
            timer.cancel()
        if self.network is not None:
            self.network.close()
        if self.api is not None:
            self.api.restore()

    def _run(self) -> None:
        while self.schedule.left and not self._stop.wait(self._poll):
            for fault in self.schedule.due(self.progress._tasks_done):
                what = self.strike(fault.kind, fault.worker)
                if what is not None:
                    self.struck.append((fault.after, fault.kind, what))

    def _later(self, seconds: float, action: Callable[[], None]) -> None:
        timer = threading.Timer(seconds, action)
        timer.daemon = True
        self._timers.append(timer)
        timer.start()

    def strike(self, kind: str, worker: int) -> int | str | None:
        """One fault; what it struck (a pid, a host, ``api``), or None where there was nothing."""
        if kind == "restart":  # and a worker lost meanwhile: its replacement needs the API
            self.api.cut()
            self._later(RESTART_SECONDS, self.api.restore)
            return f"api, {self.strike('kill', worker)}"
        if kind == "loss":
            assert self.network is not None
            self.network.lossy()
            return "every host"
        pids = self.candidates()
        if not pids:
            return None
        pid = pids[worker % len(pids)]
        if kind in self._signals:
            try:
                os.kill(pid, self._signals[kind])
            except ProcessLookupError:
                return None
            return pid
        host = netns_of(pid)
        if host is None or self.network is None:
            return None
        heal = self.network.partition(host)
        if kind == "heal":
            self._later(HEAL_SECONDS, heal)
        return host
