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

# Resolved library paths, then one dpkg -S call for all of them (it reads its whole database per
# call), trying each path's /usr-merged alias and its symlink target as well.
libs=()
status=0
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
    [ $skip = 1 ] || libs+=("$lib")
  done < <(ldd "$bin")
done
[ $status = 0 ] || exit $status
[ ${#libs[@]} -gt 0 ] || exit 0
declare -A candidates=()
for lib in "${libs[@]}"; do
  for alt in "$lib" "$(readlink -f "$lib")" "${lib#/usr}" "/usr$lib"; do candidates[$alt]=1; done
done
declare -A owner_of=()
while IFS= read -r line; do
  pkg=${line%%: *}; file=${line#*: }
  pkg=${pkg%%,*}; owner_of[$file]=${pkg%%:*}
done < <(dpkg -S "${!candidates[@]}" 2>/dev/null | grep -v '^diversion ' || true)
declare -A seen=()
for lib in "${libs[@]}"; do
  found=""
  for alt in "$lib" "$(readlink -f "$lib")" "${lib#/usr}" "/usr$lib"; do
    [ -n "${owner_of[$alt]:-}" ] && { found=${owner_of[$alt]}; break; }
  done
  if [ -n "$found" ]; then seen[$found]=1; else echo "runtime-packages: $lib belongs to no package" >&2; status=1; fi
done
[ $status = 0 ] || exit $status
printf '%s\n' "${!seen[@]}" | sort
