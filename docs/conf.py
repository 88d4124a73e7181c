"""Sphinx configuration of Fiber's documentation site: Markdown pages (MyST) and API pages from the docstrings."""

from __future__ import annotations

import os
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(DOCS, "_ext"))

project = "Fiber"
author = "Fiber contributors"
copyright = "Fiber contributors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.viewcode",
    "fiber_docs",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_generated"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
suppress_warnings: list[str] = []

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
# The docstrings are reStructuredText with Sphinx roles (:class:, :meth:, ``code``).

html_theme = "furo"
html_title = "Fiber"
html_static_path: list[str] = []
