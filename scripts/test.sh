#!/usr/bin/env bash
# Install what the tests need, start the real services, run the whole suite, stop the services.
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=$PWD/.venv/bin/python
"$VPY" -m pip install -q --upgrade pip >/dev/null
plugins=()
for d in plugins/*/; do [ -f "$d/pyproject.toml" ] && plugins+=(-e "$d[test]"); done
"$VPY" -m pip install -q -e ".[test,examples]" "${plugins[@]}"
if [ -f requirements-test.txt ]; then "$VPY" -m pip install -q -r requirements-test.txt; fi

# Stop the services (and drop the built distributions) however this script ends, including
# when a service fails to start.
dists=$(mktemp -d)
site=$(mktemp -d)
trap 'rm -rf "$dists" "$site"; scripts/test-services.sh down' EXIT
scripts/test-services.sh up

"$VPY" -m ruff check .
# The layers of fiber_core (docs/architecture.md): no upward import, no cycle.
"$(dirname "$VPY")/lint-imports" --config pyproject.toml
# The whole core, every plugin and the docs' generators are type-checked.
mypy_paths=(fiber_core docs/_ext benchmarks/plot.py)
for d in plugins/*/fiber_*/; do [ -f "$d/__init__.py" ] && mypy_paths+=("$d"); done
"$VPY" -m mypy --ignore-missing-imports --follow-imports=silent "${mypy_paths[@]}"
# The five distributions build as wheels and sdists and pass twine's check; tests/test_installs.py
# installs these ones into fresh venvs.
PYTHON="$VPY" bash scripts/build-dists.sh "$dists"
export TEST_DISTS_DIR=$dists
# The documentation site, with every warning an error (a stale settings table is one).
PYTHON="$VPY" bash scripts/build-docs.sh "$site"
paths=(tests)
for d in plugins/*/tests; do [ -d "$d" ] && paths+=("$d"); done
bash scripts/test-pythons.sh
"$VPY" -m pytest -q "${paths[@]}" "$@"
