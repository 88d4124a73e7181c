#!/usr/bin/env bash
# Run the core's version-sensitive tests (managers, the local backend's conformance, the
# concurrent.futures executor, the start method name, and what Python 3.14 changed there)
# on every other Python from 3.10 to 3.14 that pyenv provides.
# Usage: bash scripts/test-pythons.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=${PYENV_ROOT:-$HOME/.pyenv}
ran=0
for v in 3.10 3.12 3.13 3.14; do
  py=$(ls -d "$root"/versions/"$v".*/bin/python 2>/dev/null | sort -V | tail -n 1 || true)
  if [ -z "$py" ]; then
    echo "test-pythons: no Python $v under $root/versions; skipped"
    continue
  fi
  venv=.venv-$v
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q -e . pytest pytest-timeout
  echo "test-pythons: $("$venv/bin/python" --version)"
  "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_managers.py tests/test_context.py \
    tests/test_conformance_local.py tests/test_py314.py -k "not torch"
  # the executor and the start method name lean on the stdlib's private parts
  "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_executor.py tests/test_clients.py \
    -k "not gym and not sb3 and not es_example"
  ran=$((ran + 1))
done
echo "test-pythons: ran on $ran other Python version(s)"
