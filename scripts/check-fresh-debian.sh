#!/usr/bin/env bash
# The README's `make test` on a fresh machine of another Debian release: makes a minimal root of
# SUITE with mmdebstrap (apt, make, ca-certificates and nothing of ours), copies the repository's
# committed HEAD into it, and runs `make test` there as root, as a newcomer would:
# scripts/install-deps.sh installs the packages, npm fetches the reference tokenizer, everything is
# built from an empty compiler cache and every test runs. Debian 13 (trixie) brings LibTorch 2.6
# (run, not only compiled as by check-libtorch2), GCC 14, abseil 20240722 and Python 3.13.
#
#   scripts/check-fresh-debian.sh [SUITE]      SUITE: a Debian suite (default trixie)
#
# Environment: FRESH_ROOT (the root's folder; default /var/tmp/collabserve-fresh-SUITE, removed
# first), KEEP=1 (keep the root afterwards, e.g. to rerun one test with chroot), MIRROR (default
# http://deb.debian.org/debian), JOBS. The log: FRESH_ROOT.log. Needs root, mmdebstrap (the
# script says how to install it), and the network (Debian mirror, npm registry). About 40 min on
# 2 cores: 3 to make the root, 3 to install, 13 to build, 9 to test, and room.
# Exit status: make test's.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
suite=${1:-trixie}
case "$suite" in *[!a-z0-9-]*|'') echo "check-fresh-debian: bad suite '$suite'" >&2; exit 2 ;; esac
root=${FRESH_ROOT:-/var/tmp/collabserve-fresh-$suite}
mirror=${MIRROR:-http://deb.debian.org/debian}
log=$root.log
[ "$(id -u)" = 0 ] || { echo "check-fresh-debian: needs root (chroot, mounts)" >&2; exit 2; }
command -v mmdebstrap >/dev/null || {
  echo "check-fresh-debian: needs mmdebstrap (apt-get install mmdebstrap)" >&2; exit 2; }
command -v unshare >/dev/null || { echo "check-fresh-debian: needs unshare (util-linux)" >&2; exit 2; }
case "$root" in /|/usr|/var|/var/tmp|/tmp) echo "check-fresh-debian: refusing FRESH_ROOT=$root" >&2; exit 2 ;; esac

say() { echo "check-fresh-debian: $*" | tee -a "$log" >&2; }
# This script's own mounts live in a private namespace and vanish with it; a root mounted by hand
# (chroot into a KEEP=1 root, say) would take the host's /proc and /dev with it on rm.
if [ -d "$root" ]; then
  if grep -q " $root/" /proc/mounts; then say "$root has mounts under it; unmount them first"; exit 2; fi
  rm -rf "$root"
fi
: >"$log"
t0=$SECONDS
say "making a $suite root in $root"
mmdebstrap --variant=apt --include=make,ca-certificates "$suite" "$root" "$mirror" >>"$log" 2>&1 || {
  say "mmdebstrap failed (see $log)"; exit 1; }
cp /etc/resolv.conf "$root/etc/resolv.conf"
# An installed system or a container runtime always provides /etc/hosts; a bookworm mmdebstrap root
# has none, and gRPC's resolver then cannot resolve "localhost" (the TLS tests' certificate name).
[ -e "$root/etc/hosts" ] || printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$root/etc/hosts"
# The site's own certificate authorities (a TLS-inspecting proxy's, say), as a machine on this
# network would have them: npm fetches over https and Node reads extra CAs only from
# NODE_EXTRA_CA_CERTS.
extra_env=()
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
  chroot "$root" update-ca-certificates >>"$log" 2>&1
  extra_env+=(NODE_EXTRA_CA_CERTS=/etc/ssl/certs/ca-certificates.crt)
fi
for v in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY; do
  [ -z "${!v:-}" ] || extra_env+=("$v=${!v}")
done

# A clone of the committed HEAD: no build trees, no node_modules, no uncommitted change.
git clone -q --no-hardlinks "$ROOT" "$root/src"
say "root ready in $((SECONDS - t0)) s; make test in $root/src (HEAD $(git -C "$ROOT" rev-parse --short HEAD))"

set +e
# Its own mount namespace: /proc, /sys, /dev and a fresh /dev/shm go away with it. `env -i`: none of
# this host's environment leaks in (OPENBLAS_CORETYPE, for one, changes which kernels OpenBLAS runs).
unshare --mount --fork bash -c '
  set -e
  r=$1 jobs=$2; shift 2
  for d in proc sys dev; do mount --rbind "/$d" "$r/$d"; mount --make-rslave "$r/$d"; done
  mount -t tmpfs shm "$r/dev/shm"
  exec chroot "$r" env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive "$@" bash -c "cd /src && make test JOBS=$jobs"' \
  check-fresh-debian "$root" "${JOBS:-$(nproc)}" "${extra_env[@]}" >>"$log" 2>&1
rc=$?
set -e
grep -E "tests passed|tests failed|\*\*\*Failed|Error [0-9]+" "$log" | tail -20 >&2 || true
say "make test on a fresh $suite root: exit status $rc after $(( (SECONDS - t0) / 60 )) min (log: $log)"
if [ "${KEEP:-0}" != 1 ]; then rm -rf "$root"; fi
exit $rc
