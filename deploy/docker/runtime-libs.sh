#!/usr/bin/env bash
# Carries the shared libraries a set of executables loads from an image's build stage into its
# runtime stage as files, without their packages' dependencies. Debian's libtorch1.13 depends on
# OpenCV, FFmpeg and Mesa (LLVM, GDAL) as packages, which the server never loads; installing the
# libraries' packages doubled the CPU image.
#
#   deploy/docker/runtime-libs.sh collect [--exclude DIR]... OUT BINARY...
#     Build stage. For every library in the binaries' ldd closure: the library, dereferenced and
#     named as the loader asks for it, into OUT/lib/; its package's copyright file into
#     OUT/doc/PACKAGE/copyright; one line "NAME<TAB>PACKAGE<TAB>VERSION" into OUT/libs.tsv.
#     Libraries under an --exclude DIR (the loader's path or the one it resolves to, under DIR or
#     the directory DIR resolves to) are skipped: /opt/libtorch/lib, copied into the image as is;
#     /usr/local/cuda, the CUDA toolkit's, which the CUDA runtime base image has. Fails, naming it,
#     when a library is not found, belongs to no package, or its package has no copyright file.
#
#   deploy/docker/runtime-libs.sh install [--root DIR] OUT DEST
#     Runtime stage. Copies into DEST the libraries of OUT whose package is not installed (the base
#     image's own libc, libstdc++, zlib ... are not shadowed) and their copyright files into
#     /usr/share/doc/PACKAGE/; lists what it copied (libs.tsv's lines: what the image carries outside
#     its package database) in /usr/share/collabserve/runtime-libs.tsv; registers DEST with the
#     loader (/etc/ld.so.conf.d/collabserve.conf, then ldconfig). With --root, all of these paths
#     (DEST and the package database too) are under DIR, and ldconfig is left out.
#
#   deploy/docker/runtime-libs.sh check [--root DIR] [--allow-missing NAME]... BINARY...
#     Fails, naming them, when a BINARY lacks a library, other than the NAMEs allowed (the CUDA
#     image's libcuda.so.1 comes from the host's driver). With --root, the loader also looks in the
#     directories DIR/etc/ld.so.conf.d/collabserve.conf names (under DIR).
set -euo pipefail
usage() {
  echo "usage: $0 collect [--exclude DIR]... OUT BINARY...  |  $0 install [--root DIR] OUT DEST  |  $0 check [--root DIR] [--allow-missing NAME]... BINARY..." >&2
  exit 2
}
die() { echo "runtime-libs: $*" >&2; exit 1; }
# Under / (or --root): what install writes and check reads.
readonly MANIFEST=usr/share/collabserve/runtime-libs.tsv LOADER_CONF=etc/ld.so.conf.d/collabserve.conf

collect() {
  local excludes=()
  while [ $# -gt 0 ] && [ "$1" = "--exclude" ]; do
    excludes+=("${2%/}/")
    [ ! -e "$2" ] || excludes+=("$(readlink -f "$2")/")
    shift 2
  done
  [ $# -ge 2 ] || usage
  local out=$1; shift
  check_libs "$@" || exit 1
  # Loader name -> resolved path, over all binaries.
  local -A path_of=()
  local status=0 bin line name arrow lib
  for bin in "$@"; do
    while read -r line; do
      read -r name arrow lib _ <<<"$line"
      [ "$arrow" = "=>" ] && [ "${lib#/}" != "$lib" ] || continue
      path_of[$name]=$lib
    done < <(ldd "$bin")
  done
  # Each library resolved once: left out when its path or its target is under an --exclude DIR;
  # else one dpkg -S call for all of them (it reads its whole database per call), trying each
  # path's /usr-merged alias and its symlink target as well (libblas.so.3 is an alternatives link).
  local -A aliases_of=() candidates=() owner_of=() version_of=()
  local real e alt pkg file
  for name in "${!path_of[@]}"; do
    lib=${path_of[$name]}
    real=$(readlink -f "$lib")
    for e in "${excludes[@]}"; do
      case $lib in "$e"*) unset "path_of[$name]"; continue 2 ;; esac
      case $real in "$e"*) unset "path_of[$name]"; continue 2 ;; esac
    done
    aliases_of[$lib]="$lib $real ${lib#/usr} /usr$lib"
    for alt in ${aliases_of[$lib]}; do candidates[$alt]=1; done
  done
  if [ ${#candidates[@]} -gt 0 ]; then
    while IFS= read -r line; do
      pkg=${line%%: *}; file=${line#*: }
      pkg=${pkg%%,*}; owner_of[$file]=${pkg%%:*}
    done < <(dpkg -S "${!candidates[@]}" 2>/dev/null | grep -v '^diversion ' || true)
  fi
  mkdir -p "$out/lib" "$out/doc"
  : >"$out/libs.tsv"
  local found
  for name in $(printf '%s\n' "${!path_of[@]}" | sort); do
    lib=${path_of[$name]}
    found=""
    for alt in ${aliases_of[$lib]}; do
      [ -n "${owner_of[$alt]:-}" ] && { found=${owner_of[$alt]}; break; }
    done
    if [ -z "$found" ]; then echo "runtime-libs: $lib belongs to no package" >&2; status=1; continue; fi
    if [ -z "${version_of[$found]:-}" ]; then
      version_of[$found]=$(dpkg-query -W -f='${Version}' "$found")
      [ -f "/usr/share/doc/$found/copyright" ] || { echo "runtime-libs: $found (of $lib) has no /usr/share/doc/$found/copyright" >&2; status=1; continue; }
      mkdir -p "$out/doc/$found"
      cp -L "/usr/share/doc/$found/copyright" "$out/doc/$found/copyright"
    fi
    cp -L "$lib" "$out/lib/$name"
    printf '%s\t%s\t%s\n' "$name" "$found" "${version_of[$found]}" >>"$out/libs.tsv"
  done
  exit $status
}

install_libs() {
  local root=""
  if [ $# -gt 0 ] && [ "$1" = "--root" ]; then root=${2%/}; shift 2; fi
  [ $# -eq 2 ] || usage
  local out=$1 dest=${2%/}
  [ -f "$out/libs.tsv" ] || die "$out/libs.tsv: no such file (run '$0 collect' first)"
  case $dest in /?*) ;; *) die "$dest: DEST must be an absolute path" ;; esac
  local admin=()
  [ -z "$root" ] || admin=(--admindir="$root/var/lib/dpkg")
  local docdir=$root/usr/share/doc manifest=$root/$MANIFEST conf=$root/$LOADER_CONF
  mkdir -p "$root$dest" "${manifest%/*}" "${conf%/*}"
  local name pkg version copied=0 listed=0
  : >"$manifest.tmp"
  while IFS=$'\t' read -r name pkg version; do
    [ -n "$name" ] || continue
    listed=$((listed + 1))
    if dpkg-query "${admin[@]}" -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then continue; fi
    [ -f "$out/lib/$name" ] || die "$out/lib/$name: listed in libs.tsv but missing"
    cp "$out/lib/$name" "$root$dest/$name"
    if [ ! -e "$docdir/$pkg/copyright" ]; then
      mkdir -p "$docdir/$pkg"
      cp "$out/doc/$pkg/copyright" "$docdir/$pkg/copyright"
    fi
    printf '%s\t%s\t%s\n' "$name" "$pkg" "$version" >>"$manifest.tmp"
    copied=$((copied + 1))
  done <"$out/libs.tsv"
  mv "$manifest.tmp" "$manifest"
  echo "$dest" >"$conf"
  [ -n "$root" ] || ldconfig
  echo "runtime-libs: $copied of $listed libraries copied into $dest; the others' packages are installed"
}

check_libs() {
  local root="" allowed=" "
  while [ $# -gt 0 ]; do
    case $1 in
      --root) root=${2%/}; shift 2 ;;
      --allow-missing) allowed+="$2 "; shift 2 ;;
      *) break ;;
    esac
  done
  [ $# -ge 1 ] || usage
  local path="${LD_LIBRARY_PATH:-}" dir
  if [ -n "$root" ] && [ -f "$root/$LOADER_CONF" ]; then
    while read -r dir; do [ -z "$dir" ] || path="$root$dir${path:+:$path}"; done <"$root/$LOADER_CONF"
  fi
  local status=0 bin line lib
  for bin in "$@"; do
    [ -f "$bin" ] || die "$bin: no such file"
    while read -r line; do
      case $line in *"not found"*) ;; *) continue ;; esac
      lib=${line%% *}
      case $allowed in *" $lib "*) continue ;; esac
      echo "runtime-libs: $bin needs $lib, which is not found" >&2
      status=1
    done < <(LD_LIBRARY_PATH=$path ldd "$bin")
  done
  return $status
}

[ $# -gt 0 ] || usage
mode=$1; shift
case $mode in
  collect) collect "$@" ;;
  install) install_libs "$@" ;;
  check) check_libs "$@" ;;
  *) usage ;;
esac
