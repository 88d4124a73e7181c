#!/usr/bin/env bash
# moto's AWS emulator as an HTTP server on 127.0.0.1, for the fiber-aws tests: `up` | `down` | `status`.
#
# It runs through plugins/fiber_aws/tests/batch_emulator.py: moto's server, plus what AWS Batch
# does and moto does not (retry strategies, a lost host, the job role's credentials and the
# execution role's secrets in a job's container; that file's docstring says what and why).
#
# Its Batch jobs really run: moto starts one container per job on the project's private
# dockerd (scripts/services/docker.sh, DOCKER_HOST=unix://$FIBER_SERVICES_DIR/docker/docker.sock)
# with HOST networking (MOTO_DOCKER_NETWORK_MODE=host), so jobs reach the test process on
# 127.0.0.1. That dockerd has no bridge and no registry access: images must exist locally
# (fiber-test:latest); moto never gets to pull one.
# Tests read $FIBER_SERVICES_DIR/moto/env (present only while up):
#   FIBER_MOTO_ENDPOINT=http://127.0.0.1:PORT   DOCKER_HOST=unix://...
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
dir=$FIBER_SERVICES_DIR/moto
pidfile=$dir/moto.pid
log=$dir/moto.log
envfile=$dir/env
docker_sock=$FIBER_SERVICES_DIR/docker/docker.sock
dead_proxy=http://127.0.0.1:9
mkdir -p "$dir"

# The first interpreter that has moto's server (pip install -e 'plugins/fiber_aws[test]').
find_python() {
  local p
  for p in "${FIBER_MOTO_PYTHON:-}" "${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}" \
           "$FIBER_REPO/.venv/bin/python" "$(command -v python3 || true)"; do
    [ -n "$p" ] && [ -x "$p" ] && "$p" -c 'import moto.server, flask, docker' 2>/dev/null && { echo "$p"; return 0; }
  done
  return 1
}

emulator=$FIBER_REPO/plugins/fiber_aws/tests/batch_emulator.py
# our moto server (started by moto.server itself before batch_emulator.py existed)
running() { ours_running "$pidfile" "batch_emulator.py" || ours_running "$pidfile" "moto.server"; }

port() { sed -n 's|^FIBER_MOTO_ENDPOINT=http://127.0.0.1:||p' "$envfile" 2>/dev/null; }

answers() { # answers PORT: moto's own API responds
  "$py" - "$1" <<'EOF' 2>/dev/null
import sys, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
opener.open(f"http://127.0.0.1:{sys.argv[1]}/moto-api/data.json", timeout=2).read()
EOF
}

# Batch job containers moto left on our dockerd (it names them JOBNAME-JOBID and gives
# them MOTO_HTTP_ENDPOINT in their environment); only reachable while docker is up.
remove_job_containers() {
  [ -S "$docker_sock" ] && command -v docker >/dev/null || return 0
  local id ids
  ids=$(timeout 30 docker -H "unix://$docker_sock" ps -aq 2>/dev/null) || return 0
  for id in $ids; do
    if timeout 30 docker -H "unix://$docker_sock" inspect -f '{{range .Config.Env}}{{println .}}{{end}}' "$id" 2>/dev/null |
      grep -q '^MOTO_HTTP_ENDPOINT='; then
      timeout 30 docker -H "unix://$docker_sock" rm -f "$id" >/dev/null 2>&1 || true
    fi
  done
}

up() {
  if running && answers "$(port)"; then
    echo "moto: up (pid $pid, $(sed -n 's/^FIBER_MOTO_ENDPOINT=//p' "$envfile"))"; return 0
  fi
  [ -S "$docker_sock" ] || echo "moto: warning: no private dockerd at $docker_sock (scripts/services/docker.sh up): Batch jobs will fail to start" >&2
  local p
  p=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  rm -f "$envfile"
  echo "--- $(date -Is) starting moto_server (batch_emulator.py) on 127.0.0.1:$p" >>"$log"
  # No proxy that leads anywhere, no instance metadata service: nothing leaves 127.0.0.0/8.
  env DOCKER_HOST="unix://$docker_sock" MOTO_DOCKER_NETWORK_MODE=host MOTO_PORT="$p" \
    AWS_EC2_METADATA_DISABLED=true HTTP_PROXY=$dead_proxy HTTPS_PROXY=$dead_proxy \
    http_proxy=$dead_proxy https_proxy=$dead_proxy NO_PROXY=127.0.0.1,localhost no_proxy=127.0.0.1,localhost \
    setsid "$py" "$emulator" -H 127.0.0.1 -p "$p" </dev/null >>"$log" 2>&1 9>&- &
  echo $! >"$pidfile"
  local _
  for _ in $(seq 1 120); do
    answers "$p" && break
    kill -0 "$(cat "$pidfile")" 2>/dev/null || { tail -20 "$log" >&2; echo "moto: moto_server exited (log: $log)" >&2; exit 1; }
    sleep 0.25
  done
  answers "$p" || { tail -20 "$log" >&2; down >/dev/null; echo "moto: no answer on 127.0.0.1:$p within 30 s (log: $log)" >&2; exit 1; }
  printf 'FIBER_MOTO_ENDPOINT=http://127.0.0.1:%s\nDOCKER_HOST=unix://%s\n' "$p" "$docker_sock" >"$envfile"
  echo "moto: up (pid $(cat "$pidfile"), http://127.0.0.1:$p)"
}

down() {
  if running; then
    local p; p=$(port)
    # Reset first: moto stops its running Batch jobs and removes their containers.
    [ -z "$p" ] || "$py" - "$p" <<'EOF' >/dev/null 2>&1 || true
import sys, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
opener.open(urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/moto-api/reset", method="POST"), timeout=10).read()
EOF
    stop_pid "$pid" 10
  fi
  remove_job_containers
  rm -f "$pidfile" "$envfile"
  echo "moto: stopped"
}

case "${1:-status}" in
  up)
    exec 9>"$dir/lock"; flock 9
    py=$(find_python) || { echo "moto: no python with moto[server] and docker; pip install -e 'plugins/fiber_aws[test]'" >&2; exit 1; }
    up ;;
  down)
    exec 9>"$dir/lock"; flock 9
    py=$(find_python) || py=python3
    down ;;
  status)
    if running; then echo "moto: running (pid $pid, $(sed -n 's/^FIBER_MOTO_ENDPOINT=//p' "$envfile" 2>/dev/null))"
    else echo "moto: stopped"; exit 3; fi ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
