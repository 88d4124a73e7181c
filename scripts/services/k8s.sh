#!/usr/bin/env bash
# Kubernetes API server emulator + test kubelet for the fiber-k8s tests: `up` | `down` | `status`.
# Serves HTTP on 127.0.0.1 only; runs each pod as a host-network container on the private test
# dockerd of scripts/services/docker.sh (labelled fiber-k8s-emulator=1).
#   kubeconfig: $FIBER_SERVICES_DIR/k8s/kubeconfig (context namespace "default", token user)
#   FIBER_K8S_PORT (default 16443; a free port is taken if it is busy), FIBER_K8S_TOKEN,
#   FIBER_K8S_EMULATOR_CONFIG (JSON text or file: rbac, nodes, namespaces; see the emulator README).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
dir=$FIBER_SERVICES_DIR/k8s
pidfile=$dir/emulator.pid
log=$dir/emulator.log
kubeconfig=$dir/kubeconfig
emulator=$FIBER_REPO/plugins/fiber_k8s/tests/k8s_emulator
docker_host=${FIBER_K8S_DOCKER_HOST:-unix://$FIBER_SERVICES_DIR/docker/docker.sock}
# The emulator needs only the standard library. The interpreter itself, not a launcher such as
# pyenv's shim: a shim execs three programs before Python runs, and while a program execs, its
# /proc/PID/cmdline reads empty, so `running` would say no for a live emulator.
py=$("${FIBER_PYTHON:-python3}" -c 'import sys; print(sys.executable)')
mkdir -p "$dir"

running() { ours_running "$pidfile" "--kubeconfig $kubeconfig"; }  # our emulator
url() { awk '$1=="server:"{print $2; exit}' "$kubeconfig" 2>/dev/null; }
answers() { # python, not curl: nothing else this script needs is outside the project's installs
  [ -s "$kubeconfig" ] && "$py" -c 'import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=2)' \
    "$(url)/version" >/dev/null 2>&1
}
port_free() { # SO_REUSEADDR as the server does: a port in TIME_WAIT is free for it
  "$py" -c 'import socket as s,sys; k=s.socket(); k.setsockopt(s.SOL_SOCKET, s.SO_REUSEADDR, 1); k.bind(("127.0.0.1", int(sys.argv[1])))' "$1" 2>/dev/null
}

up() {
  if running && answers; then echo "k8s: up (pid $pid, $(url)); KUBECONFIG=$kubeconfig"; return 0; fi
  running && stop
  local port=${FIBER_K8S_PORT:-16443} i
  port_free "$port" || { echo "k8s: port $port is busy, using a free one" >&2; port=0; }
  rm -f "$kubeconfig"
  echo "--- $(date -Is) starting emulator (docker $docker_host)" >>"$log"
  setsid "$py" "$emulator" --host 127.0.0.1 --port "$port" --docker-host "$docker_host" \
    --token "${FIBER_K8S_TOKEN:-fiber-emulator-token}" --kubeconfig "$kubeconfig" --instance services \
    </dev/null >>"$log" 2>&1 9>&- &   # 9>&-: the emulator must not hold our lock
  echo $! >"$pidfile"
  local started=$!
  for i in $(seq 1 300); do  # up to 60 s: a loaded machine right after dockerd starts is slow
    answers && { echo "k8s: up (pid $started, $(url)); KUBECONFIG=$kubeconfig"; return 0; }
    # The pid we just started, not `running`: its command line is checked only where the
    # pidfile may be an earlier run's.
    kill -0 "$started" 2>/dev/null || {
      tail -20 "$log" >&2; echo "k8s: the emulator exited before it answered (log: $log)" >&2; return 1; }
    sleep 0.2
  done
  tail -20 "$log" >&2
  stop_pid "$started" 20
  echo "k8s: emulator did not answer within 60 s (log: $log)" >&2
  return 1
}

stop() { stop_pid "$pid" 20; }  # on TERM the emulator removes its containers

down() {
  running && stop
  # Whatever a killed emulator left: every container the test kubelet ever created.
  if [ -S "${docker_host#unix://}" ]; then
    local ids
    ids=$(timeout 60 docker -H "$docker_host" ps -aq --filter label=fiber-k8s-emulator=1 2>/dev/null || true)
    # shellcheck disable=SC2086
    [ -z "$ids" ] || timeout 120 docker -H "$docker_host" rm -f $ids >/dev/null || true
  fi
  rm -f "$pidfile" "$kubeconfig"
  echo "k8s: stopped"
}

case "${1:-status}" in
  up) exec 9>"$dir/lock"; flock 9; up ;;
  down) exec 9>"$dir/lock"; flock 9; down ;;
  status)
    if running && answers; then echo "k8s: running (pid $pid, $(url), KUBECONFIG=$kubeconfig)"
    elif running; then echo "k8s: not answering (pid $pid, log $log)"
    else echo "k8s: stopped"; fi ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
