"""The docs' generated parts: settings tables from the options, repository links on the site, benchmark plots.

The site itself is built with warnings as errors by scripts/build-docs.sh (a step of
scripts/test.sh); these tests check the generators it runs.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from fiber_core.base.install import KNOWN_BACKENDS
from fiber_core.runtime.config import config, env_variable, plugins

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


docs = _load("fiber_docs", ROOT / "docs" / "_ext" / "fiber_docs.py")
plot = _load("fiber_benchmark_plots", ROOT / "benchmarks" / "plot.py")


# -- settings tables --------------------------------------------------------------------------


def test_every_settings_table_is_what_the_options_declare() -> None:
    assert docs.stale_blocks() == []


def test_every_section_has_a_table() -> None:
    # the project's backends: a test may have registered a toy one besides
    ours = {"fiber"} | {info.cls.settings_section() for info in plugins().backends()
                        if info.name == "local" or info.name in KNOWN_BACKENDS}
    found = {m["section"] for path in docs.sources() for m in docs.BLOCK.finditer(path.read_text())}
    assert ours == {"fiber", "local", "docker", "kubernetes", "ssh", "aws"}
    assert found == ours


def test_a_table_has_a_row_per_option_with_its_variable_type_default_and_choices() -> None:
    table = docs.settings_table("ssh")
    plugins().backends()
    options = config.options("ssh")
    rows = table.splitlines()[2:]
    assert [re.match(r"\| `(\w+)` \|", r).group(1) for r in rows] == [o.name for o in options]
    policy = next(r for r in rows if r.startswith("| `host_key_policy`"))
    assert env_variable("host_key_policy", "ssh") == "FIBER_SSH_HOST_KEY_POLICY"
    assert "| `FIBER_SSH_HOST_KEY_POLICY` |" in policy
    assert "| str | `strict` |" in policy and "one of `strict`, `accept-new`" in policy
    timeout = next(r for r in rows if r.startswith("| `api_timeout`"))
    assert "| float | `15.0` |" in timeout
    assert "former name of api_timeout" in next(r for r in rows if r.startswith("| `timeout`"))
    # aws-batch's section is aws: a variable cannot have a dash in its name
    assert "| `queue` | `FIBER_AWS_QUEUE` | str |  |" in docs.settings_table("aws")


def test_help_text_is_not_read_as_markup() -> None:
    # ``container:<own id>`` would be an HTML tag, ``[:ro]`` a link, a ``|`` a new column.
    table = docs.settings_table("docker")
    assert r"container:\<own id\>" in table and r"SOURCE:TARGET\[:ro\]" in table


def test_an_unknown_section_is_an_error() -> None:
    with pytest.raises(LookupError, match=r"no options in section \[nonesuch\].*known: fiber, "):
        docs.settings_table("nonesuch")


def test_a_stale_table_is_found_rewritten_and_fails_the_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    page = tmp_path / "page.md"
    before, after = "# Title\n\ntext before\n\n", "\n\ntext after\n"
    page.write_text(before + "<!-- settings:local -->\n| key | a hand-written row |\n<!-- /settings -->" + after)
    assert docs.stale_blocks([page]) == [(page, "local")]

    # The build's hook reports it as a warning (an error under -W), with the command that fixes it.
    monkeypatch.setattr(docs, "sources", lambda: [page])
    monkeypatch.setattr(docs, "ROOT", tmp_path)
    monkeypatch.setattr(docs, "draw_plots", lambda: [])
    with caplog.at_level(logging.WARNING):
        docs._builder_inited(object())
    assert "page.md: the settings table of [local] is not what the options declare" in caplog.text
    assert docs.REGENERATE in caplog.text

    assert docs.write_blocks([page]) == [page]
    assert docs.stale_blocks([page]) == []
    text = page.read_text()
    assert text.startswith(before) and text.endswith("<!-- /settings -->" + after)
    assert "hand-written" not in text and "`FIBER_LOCAL_START`" in text
    assert docs.write_blocks([page]) == []


# -- links --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("source", "text", "site"), [
    ("plugins/fiber_ssh/README.md", "the [Fiber](../../README.md) project", "the [Fiber](/index.md) project"),
    ("docs/compatibility.md", "[Differences](differences.md#cpythons-multiprocessing-tests)",
     "[Differences](/differences.md#cpythons-multiprocessing-tests)"),
    ("README.md", "[guarantees](docs/guarantees.md)", "[guarantees](/guarantees.md)"),
    ("docs/writing-a-backend.md", "[`fiber_core/contract/jobs.py`](../fiber_core/contract/jobs.py)",
     "{py:mod}`fiber_core/contract/jobs.py <fiber_core.contract.jobs>`"),
    ("docs/x.md", "[it](../plugins/fiber_k8s/fiber_k8s/backend.py)", "{py:mod}`it <fiber_k8s.backend>`"),
    ("docs/writing-a-backend.md", "Copy [`examples/backend_template/`](../examples/backend_template/):",
     "Copy `examples/backend_template/`:"),
    ("docs/progress.md", "[tqdm](https://tqdm.github.io/)", "[tqdm](https://tqdm.github.io/)"),
    ("docs/x.md", "![a plot](_generated/plots/core.png)", "![a plot](_generated/plots/core.png)"),
])
def test_repository_links_on_the_site(source: str, text: str, site: str) -> None:
    assert docs.site_links(text, ROOT / source) == site


# -- plots --------------------------------------------------------------------------------------


def test_every_plot_is_drawn_from_its_table(tmp_path: Path) -> None:
    written = plot.draw_all(tmp_path)
    assert sorted(p.name for p in written) == sorted(p.file for p in plot.PLOTS)
    for path in written:
        data = path.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000, path
    # each plot appears on the page that holds its table
    pages = "".join(p.read_text() for p in plot.PAGES)
    assert all(f"(_generated/plots/{p.file})" in pages for p in plot.PLOTS)


def test_a_table_that_is_gone_or_unreadable_is_an_error() -> None:
    tables = plot.tables("## A\n\n| case | generation (s) |\n|---|---:|\n| one | 0.311 |\n| two | n/a |\n")
    assert tables[0].heading == "A" and tables[0].rows == [["one", "0.311"], ["two", "n/a"]]
    with pytest.raises(LookupError, match="0 tables whose header starts with 'metric'"):
        plot.find(tables, "metric")
    with pytest.raises(LookupError, match="no column 'fiber'"):
        tables[0].column("fiber")
    with pytest.raises(ValueError, match="not a number: 'n/a'"):
        plot.number("n/a")
    assert [plot.number(c) for c in ("7,755,485", "0.366 s", "1.05x", "12.4")] == [7755485, 0.366, 1.05, 12.4]
