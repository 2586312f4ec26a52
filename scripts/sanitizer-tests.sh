#!/usr/bin/env bash
# The test suite again under sanitizers (issue 7), each in its own build tree configured with
# -DCOLLABSERVE_SANITIZE=... (tests/sanitizers/sanitizers.cmake: our code instrumented, Debian's
# LibTorch / gRPC / protobuf / abseil not; suppressions in tests/sanitizers/*.supp).
#   scripts/sanitizer-tests.sh [asan|tsan]...     (default: both; `make test-asan`, `make test-tsan`)
#   asan: every unit and integration test, ASan + UBSan, in build-asan. ASan halts on the first
#         error, every UBSan check is fatal, LeakSanitizer runs at exit.
#   tsan: the batching, repository and service tests, TSan, in build-tsan.
# Environment: JOBS (default: nproc), ASAN_BUILD_DIR, TSAN_BUILD_DIR, CMAKE_FLAGS (extra configure
# flags). Uses the compiler cache the Makefile exports. Exit status: non-zero if any test fails.
set -euo pipefail
cd "$(dirname "$0")/.."

jobs=${JOBS:-$(nproc)}
modes=("$@")
[ ${#modes[@]} -gt 0 ] || modes=(asan tsan)

# Tests left out of the ASan run, by ctest label:
#   fuzz    fuzz_ci builds and runs the libFuzzer targets, which are ASan + UBSan builds of their
#           own (clang); the normal `make test` runs it already.
#   deploy  node scripts checking the Helm chart, manifests and dashboards: no code of ours runs.
asan_exclude='^(fuzz|deploy)$'
# The TSan set (issue 7): the batching, repository and service tests, by label. Nothing in this
# set is excluded.
tsan_labels='^(batching|repository|service)$'

configure() {  # dir sanitizers
  if [ ! -f "$1/build.ninja" ] || ! grep -q "^COLLABSERVE_SANITIZE:STRING=$2\$" "$1/CMakeCache.txt"; then
    # Release with -O1 -g1 added by the option; the benchmarks are not needed here.
    cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCOLLABSERVE_SANITIZE="$2" \
      -DCOLLABSERVE_BUILD_BENCH=OFF ${CMAKE_FLAGS:-} >/dev/null
  fi
}

elapsed() { echo "$(( $(date +%s) - $1 ))s"; }

failed=()
for mode in "${modes[@]}"; do
  start=$(date +%s)
  case "$mode" in
    asan)
      dir=${ASAN_BUILD_DIR:-build-asan}
      configure "$dir" address,undefined
      cmake --build "$dir" -j "$jobs"
      built=$(elapsed "$start")
      if ! (cd "$dir" && ctest --output-on-failure -j "$jobs" --timeout 1500 -LE "$asan_exclude"); then
        failed+=(asan)
      fi
      ;;
    tsan)
      dir=${TSAN_BUILD_DIR:-build-tsan}
      configure "$dir" thread
      # Only what the TSan set needs: its test executables (and what they depend on). Regenerate
      # first (a no-op when nothing changed), so that the test list includes tests added since.
      cmake --build "$dir" --target build.ninja
      targets=$(cd "$dir" && ctest -N -L "$tsan_labels" | sed -n 's/^ *Test *#[0-9]*: //p')
      [ -n "$targets" ] || { echo "sanitizer-tests: no tests labelled $tsan_labels" >&2; exit 1; }
      # shellcheck disable=SC2086
      cmake --build "$dir" -j "$jobs" --target $targets
      built=$(elapsed "$start")
      if ! (cd "$dir" && ctest --output-on-failure -j "$jobs" --timeout 1500 -L "$tsan_labels"); then
        failed+=(tsan)
      fi
      ;;
    *) echo "sanitizer-tests: unknown mode '$mode' (asan or tsan)" >&2; exit 2 ;;
  esac
  echo "sanitizer-tests: $mode: built in $built, total $(elapsed "$start")"
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "sanitizer-tests: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "sanitizer-tests: OK (${modes[*]})"
