#!/usr/bin/env bash
# The GPU path in one command: builds the engine, the compression, collabserve-model, the engine
# and CP tests and the engine bench without gRPC (-DCOLLABSERVE_WITH_GRPC=OFF) against the LibTorch
# of the Python that has torch, runs the parity tests, measures the engine against PyTorch eager on
# the same weights and inputs, times the compression, and prints one summary table.
#
#   scripts/gpu-check.sh [--device cuda|cpu] [--quick] [--jobs N] [--build-dir DIR] [--deps DIR]
#                        [--bare] [--time-limit S]
#   scripts/gpu-check.sh --pack-deps DIR
#
#   --device cuda (default when torch sees a GPU): the CUDA parity tests (float32 within 1e-4 of the
#            Python reference, float16 / bfloat16 within the bounds engine_reference_test states,
#            standard and collaborative models), the bench on the GPU in float16 and float32
#            (TF32 off) against PyTorch eager with scaled-dot-product attention, batch
#            {1, 8, 32, 128} x sequence {16, 128, 512}, standard and D~ = D_k/2, D_k/4, and the
#            BERT-base compression at D~ = 384 with --device cuda, plain and activation-aware
#            (1024 calibration texts; that one also on the CPU) (the engine with CUDA graphs for
#            passes of up to 4096 tokens, as served, and its standard model once more without them,
#            float16 only); then each engine's host time by
#            operator (engine_bench --op_profile, pytorch_bench.py --op_profile) and the kernels
#            the GPU ran (--gpu_kernels) at batch {1, 128} x sequence {16, 128}; last, a
#            collaborative layer's attention written five ways, under each SDPA backend, against the
#            standard layer's, each checked against the formula (bench/engine/attention_variants.py).
#            Before the profiles, the engine's collaborative model at D~ = D_k/4 in each of those
#            ways (EngineOptions::collab_attention) against the standard model, whole passes at
#            batch {8, 32} x sequence {128, 512}, unpadded and padded batches (--ragged).
#   --device cpu: the same steps on the CPU, on fewer points (batch {1, 8} x sequence {16, 128}).
#   --quick: the mini model (4 x 256) on batch {1, 2} x sequence {16}, the reference tests only:
#            what `make test` runs (ctest gpu_check_cpu) so that this script cannot rot.
#   --pack-deps DIR: on a Debian machine with the project's packages (scripts/install-deps.sh),
#            copies what the build needs besides LibTorch (abseil, glog + gflags + libunwind,
#            GoogleTest, nlohmann-json: headers, libraries, CMake package files; ~10 MB) into DIR,
#            laid out as under /usr, and stops. For a GPU machine whose image has PyTorch but none of
#            these (carry DIR there).
#   --deps DIR: a folder made by --pack-deps: found by CMake first, its libraries on the run path.
#   --bare: packs them into BUILD_DIR/deps (unless --deps names a packed folder) and runs the check
#            with --deps in a mount namespace where Debian's copies (headers, CMake files,
#            libraries) and jemalloc are hidden: what a GPU image with PyTorch alone offers, checked
#            on a Debian machine (CI runs the --quick form). Its own build dir (default
#            build-gpu-bare/): a tree configured with the system's copies would keep their paths.
#            Needs unshare (util-linux) and root, or unprivileged user namespaces and overlayfs.
#   --time-limit S: finish within S seconds of the start (a lent GPU machine's minutes): a step
#            that can no longer start in time is skipped, the bench's time per grid point and model
#            (3 s on a GPU) shrinks to fit what is left, and the exit status is 124 when the limit
#            cut a step.
#   On SIGTERM or SIGINT (what timeout(1) sends) the script writes the summary of what finished,
#   names the step it interrupted, and exits with 143 (130).
#
# Environment: OUT (where results go; default BUILD_DIR/gpu-check), PYTHON (an interpreter with
# torch; default: the first of python3, /usr/bin/python3 that imports it). Uses ccache when present
# (the default build dir, build-gpu-check/, sits beside build/ so that the cache's relative paths
# match and the objects the normal build compiled are reused).
# Needs: CMake >= 3.18, a C++17 compiler (C++20 for LibTorch 2.13 and later), abseil,
# nlohmann-json, glog and GoogleTest where CMake finds them (scripts/install-deps.sh installs
# them on Debian; or --deps), and torch in PYTHON. Exit status: non-zero when a step fails (124
# when --time-limit cut one, 143 / 130 when a signal did); the summary says which.
set -euo pipefail
caller=$PWD
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
absolute() { case "$1" in ''|/*) printf '%s' "$1" ;; *) printf '%s/%s' "$caller" "$1" ;; esac; }

args=("$@")
device= quick=0 jobs=$(nproc) build_dir= deps= pack_deps= bare=0 time_limit=0
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=$2; shift 2 ;;
    --device=*) device=${1#*=}; shift ;;
    --quick) quick=1; shift ;;
    --jobs) jobs=$2; shift 2 ;;
    --jobs=*) jobs=${1#*=}; shift ;;
    --build-dir) build_dir=$2; shift 2 ;;
    --build-dir=*) build_dir=${1#*=}; shift ;;
    --deps) deps=$2; shift 2 ;;
    --deps=*) deps=${1#*=}; shift ;;
    --pack-deps) pack_deps=$2; shift 2 ;;
    --pack-deps=*) pack_deps=${1#*=}; shift ;;
    --bare) bare=1; shift ;;
    --time-limit) time_limit=$2; shift 2 ;;
    --time-limit=*) time_limit=${1#*=}; shift ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0"; exit 0 ;;  # the comment above
    *) echo "gpu-check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

log() { echo "gpu-check: $*" >&2; }
# Folders named on the command line are relative to where the script was called from.
build_dir=$(absolute "$build_dir") deps=$(absolute "$deps") pack_deps=$(absolute "$pack_deps")
[ -z "$pack_deps" ] || [ $bare = 0 ] || { log "--pack-deps only packs: run --bare separately"; exit 2; }
packed_stamp=.gpu-check-deps  # written last by --pack-deps: the folder is complete
multiarch=$( (gcc -print-multiarch || c++ -print-multiarch) 2>/dev/null || echo x86_64-linux-gnu)
[ -n "$multiarch" ] || multiarch=x86_64-linux-gnu

# What --pack-deps carries and --bare hides: folders, and libraries of /usr/lib/<arch> (globs).
lib=/usr/lib/$multiarch
dep_dirs=(/usr/include/absl /usr/include/gtest /usr/include/gmock /usr/include/glog /usr/include/gflags
          /usr/include/nlohmann "$lib/cmake/absl" "$lib/cmake/GTest" "$lib/cmake/glog"
          "$lib/cmake/gflags" /usr/share/cmake/nlohmann_json)
dep_libs=('libabsl_*.so*' 'libgtest*.a' 'libgmock*.a' 'libglog*' 'libgflags*' 'libunwind.so*')

# --- --pack-deps: the non-torch C++ dependencies, for a machine that lacks them -------------
if [ -n "$pack_deps" ]; then
  paths=("${dep_dirs[@]}")
  shopt -s nullglob
  for g in "${dep_libs[@]}"; do paths+=("$lib"/$g); done
  for p in "${paths[@]}"; do
    [ -e "$p" ] || { log "--pack-deps: $p is missing (run scripts/install-deps.sh)"; exit 1; }
  done
  mkdir -p "$pack_deps"
  pack_deps=$(cd "$pack_deps" && pwd)
  rm -f "$pack_deps/$packed_stamp"
  (cd / && cp -a --parents "${paths[@]#/}" "$pack_deps")  # relative: cp --parents rejects /usr/... here
  echo "packed from $(hostname) on $(date -u +%FT%TZ)" > "$pack_deps/$packed_stamp"
  log "packed $(du -sh "$pack_deps" | cut -f1) into $pack_deps (use it with --deps $pack_deps)"
  exit 0
fi

# --- --bare: this script again, without Debian's copies of what --deps carries ----------------
if [ $bare = 1 ] && [ -z "${GPU_CHECK_BARE:-}" ]; then
  command -v unshare >/dev/null || { log "--bare needs unshare (util-linux)"; exit 2; }
  userns=()
  [ "$(id -u)" = 0 ] || userns=(--map-root-user)
  unshare --mount "${userns[@]}" true 2>/dev/null || {
    log "--bare: cannot make a mount namespace here (unshare --mount ${userns[*]}: needs root, or" \
        "unprivileged user namespaces)"; exit 2; }
  build_dir=${build_dir:-$ROOT/build-gpu-bare}
  case "$build_dir" in *[,:]*) log "--bare: the build dir's path may not hold ',' or ':' (overlayfs options)"; exit 2 ;; esac
  mkdir -p "$build_dir" && build_dir=$(cd "$build_dir" && pwd)
  if [ -z "$deps" ]; then
    deps=$build_dir/deps
    [ -f "$deps/$packed_stamp" ] || { rm -rf "$deps"; "$ROOT/scripts/gpu-check.sh" --pack-deps "$deps"; }
  fi
  mkdir -p "$build_dir/bare-mounts"  # empty here; a tmpfs of whiteouts inside the namespace
  log "--bare: Debian's abseil, glog, gflags, libunwind, GoogleTest, nlohmann-json and jemalloc hidden"
  # Besides what is packed: glog's find modules and GoogleTest's sources, every libunwind library
  # and header (glog's CMake config looks for them), jemalloc (the benches link it when found).
  export GPU_CHECK_HIDE_DIRS="${dep_dirs[*]} /usr/share/glog /usr/src/googletest"
  export GPU_CHECK_HIDE_LIBS="${dep_libs[*]} libgtest* libgmock* libunwind* libjemalloc*"
  # Debian's python3-torch links glog and gflags: the packed ones serve it too.
  export GPU_CHECK_BARE=1 LD_LIBRARY_PATH="$deps/usr/lib/$multiarch${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  exec unshare --mount "${userns[@]}" bash -c '
    set -euo pipefail
    shopt -s nullglob
    arch=$1 wo=$2; shift 2
    mount -t tmpfs gpu-check-bare "$wo"
    mkdir "$wo/lib" "$wo/include"
    # Whiteouts (0/0 character devices) in the top layer of an overlay hide the files below them.
    (cd "/usr/lib/$arch" && for f in $GPU_CHECK_HIDE_LIBS; do
       [ -e "$wo/lib/$f" ] || mknod "$wo/lib/$f" c 0 0; done)
    (cd "/usr/include/$arch" && for f in libunwind*.h; do mknod "$wo/include/$f" c 0 0; done)
    for d in lib include; do
      mount -t overlay gpu-check-bare -o "lowerdir=$wo/$d:/usr/$d/$arch" "/usr/$d/$arch" || {
        echo "gpu-check: --bare: cannot mount an overlay on /usr/$d/$arch (overlayfs in a user" \
             "namespace needs Linux 5.11 or later)" >&2; exit 2; }
    done
    for d in $GPU_CHECK_HIDE_DIRS; do
      if [ -d "$d" ]; then mount -t tmpfs gpu-check-bare "$d"; fi
    done
    exec "$@"' gpu-check-bare "$multiarch" "$build_dir/bare-mounts" \
    "$ROOT/scripts/gpu-check.sh" "${args[@]}" --deps "$deps" --build-dir "$build_dir"
fi

# --- the Python with torch, and what its torch is ---------------------------------------------
# The reference (tests/reference/bert_reference.py) and the PyTorch baseline need numpy too.
if [ -z "${PYTHON:-}" ]; then
  for p in python3 /usr/bin/python3; do
    if command -v "$p" >/dev/null && "$p" -c 'import torch, numpy' 2>/dev/null; then PYTHON=$(command -v "$p"); break; fi
  done
  [ -n "${PYTHON:-}" ] || { log "no Python with torch and numpy found (set PYTHON)"; exit 1; }
elif ! "$PYTHON" -c 'import torch, numpy' 2>/dev/null; then
  log "$PYTHON cannot import torch and numpy"; exit 1
fi
# Everything asked of torch, in one import (a CUDA torch takes seconds to import).
read -r torch_version cuda_ok torch_cmake torch_abi torch_cuda gpu_arch has_sdpa <<<"$("$PYTHON" -c '
import torch
ok = torch.cuda.is_available()
arch = "%d.%d" % torch.cuda.get_device_capability(0) if ok else "-"
print(torch.__version__, int(ok), torch.utils.cmake_prefix_path,
      int(torch._C._GLIBCXX_USE_CXX11_ABI), torch.version.cuda or "-", arch,
      int(hasattr(torch.nn.functional, "scaled_dot_product_attention")))')"
if [ -z "$device" ]; then
  device=cpu
  [ "$cuda_ok" = 1 ] && device=cuda
fi
case "$device" in
  cpu) ;;
  cuda|cuda:*) [ "$cuda_ok" = 1 ] || { log "--device $device, but torch $torch_version sees no GPU"; exit 1; } ;;
  *) log "--device must be cpu or cuda[:N], not '$device'"; exit 2 ;;
esac

# A CUDA build of torch: its CMake package (Caffe2's public/cuda.cmake) needs the CUDA toolkit
# (nvcc and the CUDA headers and libraries), or configure stops with "Your installed Caffe2 version
# uses CUDA but I cannot find the CUDA libraries". Found on PATH, under CUDA_HOME / CUDA_PATH,
# /usr/local/cuda*, or a pip package of the Python (nvidia-cuda-nvcc); the kernels' architecture is
# the GPU's own (TORCH_CUDA_ARCH_LIST), so that torch's CMake does not probe for it.
nvcc=
if [ "$torch_cuda" != - ]; then
  for c in "$(command -v nvcc || true)" "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" "${CUDA_PATH:+$CUDA_PATH/bin/nvcc}" \
           /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc \
           "$("$PYTHON" -c 'import glob, os, nvidia; print(next(iter(sorted(glob.glob(os.path.join(list(nvidia.__path__)[0], "*", "bin", "nvcc")))), ""))' 2>/dev/null)"; do
    if [ -n "$c" ] && [ -x "$c" ]; then nvcc=$c; break; fi
  done
  if [ -n "$nvcc" ]; then
    cuda_root=$(cd "$(dirname "$nvcc")/.." && pwd)
    export PATH="$cuda_root/bin:$PATH" CUDACXX="$nvcc" CUDAToolkit_ROOT="$cuda_root" CUDA_HOME="$cuda_root"
    [ "$gpu_arch" = - ] || export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$gpu_arch}"
  else
    log "warning: torch $torch_version is built for CUDA $torch_cuda but no nvcc was found (PATH," \
        "CUDA_HOME, /usr/local/cuda): torch's CMake package will not configure without the toolkit"
  fi
fi
nvcc_version=$([ -n "$nvcc" ] && "$nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p' | head -1 || true)

build_dir=${build_dir:-$ROOT/build-gpu-check}
OUT=${OUT:-$build_dir/gpu-check}
mkdir -p "$OUT"
summary=$OUT/summary.md
rm -f "$summary" "$OUT"/*.tsv "$OUT"/compress-*.json  # no figures from an earlier run
case "$time_limit" in ''|*[!0-9]*) log "--time-limit must be whole seconds, not '$time_limit'"; exit 2 ;; esac
status=()  # "| step | outcome | time |" rows for the summary
current= current_t0=0 notes=()
# Seconds left before --time-limit (a large number without one).
left() { if [ "$time_limit" -gt 0 ]; then echo $((time_limit - SECONDS)); else echo 1000000; fi; }
run_step() {  # name, command...: runs it with its output in $OUT/<name>.log; records the outcome
  local name=$1; shift
  # A step needs a few seconds at least: one that would start in the last 10 is not begun.
  if [ "$(left)" -lt 10 ]; then
    status+=("| $name | **skipped**: --time-limit $time_limit s reached | 0 s |")
    log "$name: skipped, the time limit ($time_limit s) is reached"
    return 1
  fi
  log "$name ..."
  current=$name current_t0=$SECONDS
  if "$@" >"$OUT/$name.log" 2>&1; then
    # A CUDA case skips (exit 0) when the binary sees no device: on a GPU run that is a failure of
    # the run, not an "ok" (LibTorch's CUDA library not loaded, or CUDA failing to start in C++).
    if [ "${device:-cpu}" != cpu ] && [[ $name == test-* ]] &&
       grep -qE 'no CUDA device \(scripts/gpu-check.sh runs this\)|^no GPU$' "$OUT/$name.log"; then
      status+=("| $name | **CUDA cases skipped**: the binary saw no device (see $name.log) | $((SECONDS - current_t0)) s |")
      current=
      return 1
    fi
    status+=("| $name | ok | $((SECONDS - current_t0)) s |")
  else
    status+=("| $name | **FAILED** (see $name.log) | $((SECONDS - current_t0)) s |")
    tail -20 "$OUT/$name.log" >&2
    current=
    return 1
  fi
  current=
}
failed=0

# --- summary ----------------------------------------------------------------------------------
write_summary() {
  local -; set +e  # whatever failed, the summary is written
{
  echo "# collabserve GPU check ($device, $(date -u +'%Y-%m-%d %H:%M UTC'))"
  echo
  cxx_std=$(sed -n 's/^-- \(C++[0-9]*\) (LibTorch .*/\1/p' "$OUT/configure.log" 2>/dev/null | tail -1 || true)
  echo "torch $torch_version ($PYTHON), CUDA available: $cuda_ok (torch's CUDA $torch_cuda, nvcc" \
       "${nvcc_version:-none}, arch $gpu_arch), C++11 ABI: $torch_abi," \
       "${cxx_std:-C++ standard unknown}; model preset ${preset:-(not chosen yet)}"
  [ "$device" != cpu ] && command -v nvidia-smi >/dev/null && \
    echo "GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
  echo
  echo "| step | result | time |"
  echo "|---|---|---|"
  printf '%s\n' "${status[@]}"
  [ ${#notes[@]} = 0 ] || { echo; printf '%s\n' "${notes[@]}"; }
  echo
  grep -h '^\[ cuda' "$OUT"/test-engine_reference_test.log "$OUT"/test-collaborative_test.log 2>/dev/null |
    sed 's/^/    /' || true
  for dt in ${dtypes:-}; do
    [ -f "$OUT/engine-$dt.tsv" ] || continue
    echo
    ng=$OUT/engine-nographs-$dt.tsv
    ng_run= ng_log=
    [ -f "$ng" ] && ng_run="; the standard model without CUDA graphs" ng_log=" and engine-nographs-$dt.log"
    echo "Engine vs PyTorch eager, $dt, seq/s; each collaborative model against the standard one," \
         "same run$ng_run (every figure in engine-$dt.log$ng_log):"
    echo
    # engine-DT.tsv: batch, seq, seq/s, runs, CPU ms, then one column per collaborative model.
    awk -F'\t' -v has_ng="$([ -f "$ng" ] && echo 1 || echo 0)" '
      FILENAME == ARGV[1] { if ($1 !~ /^#/) py[$1 "x" $2] = $3; next }
      FILENAME == ARGV[2] { if ($1 !~ /^#/) eager[$1 "x" $2] = $3; next }
      $1 ~ /^#/ { head = "| batch x seq | collabserve | PyTorch | ratio |"; rule = "|---|---|---|---|";
        for (i = 6; i <= NF; ++i) { r = $i; gsub(/^rank_|_seq_per_s$/, "", r);
          head = head " D~ = " r " / standard |"; rule = rule "---|" }
        if (has_ng) { head = head " no graphs | graphs / none |"; rule = rule "---|---|" }
        print head; print rule; next }
      { k = $1 "x" $2; p = (k in py) ? py[k] : 0; e = (k in eager) ? eager[k] : 0;
        line = sprintf("| %s x %s | %.2f | %s | %s |", $1, $2, $3,
          (p ? sprintf("%.2f", p) : "-"), (p ? sprintf("%.2fx", $3 / p) : "-"));
        for (i = 6; i <= NF; ++i) line = line sprintf(" %.2fx |", ($3 > 0) ? $i / $3 : 0);
        if (has_ng) line = line (e ? sprintf(" %.2f | %.2fx |", e, $3 / e) : " - | - |");
        print line }' \
      "$([ -f "$OUT/pytorch-$dt.tsv" ] && echo "$OUT/pytorch-$dt.tsv" || echo /dev/null)" \
      "$([ -f "$ng" ] && echo "$ng" || echo /dev/null)" "$OUT/engine-$dt.tsv"
  done
  # engine-ways-DT[-padded].tsv: batch, seq, the standard model's seq/s, runs, CPU ms, then one
  # column per way (rank_R_WAY_seq_per_s).
  local first_dt=${dtypes:-}
  first_dt=${first_dt%% *}
  for f in "$OUT/engine-ways-$first_dt.tsv" "$OUT/engine-ways-$first_dt-padded.tsv"; do
    [ -f "$f" ] || continue
    local n padded=
    n=$(basename "$f" .tsv)
    [ "${n%-padded}" = "$n" ] || padded=", padded batches"
    echo
    echo "The collaborative model's attention put to ATen's each way (server/model/collab_attention.h;" \
         "bias: the engine's default), whole passes, seq/s against the standard model's, same run$padded ($n.log):"
    echo
    awk -F'\t' '
      $1 ~ /^#/ { head = "| batch x seq | standard seq/s |"; rule = "|---|---|";
        for (i = 6; i <= NF; ++i) { r = $i; gsub(/^rank_|_seq_per_s$/, "", r); sub(/_/, ", ", r);
          head = head " D~ = " r " |"; rule = rule "---|" }
        print head; print rule; next }
      { line = sprintf("| %s x %s | %.2f |", $1, $2, $3);
        for (i = 6; i <= NF; ++i) line = line sprintf(" %.2fx |", ($3 > 0) ? $i / $3 : 0);
        print line }' "$f"
  done
  # The profiles' headline lines: step kind, the lines' prefix, the title.
  for profile in "ops|op profile|Host time by operator" "kernels|gpu kernels|Device kernels"; do
    IFS='|' read -r kind prefix title <<<"$profile"
    for dt in ${dtypes:-}; do
      [ -f "$OUT/pytorch-$kind-$dt.log" ] || [ -f "$OUT/engine-$kind-$dt.log" ] || continue
      echo
      echo "$title, $dt (the tables in pytorch-$kind-$dt.log and engine-$kind-$dt.log):"
      echo
      grep -h "^$prefix: " "$OUT/pytorch-$kind-$dt.log" "$OUT/engine-$kind-$dt.log" 2>/dev/null |
        sed "s/^$prefix: /- /" || true
    done
  done
  if [ -f "$OUT/attention-variants.log" ]; then
    echo
    echo "A collaborative layer's attention, the engine's way against the fastest of five (attention-variants.log):"
    echo
    grep -h '^attention: ' "$OUT/attention-variants.log" | sed 's/^attention: /- /' || true
  fi
  local runs=("on-$device" "whitened-on-$device")
  [ "$device" = cpu ] || runs+=(whitened-on-cpu)
  for name in "${runs[@]}"; do
    [ -f "$OUT/compress-$name.json" ] || continue
    echo
    "$PYTHON" - "$OUT/compress-$name.json" "${first_rank:-}" "$name" <<'PYEOF' || true
import json, sys
r = json.load(open(sys.argv[1]))
w, steps = r.get("whitening", {}), r.get("steps", {})
what = sys.argv[3].replace("-", " ")
calibration = (f"calibration pass {w.get('seconds', 0):.2f} s ({w.get('fit_texts', 0)} texts), "
               if w.get("on") else "")
print(f"Compression at D~ = {sys.argv[2]}, {what}: {r.get('seconds', 0):.2f} s in all: {calibration}"
      f"{r.get('decompose_seconds', 0):.2f} s of CP-ALS, fidelity {steps.get('fidelity_seconds', 0):.2f} s; "
      f"top-1 agreement {r.get('fidelity', {}).get('top1_agreement', float('nan')):.3f} "
      f"on {r.get('fidelity', {}).get('probes', 0)} texts")
PYEOF
  done
} >"$summary"
}
# Writes and prints the summary and exits: with STATUS when given, else 1 when a step failed, 124
# when --time-limit skipped one (timeout(1)'s status), 0.
finish() {  # message [status]
  write_summary
  cat "$summary"
  log "$1"
  [ $# -lt 2 ] || exit "$2"
  printf '%s\n' "${status[@]}" | grep -q FAILED && exit 1
  printf '%s\n' "${status[@]}" | grep -q skipped && exit 124
  exit $failed
}
# On a signal (timeout(1) sends SIGTERM to the whole group, so the step's command ends too): the
# summary of what finished, and the step it cut.
on_signal() {
  trap - TERM INT
  [ -z "$current" ] || status+=("| $current | **interrupted** by $1 | $((SECONDS - current_t0)) s |")
  notes+=("Interrupted by $1 after $SECONDS s.")
  finish "interrupted by $1; results so far in $OUT" "$2"
}
trap 'on_signal SIGTERM 143' TERM
trap 'on_signal SIGINT 130' INT

# --- configure and build --------------------------------------------------------------------
cmake_args=(-S "$ROOT" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DCOLLABSERVE_WITH_GRPC=OFF
            -DCOLLABSERVE_BUILD_TESTS=ON -DCOLLABSERVE_BUILD_BENCH=ON)
command -v ninja >/dev/null && cmake_args+=(-G Ninja)
# The wheel's LibTorch when it ships one (pip wheels do); else the system's (Debian's python3-torch
# has none under the Python package: its LibTorch is libtorch-dev's).
prefixes=
if [ -n "$deps" ]; then
  [ -f "$deps/$packed_stamp" ] || {
    log "--deps $deps: not a folder made by --pack-deps (or its packing did not finish)"; exit 2; }
  deps=$(cd "$deps" && pwd)
  prefixes="$deps/usr"
  export LD_LIBRARY_PATH="$deps/usr/lib/$multiarch${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # Debian builds these libraries with the C++11 std::string ABI.
  [ "$torch_abi" = 1 ] || log "warning: torch uses the pre-C++11 ABI; the packed libraries will not link"
fi
if [ -f "$torch_cmake/Torch/TorchConfig.cmake" ]; then
  prefixes="${prefixes:+$prefixes;}$torch_cmake"
  # The C++ libraries linked beside LibTorch must use its std::string ABI.
  cmake_args+=(-DCMAKE_CXX_FLAGS="-D_GLIBCXX_USE_CXX11_ABI=$torch_abi")
fi
[ -n "$prefixes" ] && cmake_args+=(-DCMAKE_PREFIX_PATH="$prefixes")
if [ -f "$build_dir/CMakeCache.txt" ] && grep -q "^COLLABSERVE_WITH_GRPC:BOOL=ON" "$build_dir/CMakeCache.txt"; then
  log "$build_dir is a full (gRPC) build: reusing it as it is"
elif ! run_step configure cmake "${cmake_args[@]}"; then
  failed=1
fi
# The parity tests a full check runs (--quick: engine_reference_test alone). On a GPU
# engine_reference_test adds its CUDA blocks (float32 / float16 / bfloat16 against the reference,
# standard and collaborative); engine_test its GPU memory readings, an out-of-memory GPU
# (RESOURCE_EXHAUSTED, then serving again) and a GPU broken by a device-side assert in a process of
# its own (UNAVAILABLE device failures); cp_als_test compares CP-ALS on the device with the CPU at the same
# seed, and collaborative_test the whole conversion (plain and whitened, SVD and random starts, an
# exact full-rank layer and a standard one); cxx_runtime_binding_test: the executables bind
# libstdc++'s functions, not the copies a PyTorch wheel's libtorch.so exports (its
# std::filesystem::remove_all crashed every test); op_profile_test: no forward pass on CUDA (float32,
# float16) reads a value back mid-pass (a wait for the device); forward_graphs_test: CUDA graph
# replays against eager passes (standard and collaborative, float32 and float16, several buckets,
# several threads, an engine with graphs against one without).
test_names=(engine_reference_test engine_test kernels_test cp_als_test collaborative_test cxx_runtime_binding_test
            op_profile_test forward_graphs_test)
targets=(collabserve-model engine_bench engine_reference_test)
[ $quick = 1 ] || targets+=("${test_names[@]:1}")
# What follows needs the build; each later step only what it uses, so that on a lent GPU's few
# minutes a failed parity test still leaves the bench's figures.
built=0
if [ $failed = 0 ]; then
  if run_step build cmake --build "$build_dir" -j "$jobs" --target "${targets[@]}"; then
    built=1
  else
    failed=1
    # A build with CUDA graphs (forward_graphs.cc, the one file compiled against LibTorch's CUDA
    # headers) that fails: once more without them, so that the minutes left still give the tests
    # and the bench (forward_graphs_test then fails, saying graphs are off).
    if grep -q "CUDA graphs of small passes" "$OUT/configure.log" 2>/dev/null &&
       run_step configure-nographs cmake "${cmake_args[@]}" -DCOLLABSERVE_CUDA_GRAPHS=OFF &&
       run_step build-nographs cmake --build "$build_dir" -j "$jobs" --target "${targets[@]}"; then
      built=1
      notes+=("The build with CUDA graphs failed (build.log); everything after it ran without them.")
    fi
  fi
fi
bin=$build_dir/bin
tests=$build_dir/tests

# --- parity tests -----------------------------------------------------------------------------
export COLLABSERVE_SOURCE_DIR=$ROOT COLLABSERVE_PYTHON=$PYTHON
if [ $built = 1 ]; then
  if [ $quick = 1 ]; then
    run_step tests "$tests/engine_reference_test" || failed=1
  else
    for t in "${test_names[@]}"; do
      run_step "test-$t" "$tests/$t" || failed=1
    done
  fi
fi

# --- models -----------------------------------------------------------------------------------
models=$build_dir/gpu-check-models
preset=base batches=1,8,32,128 seqs=16,128,512 dtypes="float16 float32" budget=3
[ "$device" = cpu ] && { batches=1,8; seqs=16,128; dtypes=float32; }
if [ $quick = 1 ]; then preset=mini batches=1,2 seqs=16 dtypes=float32 budget=0.2; fi
# D~ = D_k/2 and D_k/4 of the preset's 12 x 64 (base) or 4 x 64 (mini) heads.
if [ "$preset" = base ]; then ranks="384 192"; else ranks="128 64"; fi
have_models=0
if [ $built = 1 ]; then
  mkdir -p "$models"
  have_models=1
  [ -f "$models/$preset/config.json" ] || run_step make-model \
    "$bin/collabserve-model" make --out "$models/$preset" --preset "$preset" || have_models=0
  for r in $ranks; do
    if [ $have_models = 1 ] && [ ! -f "$models/$preset-$r/config.json" ]; then
      run_step "compress-$r" "$bin/collabserve-model" compress --model "$models/$preset" \
        --out "$models/$preset-$r" --rank "$r" || have_models=0
    fi
  done
  [ $have_models = 1 ] || failed=1
fi

# --- the compression on the device, timed -----------------------------------------------------
first_rank=${ranks%% *}
compress_on() {  # DEVICE NAME [FLAGS...]: the JSON report alone into compress-NAME.json
  local on=$1 name=$2
  shift 2
  rm -rf "$models/$preset-$first_rank-$name"
  "$bin/collabserve-model" compress --model "$models/$preset" --out "$models/$preset-$first_rank-$name" \
    --rank "$first_rank" --device "$on" "$@" >"$OUT/compress-$name.json"
}
if [ -f "$models/$preset/config.json" ]; then
  run_step "compress-on-$device" compress_on "$device" "on-$device" || failed=1
  # Activation-aware (1024 calibration texts): its model passes (the calibration statistics, the
  # fidelity probes) run where CP-ALS does; on a GPU once more on the CPU, the same run's baseline.
  calibration=$ROOT/tests/data/demo/calibration.txt
  run_step "compress-whitened-on-$device" compress_on "$device" "whitened-on-$device" \
    --calibration "$calibration" || failed=1
fi
# Its CPU baseline (on a GPU machine) runs last: it is a known quantity, and the device's own
# measurements must not be the ones a --time-limit cuts.
whitened_cpu_last=0
[ "$device" != cpu ] && [ -f "$models/$preset/config.json" ] && whitened_cpu_last=1

# --- engine against PyTorch eager -------------------------------------------------------------
collab_dirs=
for r in $ranks; do collab_dirs+="${collab_dirs:+,}$models/$preset-$r"; done
threads=$(nproc)
[ "$device" = cpu ] && threads=2
# Both engines' processes alike (bench/engine/RESULTS.md's setting): with OpenMP's default active
# wait its workers spin between parallel regions, and OpenBLAS's own pool (Debian's python3-torch
# runs its products there) starves: BERT-base's PyTorch eager passes on 2 cores were 3.5x slower
# (1 x 16: 6.9 seq/s, 24.4 with passive wait).
bench_env=(env OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads OMP_WAIT_POLICY=PASSIVE)
# With a time limit, each grid point and model gets what is left over the runs the bench makes:
# per dtype, PyTorch's one model and the engine's standard and collaborative ones at every point
# (on a GPU, the standard one once more without CUDA graphs, in the first dtype); 20 s per process
# for starting (Python and CUDA, loading the models, warm-ups), 15 s per op profile and per kernel
# table (two of each, for the first dtype; kernel tables on a GPU only), the attention variants'
# step (60 s on a GPU, 10 on the CPU), the attention ways' two runs (ways_s); and half of the
# rest, since a point's runs also stop at --max_runs or carry on to --min_runs.
# The attention ways' runs: the standard model and five ways of the D_k/4 one, alternating, at
# four points (two on the CPU), unpadded and padded; on the CPU under COLLABSERVE_GEMM=aten, the
# path where the ways differ there (explicit products: a check of the step, not of the kernels).
ways=bias,qk-column,qk-column-padded,v-fold,v-fold-padded
way_points=(--batches=8,32 --seqs=128,512) way_budget=0.5 ways_s=90 way_env=()
[ "$device" = cpu ] && way_points=(--batches=2 --seqs=16,128) way_budget=0.3 ways_s=60 way_env=(COLLABSERVE_GEMM=aten)
[ $quick = 1 ] && way_points=(--batches=2 --seqs=16) way_budget=0.05 ways_s=20
if [ $have_models = 1 ] && [ "$time_limit" -gt 0 ] && [ "$(left)" -ge 10 ]; then
  set -- $dtypes; n_dtypes=$#
  set -- $ranks; n_models=$(($# + 1))
  n_points=$(( $(echo "$batches" | tr ',' '\n' | wc -l) * $(echo "$seqs" | tr ',' '\n' | wc -l) ))
  n_profiles=1; [ "$device" = cpu ] || n_profiles=2  # op profiles; on a GPU, kernel tables too
  n_extra=0; [ "$device" = cpu ] || n_extra=1  # on a GPU: the standard model without graphs, first dtype
  variants_s=10; [ "$device" = cpu ] || variants_s=60
  variants_s=$((variants_s + 30 * whitened_cpu_last))  # and the whitened compression's CPU run
  fit=$(awk -v left="$(left)" -v d="$n_dtypes" -v p="$n_points" -v m="$n_models" -v b="$budget" -v k="$n_profiles" -v x="$n_extra" -v v="$((variants_s + ways_s))" '
    BEGIN { f = 0.5 * (left - 10 - (2 * d + x) * 20 - 2 * 15 * k - v) / (p * (d * (m + 1) + x)); if (f > b) f = b; if (f < 0.05) f = 0.05;
            printf "%.2f", f }')
  notes+=("Bench: $fit s per grid point and model (at most $budget; --time-limit $time_limit s, $(left) s left when it began).")
  budget=$fit
fi
if [ $have_models = 1 ]; then
  sdpa=()
  [ "$has_sdpa" = 1 ] && sdpa=(--sdpa)
  for dt in $dtypes; do
    run_step "pytorch-$dt" "${bench_env[@]}" "$PYTHON" "$ROOT/bench/engine/pytorch_bench.py" \
      --model "$models/$preset" --out "$OUT/pytorch-$dt.tsv" --device "$device" --dtype "$dt" \
      --batches "$batches" --seqs "$seqs" --threads "$threads" --budget_s "$budget" "${sdpa[@]}" || failed=1
    py_tsv=()  # the engine's table without PyTorch's column when that run failed
    [ -f "$OUT/pytorch-$dt.tsv" ] && py_tsv=(--pytorch_tsv="$OUT/pytorch-$dt.tsv")
    run_step "engine-$dt" "${bench_env[@]}" "$bin/engine_bench" \
      --model="$models/$preset" --collab_model="$collab_dirs" --device="$device" --dtype="$dt" \
      --batches="$batches" --seqs="$seqs" --threads="$threads" --budget_s="$budget" \
      "${py_tsv[@]}" --tsv_out="$OUT/engine-$dt.tsv" --sgemm=0 --stream_mb=0 --memory=0 || failed=1
    # On a GPU, in the first dtype, the standard model once more without CUDA graphs: what they gain.
    if [ "$device" != cpu ] && [ "$dt" = "${dtypes%% *}" ]; then
      run_step "engine-nographs-$dt" "${bench_env[@]}" "$bin/engine_bench" \
        --model="$models/$preset" --device="$device" --dtype="$dt" --cuda_graph_max_tokens=0 \
        --batches="$batches" --seqs="$seqs" --threads="$threads" --budget_s="$budget" \
        --tsv_out="$OUT/engine-nographs-$dt.tsv" --sgemm=0 --stream_mb=0 --memory=0 || failed=1
    fi
  done
  # The collaborative model at D_k/4 with its attention put to ATen's each way, against the
  # standard model: which way a GPU runs fastest, in whole passes (attention_variants.py below
  # times the attention alone), unpadded and in padded batches, as served. First dtype.
  way_rank=${ranks##* }
  for ragged in 0 1; do
    way_step=engine-ways-${dtypes%% *}
    [ $ragged = 1 ] && way_step+=-padded
    run_step "$way_step" "${bench_env[@]}" "${way_env[@]}" "$bin/engine_bench" \
      --model="$models/$preset" --collab_model="$models/$preset-$way_rank" --collab_attention="$ways" \
      --ragged=$ragged --device="$device" --dtype="${dtypes%% *}" "${way_points[@]}" \
      --threads="$threads" --budget_s="$way_budget" --tsv_out="$OUT/$way_step.tsv" --sgemm=0 \
      --stream_mb=0 --memory=0 || failed=1
  done
  # Where each engine's host time goes, operator by operator, at the points that show it best: a
  # launch-bound pass (batch 1) and a large one; both engines, every model (--op_profile); in the
  # first dtype (float16 on a GPU, whose goals it serves). The engine's passes without CUDA graphs
  # (a replay dispatches no operator; it launches the same kernels).
  op_points=(--batches=1,128 --seqs=16,128) op_passes=20
  [ "$device" = cpu ] && op_points=(--batches=1,8 --seqs=16,128) op_passes=5
  [ $quick = 1 ] && op_points=(--batches=1 --seqs=16) op_passes=3
  profile_dtypes=${dtypes%% *}
  for dt in $profile_dtypes; do
    run_step "pytorch-ops-$dt" "${bench_env[@]}" "$PYTHON" "$ROOT/bench/engine/pytorch_bench.py" \
      --model "$models/$preset" --device "$device" --dtype "$dt" "${op_points[@]}" \
      --threads "$threads" --op_profile "$op_passes" "${sdpa[@]}" || failed=1
    run_step "engine-ops-$dt" "${bench_env[@]}" "$bin/engine_bench" \
      --model="$models/$preset" --collab_model="$collab_dirs" --device="$device" --dtype="$dt" \
      "${op_points[@]}" --threads="$threads" --op_profile="$op_passes" --sgemm=0 --stream_mb=0 \
      --memory=0 --cuda_graph_max_tokens=0 || failed=1
  done
  # On a GPU, the kernels each engine's passes ran, by device time (--gpu_kernels), at the same points.
  if [ "$device" != cpu ]; then
    for dt in $profile_dtypes; do
      run_step "pytorch-kernels-$dt" "${bench_env[@]}" "$PYTHON" "$ROOT/bench/engine/pytorch_bench.py" \
        --model "$models/$preset" --device "$device" --dtype "$dt" "${op_points[@]}" \
        --threads "$threads" --gpu_kernels 10 "${sdpa[@]}" || failed=1
      run_step "engine-kernels-$dt" "${bench_env[@]}" "$bin/engine_bench" \
        --model="$models/$preset" --collab_model="$collab_dirs" --device="$device" --dtype="$dt" \
        "${op_points[@]}" --threads="$threads" --gpu_kernels=10 --sgemm=0 --stream_mb=0 --memory=0 \
        --cuda_graph_max_tokens=0 || failed=1
    done
  fi
fi
# The collaborative layer's attention written five ways (the engine's: an additive bias, which keeps
# flash attention out; the bias as a column of the scores' product, or folded into the values),
# under every SDPA backend that takes each, against the standard layer's; each way checked against
# the formula in float64. No model needed: the preset's shape (12 or 4 heads of 64) and its ranks.
heads=12
[ "$preset" = base ] || heads=4
variant_points=(--batches 8,32,128 --seqs 128,512 --reps 5)  # batch 1 is launch-bound
[ "$device" = cpu ] && variant_points=(--batches 1,8 --seqs 16,128 --reps 3)
[ $quick = 1 ] && variant_points=(--batches 1,2 --seqs 16 --reps 2)
run_step attention-variants "${bench_env[@]}" "$PYTHON" "$ROOT/bench/engine/attention_variants.py" \
  --device "$device" --dtype "${dtypes%% *}" --ranks "${ranks// /,}" --heads "$heads" \
  "${variant_points[@]}" --masked --check || failed=1
if [ $whitened_cpu_last = 1 ]; then
  run_step compress-whitened-on-cpu compress_on cpu whitened-on-cpu --calibration "$calibration" || failed=1
fi

finish "results in $OUT"
