"""The ``fiber`` command: ``fiber backends``, ``fiber config``, ``fiber clean``, ``fiber top``, ``fiber run`` (on the
backends whose plugins launch programs), and the plugins' commands."""

from __future__ import annotations

import argparse
import functools
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from fiber_core.base.errors import FiberError, PluginError
from fiber_core.base.text import printable
from fiber_core.runtime.config import config, plugins, selected_backend_name

WIDTH = 100
"""The widest line the tables of ``fiber`` print."""

KNOWN_COMMANDS = {"run": (("fiber-k8s", "fiber-aws"), "run a program on Kubernetes or AWS Batch")}
"""Commands that the project's plugins add, by name: the distributions that add it and what
the command does."""

RUN_FALLBACK = "kubernetes"
"""The backend ``fiber run`` launches on when neither ``--backend`` nor the configured backend
names one a plugin launches on (the first backend ``fiber run`` had)."""


def _table(rows: Sequence[Sequence[str]], wrap: int | None = None) -> str:
    """``rows`` in columns two spaces apart. Column ``wrap``, and the last one if it must, are
    wrapped so that a line fits in :data:`WIDTH`; a cell's continuation lines stay in its column."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    over = sum(widths) + 2 * (len(widths) - 1) - WIDTH
    if wrap is not None and over > 0:
        # The wrapped column keeps at least 30 characters; beyond that the last column gives way.
        give = min(over, max(widths[wrap] - 30, 0))
        widths[wrap] -= give
        if over > give and wrap != len(widths) - 1:
            widths[-1] = max(widths[-1] - (over - give), 20)
    last = len(widths) - 1
    out = []
    for row in rows:
        cells = [(textwrap.wrap(c, widths[i], break_on_hyphens=False) or [""]) if i in (wrap, last) else [c]
                 for i, c in enumerate(row)]
        for k in range(max(len(c) for c in cells)):
            parts = [(c[k] if k < len(c) else "").ljust(w) for c, w in zip(cells, widths)]
            out.append("  ".join(parts).rstrip())
    return "\n".join(out)


def _backends(args: argparse.Namespace) -> int:
    rows = [("NAME", "ALIASES", "PACKAGE", "VERSION")]
    for info in plugins().backends():
        rows.append((info.name, ",".join(info.aliases) or "-", info.package, info.version))
    print(_table(rows))
    absent = plugins().absent()
    if absent:
        print("\nFiber's other backends, not available here:")
        print(_table([("NAME", "PACKAGE", "TO GET IT"), *((a.name, a.package, a.advice) for a in absent)]))
    return 0


def _config(args: argparse.Namespace) -> int:
    plugins().backends()  # loads plugins, so their options are known
    config.check_file()
    print(f"backend in use: {selected_backend_name()}")
    print(_table([("KEY", "VALUE", "SOURCE"), *config.describe()], wrap=1))
    return 0


def _clean(args: argparse.Namespace) -> int:
    name = selected_backend_name(args.backend)
    cls = plugins().get_class(name)
    removed = cls.clean(config.backend_settings(cls.settings_section()), args.run)
    for item in removed:
        print(f"removed {item}")
    print(f"{len(removed)} leftover(s) of {'run ' + args.run if args.run else 'fiber runs'} removed from {name}")
    return 0


def _top(args: argparse.Namespace) -> int:
    from fiber_core.runtime.status import find_runs  # the live view: only for this command
    from fiber_core.runtime.top import top

    if args.list:
        runs = find_runs()
        if not runs:
            print("no running program of yours shows its state")
            return 0
        print(_table([("RUN", "PID", "PROGRAM", "STARTED", "PAGE"),
                      *((printable(r.run_id), str(r.pid), printable(r.program), _when(r.started),
                         "yes" if r.page else "-")
                        for r in runs)]))
        return 0
    if args.interval <= 0:
        raise FiberError(f"--interval must be above 0 seconds, not {args.interval:g}")
    return top(args.run, interval=args.interval, once=args.once)


def _when(timestamp: float) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


def run_launchers() -> dict[str, Callable[[argparse.ArgumentParser], None]]:
    """The plugins' launchers of ``fiber run``, by backend name (``fiber_run_launchers``)."""
    out: dict[str, Callable[[argparse.ArgumentParser], None]] = {}
    for answer in plugins().pm.hook.fiber_run_launchers():
        for name, add_options in (answer or {}).items():
            if name in out:
                raise PluginError(f"two plugins launch `fiber run` on backend {name!r}: uninstall one")
            out[name] = add_options
    return out


def run_backend(argv: Sequence[str], launchers: Mapping[str, object]) -> str:
    """The backend ``fiber run ARGV`` launches on, as far as can be told before its options are
    parsed: a leading ``--backend NAME``, else the configured backend if a plugin launches on
    it, else :data:`RUN_FALLBACK` if one does, else the only one launched on."""
    if argv and argv[0] == "--backend" and len(argv) > 1:
        return argv[1]
    if argv and argv[0].startswith("--backend="):
        return argv[0].partition("=")[2]
    configured = selected_backend_name()
    if configured in launchers:
        return configured
    if RUN_FALLBACK in launchers or len(launchers) != 1:
        return RUN_FALLBACK
    return next(iter(launchers))


class _Trial(argparse.ArgumentParser):
    """A parser whose errors are exceptions: the arguments may be another launcher's."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def _run_parser(name: str, launchers: Mapping[str, Callable[[argparse.ArgumentParser], None]],
                kind: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The parser of ``fiber run`` on backend ``name`` (a name or an alias)."""
    canonical = plugins().canonical(name)  # an unknown name: the registry's error, with what to install
    if canonical not in launchers:
        raise FiberError(f"fiber run launches programs on {' or '.join(sorted(launchers))}, not on "
                         f"{canonical!r}: give --backend {' or --backend '.join(sorted(launchers))}, or run "
                         f"the program directly there: FIBER_BACKEND={canonical} CMD")
    parser = kind(prog="fiber run", formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default=canonical,
                        help=f"where the program runs: {', '.join(sorted(launchers))} (default: the configured "
                             f"backend if it is one of these, else {RUN_FALLBACK})")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD...", help="the command to run")
    launchers[canonical](parser)
    return parser


def _run(argv: Sequence[str]) -> int:
    """``fiber run``: the arguments are parsed by the parser of the backend they launch on.

    A ``--backend`` after other options is known only once they are parsed: the launchers are
    tried in turn (the one :func:`run_backend` names first), and the first whose parser takes
    every option and whose ``--backend`` names it wins; with none, the first one's parser says
    what is wrong."""
    launchers = run_launchers()
    first = plugins().canonical(run_backend(argv, launchers))
    for name in [first, *sorted(set(launchers) - {first})]:
        try:
            args, extra = _run_parser(name, launchers, _Trial).parse_known_args(argv)
        except ValueError:
            continue
        if not extra and plugins().canonical(args.backend) == name:
            break
    else:
        args = _run_parser(first, launchers).parse_args(argv)
        args = _run_parser(args.backend, launchers).parse_args(argv)
    if not args.cmd:
        raise FiberError("fiber run: give the command to run, e.g. fiber run --image IMG python app.py")
    return args.func(args)


def _missing_command(command: str, packages: Sequence[str], args: argparse.Namespace) -> int:
    names = " or ".join(packages)
    ways = "; or ".join(plugins().advice(package) for package in packages)
    which = "which is" if len(packages) == 1 else "neither of which is"
    print(f"fiber: error: `fiber {command}` comes with {names}, {which} available here: {ways}",
          file=sys.stderr)
    return 2


def _epilog() -> str:
    installed = ", ".join(info.name for info in plugins().backends())
    lines = [f"backends installed: {installed}"]
    absent = plugins().absent()
    if absent:
        names = ", ".join(a.name for a in absent)
        lines.append(f"other backends: {names} (`fiber backends` says how to install each)")
    return "\n".join(textwrap.fill(line, WIDTH, subsequent_indent="  ") for line in lines)


def main(argv: list[str] | None = None) -> int:
    plugins().backends()  # load plugins: they may add subcommands
    parser = argparse.ArgumentParser(prog="fiber", description="Fiber: multiprocessing on clusters.",
                                     epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("backends", help="list the installed backends, and how to install the others"
                   ).set_defaults(func=_backends)
    sub.add_parser("config", help="show the effective configuration and its sources").set_defaults(func=_config)
    clean = sub.add_parser("clean", help="remove jobs that crashed runs left behind")
    clean.add_argument("--backend", help="backend to clean (default: the configured one)")
    clean.add_argument("--run", help="only this run id")
    clean.set_defaults(func=_clean)
    top = sub.add_parser(
        "top", help="show a running program's pools, workers and tasks (it must show its state: "
        "FIBER_STATUS=1)", description="Show the pools, workers and tasks of a running program of "
        "yours that shows its state (FIBER_STATUS=1, fiber_core.init(status=True) or "
        "fiber_core.serve_status()), refreshed until q. It finds the program through a private "
        "file in its run directory, in the temporary directory (TMPDIR) it shares with this command.")
    top.add_argument("run", nargs="?", help="the run id, or its beginning (default: the newest run)")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    top.add_argument("--once", action="store_true", help="print the state once, as plain text")
    top.add_argument("--list", action="store_true", help="list the runs that show their state")
    top.set_defaults(func=_top)

    plugins().pm.hook.fiber_add_commands(subparsers=sub)
    try:
        launchers = run_launchers()
    except PluginError as e:
        print(f"fiber: error: {e}", file=sys.stderr)
        return 2
    if launchers:  # its options depend on the backend it launches on: parsed by _run
        sub.add_parser("run", add_help=False, help="run a program as a job of a backend, its processes as "
                       f"jobs beside it (backends: {', '.join(sorted(launchers))})")
        argv = sys.argv[1:] if argv is None else argv
        if argv[:1] == ["run"]:
            return _handle(_run, argv[1:])
    for command, (packages, what) in KNOWN_COMMANDS.items():
        if command not in sub.choices:  # its plugin is missing: say so, whatever the arguments
            stub = sub.add_parser(command, add_help=False, help=f"{what} (needs {' or '.join(packages)})")
            stub.set_defaults(func=functools.partial(_missing_command, command, packages), takes_any=True)
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_any", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return _handle(args.func, args)


def _handle(func: Callable[[Any], int], arg: Any) -> int:
    """``func(arg)``, a command; a FiberError it raises is its one line on stderr, status 2."""
    try:
        return func(arg)
    except FiberError as e:
        print(f"fiber: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
