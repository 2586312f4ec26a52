#!/usr/bin/env bash
# scripts/gpu-check.sh under the limits a lent GPU machine imposes: a run cut by --time-limit or by
# timeout(1)'s SIGTERM still writes the summary of what finished, names what it did not run, leaves
# no process behind and says so in its exit status.
#   gpu_check_limits_test.sh SOURCE_DIR BUILD_DIR WORK_DIR
set -uo pipefail
src=$1 build=$2 work=$3
script=$src/scripts/gpu-check.sh
fail() { echo "FAIL: $*" >&2; exit 1; }
rm -rf "$work" && mkdir -p "$work/tmp"
# The parity test killed mid-run leaves its temporary directories: here, not in /tmp.
export TMPDIR=$work/tmp

# 1. A limit too short for any step: every step is skipped, the summary says so, status 124.
OUT=$work/limit "$script" --device cpu --quick --build-dir "$build" --time-limit 5 >"$work/limit.out" 2>&1
rc=$?
[ $rc = 124 ] || { cat "$work/limit.out"; fail "--time-limit 5: exit status $rc, not 124"; }
grep -q '^| configure | \*\*skipped\*\*: --time-limit 5 s reached' "$work/limit/summary.md" ||
  fail "--time-limit 5: the summary does not list configure as skipped"
! grep -q FAILED "$work/limit/summary.md" || fail "--time-limit 5: a skipped step reads as FAILED"

# 2. SIGTERM to the script's process group (what timeout(1) sends) during the parity tests.
OUT=$work/term setsid "$script" --device cpu --quick --build-dir "$build" >"$work/term.out" 2>&1 &
pid=$!
for _ in $(seq 3000); do  # the build may run first (up to 25 min on 2 cores from an empty cache)
  grep -q '^gpu-check: tests \.\.\.' "$work/term.out" && break
  kill -0 $pid 2>/dev/null || { cat "$work/term.out"; fail "gpu-check ended before its tests began"; }
  sleep 0.5
done
sleep 1
kill -TERM -- -$pid  # setsid: the script leads its own process group
wait $pid
rc=$?
[ $rc = 143 ] || { cat "$work/term.out"; fail "SIGTERM: exit status $rc, not 143"; }
grep -q '^| tests | \*\*interrupted\*\* by SIGTERM' "$work/term/summary.md" ||
  { cat "$work/term.out"; fail "SIGTERM: the summary does not name the interrupted step"; }
grep -q '^| build | ok' "$work/term/summary.md" || fail "SIGTERM: the summary lost the steps that finished"
! pgrep -f "$build/tests/engine_reference_test" >/dev/null || fail "SIGTERM left the parity test running"
echo "gpu_check_limits_test: ok"
