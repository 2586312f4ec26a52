#!/usr/bin/env bash
# Prints the Debian/Ubuntu packages that own the shared libraries the given executables load, one
# per line, so that a runtime image can install exactly those (the Dockerfile's `cuda` target, whose
# Ubuntu base names its packages differently from Debian's, e.g. libgrpc++1.51t64).
#   deploy/docker/runtime-packages.sh [--exclude DIR]... BINARY...
# Libraries under an --exclude DIR (e.g. /opt/libtorch, copied into the image as is) are skipped.
# Fails, naming the library, when one is not found or belongs to no package.
set -euo pipefail
excludes=()
while [ $# -gt 0 ] && [ "$1" = "--exclude" ]; do excludes+=("${2%/}/"); shift 2; done
[ $# -gt 0 ] || { echo "usage: $0 [--exclude DIR]... BINARY..." >&2; exit 2; }

owner() {  # package owning library path $1; tries the /usr-merged alias of the path too
  local f=$1 alt pkg
  for alt in "$f" "$(readlink -f "$f")" "${f#/usr}" "/usr$f"; do
    pkg=$(dpkg -S "$alt" 2>/dev/null | head -n1 | cut -d: -f1) || true
    [ -n "$pkg" ] && { echo "$pkg"; return 0; }
  done
  return 1
}

status=0
declare -A seen=()
for bin in "$@"; do
  [ -f "$bin" ] || { echo "runtime-packages: $bin: no such file" >&2; exit 1; }
  while read -r line; do
    case $line in
      *"not found"*) echo "runtime-packages: $bin needs ${line%% *}, which is not found" >&2; status=1; continue ;;
    esac
    lib=$(awk '/=>/ {print $3}' <<<"$line")
    [ -n "$lib" ] && [ "${lib#/}" != "$lib" ] || continue
    skip=0
    for e in "${excludes[@]}"; do case $lib in "$e"*) skip=1 ;; esac; done
    [ $skip = 1 ] && continue
    if pkg=$(owner "$lib"); then
      seen[$pkg]=1
    else
      echo "runtime-packages: $lib (needed by $bin) belongs to no package" >&2; status=1
    fi
  done < <(ldd "$bin")
done
[ $status = 0 ] || exit $status
printf '%s\n' "${!seen[@]}" | sort
