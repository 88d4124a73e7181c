#!/usr/bin/env bash
# Build the wheel and sdist of each of the five distributions (fiber-core and the four
# plugins) into one directory, then check them with `twine check --strict`. A build that
# makes setuptools warn (a deprecated field, say) fails too.
# Usage: bash scripts/build-dists.sh [OUT_DIR]    (OUT_DIR relative to the current directory;
# default: dist in the checkout; PYTHON picks the interpreter, which needs the packages build
# and twine: requirements-test.txt)
set -euo pipefail
if [ -n "${1:-}" ]; then
  mkdir -p "$1"
  out=$(cd "$1" && pwd)
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
out=${out:-$PWD/dist}
mkdir -p "$out"
rm -f "$out"/fiber_*.whl "$out"/fiber_*.tar.gz
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for d in . plugins/*/; do
  [ -f "$d/pyproject.toml" ] || continue
  # The wheel is built from the sdist, so a file the sdist leaves out shows up here.
  if ! "$PY" -m build --outdir "$out" "$d" >"$log" 2>&1; then
    cat "$log"
    echo "build-dists: building $d failed" >&2
    exit 1
  fi
  if grep -E '^WARNING |[A-Za-z]+Warning\b' "$log"; then
    echo "build-dists: building $d warned (above)" >&2
    exit 1
  fi
done
"$PY" -m twine check --strict "$out"/fiber_*.whl "$out"/fiber_*.tar.gz
echo "build-dists: $(ls "$out"/fiber_*.whl "$out"/fiber_*.tar.gz | wc -l) files in $out"
