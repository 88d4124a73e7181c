"""The ``fiber`` command: ``fiber backends``, ``fiber config``, ``fiber clean``."""

from __future__ import annotations

import argparse
import sys

from fiber_core.base.errors import FiberError
from fiber_core.runtime.config import config, plugins, selected_backend_name


def _backends(args: argparse.Namespace) -> int:

    rows = [("NAME", "ALIASES", "PACKAGE", "VERSION")]
    for info in plugins().backends():
        rows.append((info.name, ",".join(info.aliases) or "-", info.package, info.version))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def _config(args: argparse.Namespace) -> int:

    plugins().backends()  # loads plugins, so their options are known
    config.check_file()
    print(f"backend in use: {selected_backend_name()}")
    rows = [("KEY", "VALUE", "SOURCE"), *config.describe()]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def _clean(args: argparse.Namespace) -> int:

    name = selected_backend_name(args.backend)
    cls = plugins().get_class(name)
    removed = cls.clean(config.backend_settings(cls.settings_section()), args.run)
    for item in removed:
        print(f"removed {item}")
    print(f"{len(removed)} leftover(s) of {'run ' + args.run if args.run else 'fiber runs'} removed from {name}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fiber", description="Fiber: multiprocessing on clusters.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("backends", help="list installed backends").set_defaults(func=_backends)
    sub.add_parser("config", help="show the effective configuration and its sources").set_defaults(func=_config)
    clean = sub.add_parser("clean", help="remove jobs that crashed runs left behind")
    clean.add_argument("--backend", help="backend to clean (default: the configured one)")
    clean.add_argument("--run", help="only this run id")
    clean.set_defaults(func=_clean)

    plugins().backends()  # load plugins: they may add subcommands
    plugins().pm.hook.fiber_add_commands(subparsers=sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except FiberError as e:
        print(f"fiber: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
