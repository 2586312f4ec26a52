#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan + UBSan, a separate CMake project: tests/fuzz) and runs
# them. Fails (exit 1) on any crash, leak, undefined behaviour, timeout or out-of-memory.
#   tests/fuzz/run_fuzz.sh [--build-dir DIR] [--seconds N] [--ci] [target...]
# For each target: first every file in tests/fuzz/regressions/<target>/ and tests/fuzz/corpus/<target>/
# is run once, then the fuzzer runs for N seconds (FUZZ_SECONDS, default 60; --ci: 10) on a working
# copy of the corpus in DIR/corpus/<target> (the committed seeds are never modified). A crashing input
# is saved as DIR/artifacts/<target>/crash-*: add it to tests/fuzz/regressions/<target>/ with the fix.
# Targets: safetensors torch_zip config_json tokenizer_config_json tokenizer admin_upload (default: all).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
build_dir="$repo/build-fuzz"
seconds=${FUZZ_SECONDS:-60}
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) build_dir=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --ci) seconds=${FUZZ_CI_SECONDS:-10}; shift ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=(safetensors torch_zip config_json tokenizer_config_json tokenizer admin_upload)

cxx=${FUZZ_CXX:-}
if [ -z "$cxx" ]; then
  for c in clang++-14 clang++; do command -v "$c" >/dev/null 2>&1 && { cxx=$c; break; }; done
fi
if [ -z "$cxx" ]; then
  echo "run_fuzz: no clang++ found; install clang and libclang-rt-dev (scripts/install-deps.sh)" >&2
  exit 1
fi

# The same machine-wide compiler cache as the Makefile, so a rebuild after a small change is quick.
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/collabserve-ccache}
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$repo}
export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}
if [ ! -f "$build_dir/build.ninja" ]; then
  cmake -S "$here" -B "$build_dir" -G Ninja -DCMAKE_CXX_COMPILER="$cxx" >/dev/null
fi
jobs=${FUZZ_BUILD_JOBS:-$(nproc)}
cmake --build "$build_dir" -j "$jobs" --target $(printf '%s_fuzzer ' "${targets[@]}") | grep -v '^\[' || true
for t in "${targets[@]}"; do
  [ -x "$build_dir/${t}_fuzzer" ] || { echo "run_fuzz: build of ${t}_fuzzer failed" >&2; exit 1; }
done

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1:detect_stack_use_after_return=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export COLLABSERVE_SOURCE_DIR=$repo
# Per-input limits: a hang or a huge allocation on a hostile input is a bug like a crash.
limits=(-timeout=10 -rss_limit_mb=2560 -malloc_limit_mb=2048 -print_funcs=0)

failed=()
summary=()
for t in "${targets[@]}"; do
  bin="$build_dir/${t}_fuzzer"
  seeds="$here/corpus/$t"
  regress="$here/regressions/$t"
  work="$build_dir/corpus/$t"
  artifacts="$build_dir/artifacts/$t"
  log="$build_dir/logs/$t.log"
  mkdir -p "$work" "$artifacts" "$(dirname "$log")"

  # 1. Known inputs, each run once.
  inputs=()
  for d in "$regress" "$seeds"; do
    [ -d "$d" ] && while IFS= read -r -d '' f; do inputs+=("$f"); done < <(find "$d" -type f -print0 | sort -z)
  done
  if [ ${#inputs[@]} -gt 0 ]; then
    if ! "$bin" "${limits[@]}" -artifact_prefix="$artifacts/" "${inputs[@]}" >"$log.replay" 2>&1; then
      echo "run_fuzz: $t FAILED on a regression or seed input:" >&2
      tail -40 "$log.replay" >&2
      failed+=("$t")
      continue
    fi
  fi

  # 2. Fuzzing, for a bounded time, single process.
  if [ "$seconds" -gt 0 ]; then
    if ! "$bin" "${limits[@]}" -max_total_time="$seconds" -print_final_stats=1 \
         -artifact_prefix="$artifacts/" "$work" "$seeds" >"$log" 2>&1; then
      echo "run_fuzz: $t FAILED while fuzzing (artifacts in $artifacts):" >&2
      grep -v '^#[0-9]' "$log" | tail -45 >&2
      failed+=("$t")
      continue
    fi
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1)
    summary+=("$(printf '%-22s %3s inputs replayed  %9s runs  %6s exec/s  %s  corpus %s files' \
      "$t" "${#inputs[@]}" "$runs" "$rate" "$cov" "$(ls "$work" | wc -l)")")
  else
    summary+=("$(printf '%-22s %3s inputs replayed' "$t" "${#inputs[@]}")")
  fi
done

printf '%s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "run_fuzz: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "run_fuzz: OK (${#targets[@]} targets, ${seconds}s each)"
