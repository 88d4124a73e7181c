#!/usr/bin/env bash
# Start, stop or report the real services the test suite talks to.
#
#   scripts/test-services.sh up [SERVICE...]      start (idempotent)
#   scripts/test-services.sh down [SERVICE...]    stop everything started by `up`
#   scripts/test-services.sh status [SERVICE...]  print one line per service
#
# SERVICE is one of the files in scripts/services/ (docker, ssh, moto, ...); the
# default is all of them. Every service keeps its state under $FIBER_SERVICES_DIR
# (default /tmp/fiber-services) and stops by PID, never by name.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export FIBER_REPO=$(cd "$here/.." && pwd)
export FIBER_SERVICES_DIR=${FIBER_SERVICES_DIR:-/tmp/fiber-services}
mkdir -p "$FIBER_SERVICES_DIR"

action=${1:-status}
shift || true
case "$action" in up|down|status) ;; *) echo "usage: $0 up|down|status [SERVICE...]" >&2; exit 2 ;; esac

if [ $# -gt 0 ]; then
  services=("$@")
else
  services=()
  for f in "$here"/services/*.sh; do
    [ -e "$f" ] && services+=("$(basename "$f" .sh)")
  done
fi
# Stop in the reverse order of starting: later services may run on earlier ones.
if [ "$action" = down ]; then
  rev=(); for ((i=${#services[@]}-1; i>=0; i--)); do rev+=("${services[$i]}"); done
  services=("${rev[@]}")
fi

status=0
for s in "${services[@]}"; do
  f="$here/services/$s.sh"
  if [ ! -f "$f" ]; then echo "unknown service '$s' (have: $(ls "$here/services" | sed 's/\.sh$//' | tr '\n' ' '))" >&2; exit 2; fi
  bash "$f" "$action" || status=$?
done
exit $status
