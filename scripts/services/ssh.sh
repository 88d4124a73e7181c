#!/usr/bin/env bash
# Three SSH test hosts fiber-h1..3: network namespaces on bridge fiberbr0 (10.231.77.0/24),
# each with its own sshd (port 22), host key and hostname. The root namespace is 10.231.77.1.
# Nothing is routed beyond that /24: no default route, no NAT.
#
#   ssh.sh up|down|status                  (called by scripts/test-services.sh)
#   ssh.sh cut|heal HOST                   link down / up on the host's veth
#   ssh.sh kill-sshd|start-sshd HOST       stop / start the host's sshd
# HOST: fiber-h1, h1, 1 or 10.231.77.11 (likewise 2, 3).
# Tests read $FIBER_SERVICES_DIR/ssh/hosts.env (present only while up).
#
# Each host has its own /tmp (a tmpfs in the mount namespace of its sshd), as a real machine
# has: Fiber keeps its Unix socket in the parent's /tmp, and a job that could see it would
# reach the parent through it instead of the network. Only this service's directory, the
# repository (CI may clone it under /tmp) and the paths in FIBER_SSH_SHARED (colon-separated)
# stay visible there. Each has its own /dev/shm too, so what one host keeps in shared
# memory (a broadcast copy, a named semaphore) is not visible on the others, and an empty
# ~/.bashrc for the login user, as a fresh server has (this machine's runs pyenv init). The
# namespaces are global: `up` records which service directory owns them (in $OWNER) and
# `down` from another directory leaves them alone.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
D=$FIBER_SERVICES_DIR/ssh
BR=fiberbr0 NET=10.231.77 HOSTS=(1 2 3)
SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
REPO=$(cd "$(dirname "$SELF")/../.." && pwd)
OWNER=/run/fiber-ssh-hosts.owner
FW=("FORWARD -i $BR -o $BR -j ACCEPT" "INPUT -i $BR -j ACCEPT")  # only added if that chain's policy is not ACCEPT

running() { local st; st=$(cat "/proc/$1/stat" 2>/dev/null) && st=${st##*) } && [ "${st:0:1}" != Z ]; }  # not a zombie
alive() { [ -s "$1" ] && running "$(cat "$1")" && [ "$(cat "/proc/$(cat "$1")/comm")" = sshd ]; }
host_n() {
  case "$1" in fiber-h[123] | h[123] | [123] | "$NET".1[123]) echo "${1: -1}" ;;
    *) echo "unknown host '$1' (fiber-h1..3, h1..3, 1..3 or $NET.11..13)" >&2; return 2 ;; esac
}

# python3: the system's interpreter, which the tests that play another local user (nobody) run
# (the suite's own Python may live under a home that user cannot read: pyenv's under /root).
install_deps() { mkdir -p "$D"; apt_install "$D/apt.log" openssh-server openssh-client iproute2 iptables hostname python3; }

start_sshd() {
  local n=$1 h=$D/fiber-h$1
  alive "$h/sshd.pid" && return 0
  mkdir -p /run/sshd && chmod 755 /run/sshd
  local keep=() p
  local IFS=:
  for p in "$D" "$REPO" ${FIBER_SSH_SHARED:-}; do
    p=$(realpath -m "$p"); case "$p" in /tmp/?*) keep+=("$p") ;; esac
  done
  unset IFS
  local old=/run/fiber-ssh-oldtmp-h$n  # where the real /tmp stays reachable while binding
  mkdir -p "$old"
  : >"$h/bashrc"
  ip netns exec "fiber-h$n" unshare --uts --mount --propagation private sh -c '
    set -e
    hostname "$1"; old=$2 h=$3; shift 3
    # The login shell of a fresh server: bash reads ~/.bashrc for a command sshd runs, and
    # this machine'"'"'s (pyenv init here: 60 ms and a lock of its own per command) is not the hosts'"'"'.
    if [ -f "$HOME/.bashrc" ]; then mount --bind "$h/bashrc" "$HOME/.bashrc"; fi
    mount --bind /tmp "$old"
    mount -t tmpfs -o mode=1777,size=25% "$(hostname)-tmp" /tmp
    mount -t tmpfs -o mode=1777,size=25% "$(hostname)-shm" /dev/shm
    for p in "$@"; do mkdir -p "$p" && mount --bind "$old${p#/tmp}" "$p"; done
    umount -l "$old"
    exec /usr/sbin/sshd -f "$h/sshd_config" -E "$h/sshd.log"' sh "fiber-h$n" "$old" "$h" ${keep[@]+"${keep[@]}"}
  for _ in $(seq 100); do alive "$h/sshd.pid" && return 0; sleep 0.05; done
  echo "ssh: sshd on fiber-h$n did not start; see $h/sshd.log" >&2; tail -5 "$h/sshd.log" >&2; return 1
}

stop_sshd() {
  local pf=$D/fiber-h$1/sshd.pid
  if alive "$pf"; then
    local pid; pid=$(cat "$pf"); kill "$pid"
    for _ in $(seq 40); do running "$pid" || break; sleep 0.05; done
  fi
  rm -f "$pf"
}

up() {
  install_deps
  mkdir -p "$D"
  if [ -s "$OWNER" ] && [ "$(cat "$OWNER")" != "$D" ] && ip netns list | grep -q '^fiber-h[123]\b'; then
    echo "ssh: the test hosts are up for $(cat "$OWNER"); bring them down with" \
      "FIBER_SERVICES_DIR=$(dirname "$(cat "$OWNER")") $SELF down" >&2
    return 1
  fi
  echo "$D" >"$OWNER"
  [ -f "$D/id_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C fiber-test-client -f "$D/id_ed25519"
  cp "$D/id_ed25519.pub" "$D/authorized_keys"
  if ! ip link show "$BR" >/dev/null 2>&1; then
    ip link add "$BR" type bridge forward_delay 0 stp_state 0
    ip addr add "$NET.1/24" dev "$BR"
  fi
  ip link set "$BR" up
  for c in "${FW[@]}"; do
    read -r chain rule <<<"$c"
    [ "$(iptables -S "$chain" | head -1)" = "-P $chain ACCEPT" ] && continue
    iptables -C $chain $rule 2>/dev/null || { iptables -I $chain $rule && touch "$D/fw-$chain"; }
  done
  : >"$D/known_hosts.new"
  for n in "${HOSTS[@]}"; do
    local ns=fiber-h$n h=$D/fiber-h$n ip=$NET.1$n
    mkdir -p "$h"
    [ -f "$h/ssh_host_ed25519_key" ] || ssh-keygen -q -t ed25519 -N '' -C "$ns" -f "$h/ssh_host_ed25519_key"
    echo "$ip $(cut -d' ' -f1,2 "$h/ssh_host_ed25519_key.pub")" >>"$D/known_hosts.new"
    cat >"$h/sshd_config" <<EOF
ListenAddress $ip:22
HostKey $h/ssh_host_ed25519_key
PidFile $h/sshd.pid
AuthorizedKeysFile $D/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
UseDNS no
PrintMotd no
MaxStartups 200
MaxSessions 200
ClientAliveInterval 5
ClientAliveCountMax 3
Subsystem sftp internal-sftp
EOF
    ip netns list | grep -qx "$ns\( .*\)\?" || ip netns add "$ns"
    if ! ip link show "fbr-h$n" >/dev/null 2>&1; then
      ip link add "fbr-h$n" type veth peer name eth0 netns "$ns"
      ip link set "fbr-h$n" master "$BR" up
      ip -n "$ns" addr add "$ip/24" dev eth0
    fi
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
    start_sshd "$n"
  done
  mv "$D/known_hosts.new" "$D/known_hosts"
  cat >"$D/hosts.env" <<EOF
FIBER_SSH_HOSTS="$NET.11 $NET.12 $NET.13"
FIBER_SSH_HOSTNAMES="fiber-h1 fiber-h2 fiber-h3"
FIBER_SSH_USER=root
FIBER_SSH_PORT=22
FIBER_SSH_KEY=$D/id_ed25519
FIBER_SSH_KNOWN_HOSTS=$D/known_hosts
FIBER_SSH_PARENT_ADDR=$NET.1
FIBER_SSH_CTL="$SELF"
EOF
}

down() {
  rm -f "$D/hosts.env"
  if [ -s "$OWNER" ] && [ "$(cat "$OWNER")" != "$D" ]; then
    echo "ssh: left the test hosts up: they belong to $(cat "$OWNER")" >&2
    return 0
  fi
  for n in "${HOSTS[@]}"; do
    local ns=fiber-h$n
    stop_sshd "$n"
    if ip netns list | grep -qx "$ns\( .*\)\?"; then
      local pids; pids=$(ip netns pids "$ns")
      if [ -n "$pids" ]; then
        kill $pids 2>/dev/null || true; sleep 0.2
        pids=$(ip netns pids "$ns"); [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
      fi
      ip netns del "$ns"
    fi
    ip link del "fbr-h$n" 2>/dev/null || true
  done
  ip link del "$BR" 2>/dev/null || true
  for c in "${FW[@]}"; do
    read -r chain rule <<<"$c"
    [ -f "$D/fw-$chain" ] || continue
    iptables -D $chain $rule 2>/dev/null || true; rm -f "$D/fw-$chain"
  done
  rm -f "$OWNER"
  rmdir /run/fiber-ssh-oldtmp-h[123] 2>/dev/null || true
}

status() {
  local s=() ok=0
  for n in "${HOSTS[@]}"; do
    local st=down
    if ip netns list 2>/dev/null | grep -qx "fiber-h$n\( .*\)\?"; then
      alive "$D/fiber-h$n/sshd.pid" && st="sshd $(cat "$D/fiber-h$n/sshd.pid")" || st="no sshd"
      ip link show "fbr-h$n" 2>/dev/null | grep -q 'state UP' || st="$st, cut"
      [[ $st == sshd* ]] && ok=$((ok + 1))
    fi
    s+=("fiber-h$n=$NET.1$n ($st)")
  done
  local IFS=,; echo "ssh: $([ $ok = 3 ] && echo up || echo down) ${s[*]}"
  [ $ok = 3 ]
}

case "${1:-status}" in up | down | *-sshd) mkdir -p "$D" && exec 9>"$D/lock" && flock 9 ;; esac
case "${1:-status}" in
  up) up ;;
  down) down ;;
  status) status || exit 3 ;;
  cut) n=$(host_n "${2:-}"); ip link set "fbr-h$n" down ;;
  heal) n=$(host_n "${2:-}"); ip link set "fbr-h$n" up ;;
  kill-sshd) n=$(host_n "${2:-}"); stop_sshd "$n" ;;
  start-sshd) n=$(host_n "${2:-}"); start_sshd "$n" ;;
  *) echo "usage: $0 up|down|status|cut HOST|heal HOST|kill-sshd HOST|start-sshd HOST" >&2; exit 2 ;;
esac
