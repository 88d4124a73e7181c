"""Generated parts of Fiber's docs: settings tables from the options, benchmark plots (Sphinx extension and script).

Every settings table in the Markdown sources (the plugin READMEs, ``docs/backends/``) sits
between ``<!-- settings:SECTION -->`` and ``<!-- /settings -->`` and is generated from the
:class:`~fiber_core.base.options.Option` declarations, through the same configuration
machinery that ``fiber config`` reads (:mod:`fiber_core.runtime.config`). Nobody writes one
by hand: ``python docs/_ext/fiber_docs.py`` rewrites them all, ``--check`` says which are
stale, and the docs build fails on a stale one (a warning, and warnings are errors there).

As an extension it also draws the benchmark plots (``benchmarks/plot.py``) from the tables of
the pages into ``docs/_generated/plots`` before the pages are read.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PLOTS = DOCS / "_generated" / "plots"

BLOCK = re.compile(
    r"(?P<open><!-- settings:(?P<section>[\w-]+) -->\n)(?P<body>.*?)(?P<close><!-- /settings -->)",
    re.S,
)
REGENERATE = "python docs/_ext/fiber_docs.py"


def sources() -> list[Path]:
    """The Markdown files that may hold settings tables."""
    return sorted([*DOCS.rglob("*.md"), *ROOT.glob("plugins/*/README.md")])


def _escape(text: str) -> str:
    # Help strings are plain text: nothing in them is Markdown or HTML.
    return re.sub(r"([\\`*<>|\[\]])", r"\\\1", text)


def _default(value: Any) -> str:
    if value is None or value == [] or value == "":
        return ""
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, list):
        return "`" + ",".join(map(str, value)) + "`"
    return f"`{value}`"


def settings_table(section: str) -> str:
    """The Markdown table of every option of ``section`` (``fiber`` or a backend's section)."""
    from fiber_core.runtime.config import config, env_variable, plugins

    plugins().backends()  # loads the installed plugins: their options become known
    options = config.options(section)
    if not options:
        known = ", ".join(config.sections())
        raise LookupError(f"no options in section [{section}]: is its plugin installed? known: {known}")
    rows = ["| key | variable | type | default | meaning |", "| --- | --- | --- | --- | --- |"]
    for o in options:
        meaning = _escape(o.help)
        if o.choices:
            meaning += "; one of " + ", ".join(f"`{c}`" for c in o.choices)
        if o.secret:
            meaning += " (secret: `fiber config` masks it)"
        rows.append(f"| `{o.name}` | `{env_variable(o.name, section)}` | {o.type.__name__} "
                    f"| {_default(o.default)} | {meaning} |")
    return "\n".join(rows) + "\n"


def stale_blocks(paths: list[Path] | None = None) -> list[tuple[Path, str]]:
    """(file, section) of every settings table that differs from what the options say."""
    out = []
    for path in paths if paths is not None else sources():
        for m in BLOCK.finditer(path.read_text(encoding="utf-8")):
            if m["body"] != settings_table(m["section"]):
                out.append((path, m["section"]))
    return out


def write_blocks(paths: list[Path] | None = None) -> list[Path]:
    """Regenerate every settings table; returns the files that changed."""
    changed = []
    for path in paths if paths is not None else sources():
        text = path.read_text(encoding="utf-8")
        new = BLOCK.sub(lambda m: m["open"] + settings_table(m["section"]) + m["close"], text)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(path)
    return changed


def draw_plots(out: Path = PLOTS) -> list[Path]:
    """The PNG plots of the benchmark tables, drawn by ``benchmarks/plot.py``."""
    spec = importlib.util.spec_from_file_location("fiber_benchmark_plots", ROOT / "benchmarks" / "plot.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    written: list[Path] = module.draw_all(out)
    return written


LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s#]+)(?P<anchor>#[^)\s]*)?\)")


def site_links(text: str, source: Path) -> str:
    """The Markdown links of ``source`` (a page, or a file a page includes), as the site needs them.

    The files link each other by relative path, as GitHub shows them. On the site, a link to a
    page becomes a path from the docs' root (an included file's links would otherwise be taken
    from the including page), the root README is the site's front page, a link to a Python module
    points at its API page (``{py:mod}``), and a link to any other file of the repository keeps
    its text only: the site does not carry the file.
    """

    def one(m: re.Match[str]) -> str:
        target, anchor, label = m["target"], m["anchor"] or "", m["text"]
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
            return m[0]
        path = (source.parent / target).resolve()
        if path == ROOT / "README.md":
            return f"[{label}](/index.md{anchor})"
        if path.suffix == ".md" and path.is_relative_to(DOCS):
            return f"[{label}](/{path.relative_to(DOCS).as_posix()}{anchor})"
        if path.suffix == ".py" and path.is_relative_to(ROOT):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[0] == "plugins":
                parts = parts[2:]
            module = ".".join(p for p in parts if p != "__init__")
            return f"{{py:mod}}`{label.replace('`', '')} <{module}>`"
        return label

    return LINK.sub(one, text)


# -- Sphinx --------------------------------------------------------------------------------------


def _source_read(app: Any, docname: str, content: list[str]) -> None:
    content[0] = site_links(content[0], Path(app.srcdir) / f"{docname}.md")


def _include_read(app: Any, relative_path: Path, parent_docname: str, content: list[str]) -> None:
    content[0] = site_links(content[0], Path(app.srcdir) / relative_path)


def _builder_inited(app: Any) -> None:
    from sphinx.util import logging

    logger = logging.getLogger(__name__)
    for path, section in stale_blocks():
        logger.warning(f"{path.relative_to(ROOT)}: the settings table of [{section}] is not what "
                       f"the options declare; regenerate it: {REGENERATE}")
    draw_plots()


def setup(app: Any) -> dict[str, Any]:
    app.connect("builder-inited", _builder_inited)
    app.connect("source-read", _source_read)
    app.connect("include-read", _include_read)
    return {"parallel_read_safe": True, "parallel_write_safe": True}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate the settings tables of the docs from the options.")
    parser.add_argument("--check", action="store_true", help="only say which tables are stale (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_blocks()
        for path, section in stale:
            print(f"{path.relative_to(ROOT)}: [{section}] is stale")
        return 1 if stale else 0
    for path in write_blocks():
        print(f"rewrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
