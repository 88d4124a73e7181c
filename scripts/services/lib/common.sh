# Helpers shared by the service scripts in scripts/services/ (sourced, never run).
# shellcheck shell=bash
FIBER_REPO=${FIBER_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)}
FIBER_SERVICES_DIR=${FIBER_SERVICES_DIR:-/tmp/fiber-services}

# ours_running PIDFILE MARK: the pid in PIDFILE is alive and MARK is on its command line
# (so a reused pid is not mistaken for ours). Sets $pid.
ours_running() {
  pid=$(cat "$1" 2>/dev/null) && [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null &&
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$2"
}

# stop_pid PID SECONDS: TERM, wait up to SECONDS for it to end, then KILL.
stop_pid() {
  local i
  kill -TERM "$1" 2>/dev/null || return 0
  for i in $(seq 1 $(($2 * 5))); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.2; done
  kill -KILL "$1" 2>/dev/null || true
}

# apt_install LOG PKG...: install the packages that are missing (one apt-get update first),
# without letting them start system services (a system dockerd with a bridge, a global
# sshd): policy-rc.d says no for the time of the install. apt's output goes to LOG.
apt_install() {
  local log=$1 missing=() p
  shift
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  local prc=/usr/sbin/policy-rc.d saved="" rc=0
  [ ! -e $prc ] || { mv $prc $prc.fiber-saved; saved=1; }
  printf '#!/bin/sh\nexit 101\n' >$prc && chmod +x $prc
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive NEEDRESTART_SUSPEND=1 \
      apt-get install -y -q --no-install-recommends "${missing[@]}"; } >"$log" 2>&1 || rc=$?
  rm -f $prc; [ -z "$saved" ] || mv $prc.fiber-saved $prc
  [ $rc -eq 0 ] || { tail -20 "$log" >&2; echo "apt-get install ${missing[*]} failed (log: $log)" >&2; }
  return $rc
}
