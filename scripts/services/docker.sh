#!/usr/bin/env bash
# Private Docker Engine for the tests: `up` | `down` | `status`. Own socket, data root, exec
# root and pid file; host networking only (no bridge, no iptables); registries are unreachable
# (dead proxy), so every image is built here:
#   fiber-base:latest           Debian bookworm minbase + python3 (debootstrap, imported)
#   fiber-test-nofiber:latest   base + the core package's dependencies, no fiber_core
#   fiber-test:latest           nofiber + fiber_core from $FIBER_REPO (redone when it changes)
#   fiber-test-nopython:latest  base with python3 removed
# Tests reach it with DOCKER_HOST=unix://$FIBER_SERVICES_DIR/docker/docker.sock.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
dir=$FIBER_SERVICES_DIR/docker sock=$FIBER_SERVICES_DIR/docker/docker.sock
pidfile=$dir/dockerd.pid log=$dir/dockerd.log
data_root=${FIBER_DOCKER_DATA_ROOT:-/var/lib/fiber-test-docker}
cache=${FIBER_DOCKER_CACHE:-/var/cache/fiber-test}
rootfs_tar=$cache/bookworm-python3-minbase.tar
py=${FIBER_PYTHON:-python3} dead_proxy=http://127.0.0.1:9
site=usr/local/lib/python3.11/dist-packages   # bookworm's python3 is 3.11
mkdir -p "$dir"

dk() { timeout 300 docker -H "unix://$sock" "$@"; }
die() { echo "docker: $*" >&2; exit 1; }
running() { ours_running "$pidfile" "unix://$sock"; }  # our dockerd, on our socket
# Temporary dirs, removed on exit; unmount first (debootstrap mounts proc/sys inside its target).
rm_tree() { grep -o " $1/[^ ]*" /proc/self/mounts | sort -r | xargs -r -n1 umount -l || true; rm -rf --one-file-system "$1"; }
tmps=(); trap 'for t in "${tmps[@]}"; do rm_tree "$t"; done' EXIT
# Two lines from pyproject.toml: build-system.requires, then project.dependencies.
pyproj() { "$py" -c 'import sys,tomllib; d=tomllib.load(open(sys.argv[1],"rb"))
print(" ".join(d["build-system"]["requires"])); print(" ".join(d["project"]["dependencies"]))' "$FIBER_REPO/pyproject.toml"; }
pip_() { "$cache/buildenv/bin/python" -m pip -q --disable-pip-version-check install --root-user-action=ignore "$@"; }
label() { dk image inspect -f "{{index .Config.Labels \"$2\"}}" "$1" 2>/dev/null || true; }

# The Debian mirror apt already uses for bookworm (one-line and deb822 formats).
mirror() {
  { cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
      awk '$1=="deb"{i=2; if($i~/^\[/){while($i!~/\]$/)i++; i++} if($(i+1)=="bookworm"){print $i}}'
    cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk -v RS= '{u="";s=0;n=split($0,L,"\n")
      for(i=1;i<=n;i++){m=split(L[i],a,/[ \t]+/); if(a[1]=="URIs:")u=a[2]
        if(a[1]=="Suites:")for(j=2;j<=m;j++)if(a[j]=="bookworm")s=1}
      if(s&&u)print u}'
    echo http://deb.debian.org/debian; } | awk 'NR==1'
}

build_rootfs() { # debootstrap once; the tarball is cached across runs
  [ -s "$rootfs_tar" ] && return 0
  apt_install "$dir/apt.log" debootstrap && mkdir -p "$cache"
  local tmp; tmp=$(mktemp -d "$cache/rootfs.XXXXXX"); tmps+=("$tmp")
  echo "docker: debootstrap bookworm from $(mirror) (once, cached in $cache)"
  debootstrap --variant=minbase --include=python3 bookworm "$tmp/root" "$(mirror)" >"$cache/debootstrap.log" 2>&1 ||
    { tail -20 "$cache/debootstrap.log" >&2; die "debootstrap failed (log: $cache/debootstrap.log)"; }
  rm -rf "$tmp"/root/var/cache/apt/archives/*.deb "$tmp"/root/var/lib/apt/lists/*
  tar -C "$tmp/root" --numeric-owner -cf "$rootfs_tar.tmp" . && mv "$rootfs_tar.tmp" "$rootfs_tar"
  rm_tree "$tmp"
}
layer() { # layer FROM TO LABEL=VALUE < tar: add the tar's files to FROM as one layer
  local c=fiber-build-$$
  dk create --name "$c" --network none "$1" >/dev/null && dk cp - "$c:/"
  dk commit --change "LABEL $3" "$c" "$2" >/dev/null
  dk rm -f "$c" >/dev/null
}

build_images() {
  dk image inspect fiber-base:latest >/dev/null 2>&1 ||
    { build_rootfs; dk import --change 'CMD ["/bin/bash"]' "$rootfs_tar" fiber-base:latest >/dev/null; }
  local base nofib stage h deps files=()
  base=$(dk image inspect -f '{{.Id}}' fiber-base:latest)
  stage=$(mktemp -d); tmps+=("$stage")
  if [ "$(label fiber-test-nopython:latest fiber.base)" != "$base" ]; then
    dk run --name fiber-build-$$ --network none fiber-base:latest \
      sh -c 'rm -rf /usr/bin/python3* /usr/bin/py3* /usr/lib/python3* /usr/local/lib/python3*'
    dk commit --change "LABEL fiber.base=$base" --change 'CMD ["/bin/sh"]' fiber-build-$$ fiber-test-nopython:latest >/dev/null
    dk rm fiber-build-$$ >/dev/null
  fi
  # A private venv holding the build backend: rebuilding the fiber_core layer needs no network.
  local pp req; pp=$(pyproj); req="${pp%%$'\n'*} wheel"; deps=${pp#*$'\n'}
  if [ "$(cat "$cache/buildenv/.req" 2>/dev/null)" != "$req" ]; then
    rm -rf "$cache/buildenv" && "$py" -m venv "$cache/buildenv"
    pip_ $req && echo "$req" >"$cache/buildenv/.req"
  fi
  h=$(echo "$deps $base" | sha256sum | cut -c1-16)
  if [ "$(label fiber-test-nofiber:latest fiber.deps)" != "$h" ]; then
    pip_ --target "$stage/deps/$site" $deps
    tar -C "$stage/deps" -c usr | layer fiber-base:latest fiber-test-nofiber:latest "fiber.deps=$h"
  fi
  nofib=$(dk image inspect -f '{{.Id}}' fiber-test-nofiber:latest)
  # fiber_core layer: keyed on a hash of its sources (and of the image below it).
  [ ! -f "$FIBER_REPO/fiber_core/__init__.py" ] || mapfile -t files < <(cd "$FIBER_REPO" &&
    find fiber_core pyproject.toml README.md -type f ! -path '*/__pycache__/*' ! -name '*.py[co]' 2>/dev/null | LC_ALL=C sort)
  h=$( { [ ${#files[@]} -eq 0 ] || (cd "$FIBER_REPO" && sha256sum "${files[@]}"); echo "$nofib"; } | sha256sum | cut -c1-16)
  if [ "$(label fiber-test:latest fiber.core)" != "$h" ]; then
    mkdir -p "$stage/core/$site" "$stage/core/usr/local/bin"
    if [ ${#files[@]} -gt 0 ]; then
      # Build from a copy so the work tree gets no build/ or *.egg-info.
      mkdir "$stage/src" && (cd "$FIBER_REPO" && cp --parents "${files[@]}" "$stage/src/")
      [ -f "$stage/src/README.md" ] || : >"$stage/src/README.md"
      pip_ --no-deps --no-build-isolation --target "$stage/core/$site" "$stage/src"
      if [ -d "$stage/core/$site/bin" ]; then   # console scripts: use the image's python
        sed -i '1s|^#!.*|#!/usr/bin/python3|' "$stage/core/$site"/bin/*
        mv "$stage/core/$site"/bin/* "$stage/core/usr/local/bin/" && rmdir "$stage/core/$site/bin"
      fi
    fi
    tar -C "$stage/core" -c usr | layer fiber-test-nofiber:latest fiber-test:latest "fiber.core=$h"
    dk image prune -f --filter label=fiber.deps >/dev/null   # older, now untagged, builds
    echo "docker: fiber-test:latest rebuilt (fiber.core=$h, fiber_core $([ ${#files[@]} -gt 0 ] && echo installed || echo absent))"
  fi
}

start_daemon() { # start_daemon DRIVER: returns 1 if it does not answer in time
  rm -f "$sock" "$pidfile"
  [ -f "$dir/daemon.json" ] || echo '{}' >"$dir/daemon.json"   # ignore /etc/docker/daemon.json
  echo "--- $(date -Is) starting dockerd ($1)" >>"$log"
  HTTP_PROXY=$dead_proxy HTTPS_PROXY=$dead_proxy http_proxy=$dead_proxy https_proxy=$dead_proxy \
    NO_PROXY='' no_proxy='' setsid dockerd --host "unix://$sock" --config-file "$dir/daemon.json" \
    --data-root "$data_root" --exec-root "$dir/exec" --pidfile "$pidfile" --storage-driver "$1" \
    --bridge=none --iptables=false --ip-masq=false --host-gateway-ip=127.0.0.1 \
    --containerd-namespace fiber-test --containerd-plugins-namespace fiber-test-plugins --cgroup-parent /fiber-test \
    </dev/null >>"$log" 2>&1 9>&- &   # 9>&-: the daemon must not keep our lock
  local p=$! i
  for i in $(seq 1 120); do
    timeout 5 docker -H "unix://$sock" info >/dev/null 2>&1 && return 0
    kill -0 "$p" 2>/dev/null || return 1
    sleep 0.5
  done
  kill -TERM "$p" 2>/dev/null; sleep 2; kill -KILL "$p" 2>/dev/null || true; return 1
}

down() {
  if running; then
    local ids; ids=$(dk ps -aq --filter label=fiber.run 2>/dev/null || true)
    [ -z "$ids" ] || dk rm -f $ids >/dev/null || true
    stop_pid "$pid" 30
  fi
  # Leftovers if dockerd had to be killed: processes of our containers (found by our cgroup
  # parent), then containerd and its shims (containerd binaries naming our exec root).
  local p
  { find /sys/fs/cgroup -path '*/fiber-test/*' -name cgroup.procs -exec cat {} + 2>/dev/null || true; } |
    while read -r p; do kill -KILL "$p" 2>/dev/null || true; done
  for p in /proc/[0-9]*; do
    [[ "$(readlink "$p/exe" 2>/dev/null)" == */containerd* ]] &&
      tr '\0' ' ' <"$p/cmdline" 2>/dev/null | grep -qF -- "$dir/exec/" && stop_pid "${p#/proc/}" 30 || true
  done
  awk '{print $5}' /proc/self/mountinfo | { grep -E "^($dir|$data_root)(/|$)" || true; } | sort -r |
    while read -r m; do umount "$m" 2>/dev/null || umount -l "$m" || true; done
  rm -f "$sock" "$pidfile" "$dir/env"
  echo "docker: stopped"
}

case "${1:-status}" in
  up)
    exec 9>"$dir/lock"; flock 9
    command -v dockerd >/dev/null || apt_install "$dir/apt.log" docker.io
    if ! running && ! start_daemon overlay2; then
      { grep -a 'failed to start' "$log" | tail -1 || true; echo "docker: overlay2 failed, trying vfs"; } >&2
      start_daemon vfs || { tail -20 "$log" >&2; die "dockerd did not start: it exited, or gave no answer on $sock within 60 s (log: $log)"; }
    fi
    build_images
    echo "DOCKER_HOST=unix://$sock" >"$dir/env"
    echo "docker: up (pid $(cat "$pidfile"), driver $(dk info -f '{{.Driver}}')); DOCKER_HOST=unix://$sock" ;;
  down) exec 9>"$dir/lock"; flock 9; down ;;
  status)
    running || { echo "docker: stopped"; exit 0; }
    imgs=$(dk images --format '{{.Repository}}:{{.Tag}}' --filter 'reference=fiber-*' | LC_ALL=C sort | paste -sd' ')
    echo "docker: running (pid $pid, socket $sock, images: $imgs)" ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
