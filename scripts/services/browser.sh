#!/usr/bin/env bash
# Debian's chromium for the status page's test (tests/test_status_page.py): `up` | `down` | `status`.
#
# Nothing runs between tests: `up` installs the browser (and a font for its screenshots) with
# apt, without starting any service; each test starts a headless chromium of its own, off
# every network but loopback, and stops it. `down` has nothing to stop.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
dir=$FIBER_SERVICES_DIR/browser
mkdir -p "$dir"

case "${1:-status}" in
  up)
    exec 9>"$dir/lock"; flock 9
    apt_install "$dir/apt.log" chromium fonts-dejavu-core
    echo "browser: $(chromium --version 2>/dev/null | head -1)" ;;
  down)
    echo "browser: nothing to stop" ;;
  status)
    if command -v chromium >/dev/null; then echo "browser: installed ($(chromium --version 2>/dev/null | head -1))"
    else echo "browser: not installed"; exit 3; fi ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
