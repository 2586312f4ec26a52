#!/usr/bin/env bash
# Compiles collabserve's LibTorch code against LibTorch 2.x headers, without a GPU or a LibTorch 2.x
# install: every translation unit of BUILD_DIR that includes LibTorch is compiled with
# -fsyntax-only (its own flags, -Wall -Wextra included) with the 2.x headers ahead of the system's
# 1.13 ones. The CUDA image and scripts/gpu-check.sh build against the official LibTorch 2.x; this
# catches an API that 2.x removed or changed before a GPU machine's minutes are spent on it. The
# CUDA code goes through torch::cuda's run-time dispatch, so CPU headers cover it, except the
# translation units that test COLLABSERVE_WITH_CUDA (CUDA graphs and the GPU memory reading:
# ATen/cuda and c10/cuda headers, set where LibTorch has CUDA): those are compiled a second time
# with it set, against the CUDA toolkit's headers.
#
#   scripts/check-libtorch2.sh [BUILD_DIR=build] [PATH...]
#     PATH: only sources under these paths of the repository (e.g. `server`); default all.
#   Environment:
#     LIBTORCH2_INCLUDE  a LibTorch 2.x `include` directory to check against (an official LibTorch
#                        zip's libtorch/include); default: Debian's libtorch-dev of LIBTORCH2_SUITE,
#                        downloaded once into BUILD_DIR/libtorch2 (libtorch2-SUITE for
#                        another suite; a private apt lists directory:
#                        the system's apt state is not touched; nothing is installed)
#     LIBTORCH2_SUITE    Debian suite to take libtorch-dev from (trixie: LibTorch 2.6; sid: 2.14.1
#                        on 2026-12-05, with CUDA 12.4 headers)
#     CUDA_INCLUDE       the CUDA toolkit's `include` directory (cuda_runtime_api.h); default: Debian's
#                        nvidia-cuda-dev of LIBTORCH2_SUITE (non-free; CUDA 12.4 in trixie), its
#                        headers kept in that folder's cuda-include
#     CXX_STANDARD       17 or 20: compile as that C++ standard instead of the build's own. With 20
#                        (what CMakeLists.txt chooses for LibTorch 2.13 and later) the translation
#                        units without LibTorch are compiled too: the whole build must take C++20
#     JOBS               parallel compilations (nproc)
# Exit status 1 if a translation unit does not compile; its first errors are printed.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD_DIR=$(cd "${1:-build}" && pwd)
shift || true
SUITE=${LIBTORCH2_SUITE:-trixie}
# Each suite's downloads in their own folder of BUILD_DIR (trixie's in libtorch2/).
cache_name=libtorch2; [[ $SUITE == trixie ]] || cache_name=libtorch2-$SUITE
JOBS=${JOBS:-$(nproc)}
STD=${CXX_STANDARD:-}
[[ -z $STD || $STD == 17 || $STD == 20 ]] || { echo "check-libtorch2: CXX_STANDARD must be 17 or 20, not '$STD'" >&2; exit 2; }

[[ -f $BUILD_DIR/CMakeCache.txt ]] || { echo "check-libtorch2: $BUILD_DIR is not a configured build (make configure)" >&2; exit 2; }

include=${LIBTORCH2_INCLUDE:-}
if [[ -z $include ]]; then
  cache=$BUILD_DIR/$cache_name
  include=$cache/include
  if [[ ! -f $include/torch/csrc/api/include/torch/version.h ]]; then
    echo "check-libtorch2: fetching libtorch-dev from Debian $SUITE into $cache"
    rm -rf "$cache" && mkdir -p "$cache/lists/partial" "$cache/archives/partial"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $SUITE main" \
      > "$cache/sources.list"
    apt_opts=(-o Dir::Etc::SourceList="$cache/sources.list" -o Dir::Etc::SourceParts=/dev/null
              -o Dir::State::Lists="$cache/lists" -o Dir::Cache="$cache" -o Acquire::Languages=none
              -o Debug::NoLocking=1)
    if ! apt-get "${apt_opts[@]}" update > "$cache/apt.log" 2>&1; then
      cat "$cache/apt.log" >&2; echo "check-libtorch2: apt-get update for $SUITE failed" >&2; exit 2
    fi
    if ! (cd "$cache" && apt-get "${apt_opts[@]}" download libtorch-dev >> "$cache/apt.log" 2>&1); then
      cat "$cache/apt.log" >&2; echo "check-libtorch2: cannot download libtorch-dev from $SUITE" >&2; exit 2
    fi
    dpkg-deb -x "$cache"/libtorch-dev_*.deb "$cache/root"
    mv "$cache/root/usr/include" "$include"
    rm -rf "$cache/root" "$cache"/libtorch-dev_*.deb "$cache/lists"
  fi
fi
# The CUDA toolkit's headers, for the translation units that test COLLABSERVE_WITH_CUDA.
cuda_include=${CUDA_INCLUDE:-}
if [[ -z $cuda_include ]] && git -C "$ROOT" grep --untracked -q -l COLLABSERVE_WITH_CUDA -- '*.cc' '*.h'; then
  cache=$BUILD_DIR/$cache_name
  cuda_include=$cache/cuda-include
  if [[ ! -f $cuda_include/cuda_runtime_api.h ]]; then
    echo "check-libtorch2: fetching the CUDA headers (nvidia-cuda-dev) from Debian $SUITE into $cuda_include"
    cdir=$cache/cuda-apt
    rm -rf "$cdir" "$cuda_include" && mkdir -p "$cdir/lists/partial" "$cdir/archives/partial"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $SUITE non-free" \
      > "$cdir/sources.list"
    apt_opts=(-o Dir::Etc::SourceList="$cdir/sources.list" -o Dir::Etc::SourceParts=/dev/null
              -o Dir::State::Lists="$cdir/lists" -o Dir::Cache="$cdir" -o Acquire::Languages=none
              -o Debug::NoLocking=1)
    if ! apt-get "${apt_opts[@]}" update > "$cdir/apt.log" 2>&1 ||
       ! (cd "$cdir" && apt-get "${apt_opts[@]}" download nvidia-cuda-dev >> "$cdir/apt.log" 2>&1); then
      cat "$cdir/apt.log" >&2; echo "check-libtorch2: cannot download nvidia-cuda-dev from $SUITE non-free" >&2; exit 2
    fi
    mkdir -p "$cdir/root"
    dpkg-deb --fsys-tarfile "$cdir"/nvidia-cuda-dev_*.deb | tar -x -C "$cdir/root" --wildcards './usr/include/*'
    mv "$cdir/root/usr/include" "$cuda_include"
    rm -rf "$cdir"
  fi
fi
[[ -z $cuda_include || -f $cuda_include/cuda_runtime_api.h ]] ||
  { echo "check-libtorch2: $cuda_include/cuda_runtime_api.h is missing: not the CUDA toolkit's include directory" >&2; exit 2; }

api=$include/torch/csrc/api/include
[[ -f $api/torch/version.h ]] || { echo "check-libtorch2: $api/torch/version.h is missing: not a LibTorch include directory" >&2; exit 2; }
# The version string: in torch/version.h, or (2.14 at least) torch/headeronly/version.h, which
# it includes.
version_files=("$api/torch/version.h")
[[ -f $include/torch/headeronly/version.h ]] && version_files+=("$include/torch/headeronly/version.h")
version=$(sed -n 's/^ *"\([0-9][0-9.]*\)".*/\1/p' "${version_files[@]}" | head -1)

# The build's own compile commands (CMakeLists.txt exports them).
[[ -f $BUILD_DIR/compile_commands.json ]] || cmake -DCMAKE_EXPORT_COMPILE_COMMANDS=ON "$BUILD_DIR" > /dev/null

work=$(mktemp -d "${TMPDIR:-/tmp}/collabserve-libtorch2-XXXXXX")
trap 'rm -rf "$work"' EXIT
/usr/bin/python3 - "$BUILD_DIR" "$ROOT" "$include" "$api" "$work" "$STD" "$cuda_include" "$@" <<'EOF'
import json, os, shlex, sys
build, root, include, api, work, std, cuda_include, *paths = sys.argv[1:]
commands = os.path.join(build, 'compile_commands.json')
paths = [os.path.join(root, p.rstrip('/')) for p in paths]
n = 0
with open(os.path.join(work, 'jobs'), 'w') as jobs:
    for e in json.load(open(commands)):
        args = e.get('arguments') or shlex.split(e['command'])
        if std != '20' and not any('torch/csrc/api/include' in a for a in args):
            continue  # no LibTorch in this target (checked only for the C++20 build)
        src = os.path.realpath(os.path.join(e['directory'], e['file']))
        if not src.startswith(root + os.sep) or src.startswith(os.path.realpath(build) + os.sep):
            continue  # generated sources (embedded data) of the build tree
        if paths and not any(src == p or src.startswith(p + os.sep) for p in paths):
            continue
        out, skip = [], False
        for a in args:
            if skip:
                skip = False
            elif a == '-o':
                skip = True
            elif not (std and a.startswith('-std=')):
                out.append(a)
        if std:
            out.append('-std=c++' + std)  # the last -std wins
        out[1:1] = ['-fsyntax-only', '-isystem', api, '-isystem', include]
        rel = os.path.relpath(src, root)
        variants = [(rel, out)]
        if cuda_include and 'COLLABSERVE_WITH_CUDA' in open(src, errors='replace').read():
            # As a CUDA build compiles it. The CPU package lacks the generated
            # c10/cuda/impl/cuda_cmake_macros.h (it only names the export macro), which c10 lets a
            # build skip.
            variants.append((rel + ' (COLLABSERVE_WITH_CUDA)',
                             out[:1] + ['-isystem', cuda_include, '-DCOLLABSERVE_WITH_CUDA=1',
                                        '-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE'] + out[1:]))
        for name, cmd in variants:
            log = os.path.join(work, name.replace('/', '_').replace(' ', '_') + '.log')
            line = f"cd {shlex.quote(e['directory'])} && {shlex.join(cmd)} > {shlex.quote(log)} 2>&1 || echo {shlex.quote(name)}"
            jobs.write(line.replace('\0', '') + '\0')
            n += 1
print(n, file=open(os.path.join(work, 'count'), 'w'))
EOF
count=$(cat "$work/count")
((count > 0)) || { echo "check-libtorch2: no LibTorch translation unit under ${*:-the repository}" >&2; exit 2; }
as=${STD:+ as C++$STD}
echo "check-libtorch2: compiling $count translation units$as against LibTorch $version ($include), $JOBS at a time"
start=$SECONDS
xargs -0 -P "$JOBS" -n 1 bash -c < "$work/jobs" > "$work/failed" || true
if [[ -s $work/failed ]]; then
  while read -r rel; do
    echo "---- $rel does not compile$as against LibTorch $version:"
    head -30 "$work/$(echo "$rel" | tr '/ ' __).log"
  done < "$work/failed"
  echo "check-libtorch2: $(wc -l < "$work/failed") of $count translation units fail$as against LibTorch $version" >&2
  exit 1
fi
warned=$( (grep -l "warning:" "$work"/*.log 2>/dev/null || true) | wc -l)
echo "check-libtorch2: all $count compile$as against LibTorch $version ($((SECONDS - start)) s; $warned with warnings)"
if ((warned > 0)); then grep -h -m 3 "warning:" "$work"/*.log | head -20; fi
