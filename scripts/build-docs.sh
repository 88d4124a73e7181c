#!/usr/bin/env bash
# Build the documentation site into OUT (default docs/_build/html) with every warning an error.
# Usage: bash scripts/build-docs.sh [OUT]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-.venv/bin/python}
out=${1:-docs/_build/html}
exec "$PY" -m sphinx -W --keep-going -q -b html -d "$out/.doctrees" docs "$out"
