#!/usr/bin/env bash
# Serving benchmark: build/bin/collabserve under closed-loop load from `collabctl bench` at several
# concurrencies, with batching on and off (--max_batch_size=1), against the engine's best raw
# throughput (serving_engine_peak: batched Engine::Run, no gRPC) measured in the same run.
#   bench/serving/run_serving_bench.sh [BUILD_DIR=build]
# Environment: PRESET (tiny|mini|base; default mini), TOKENS (32), DURATION_S (5 per point),
# CONCURRENCY ("1 4 16 32"), THREADS (torch intra-op threads, 2), DELAY_US (max_queue_delay_micros,
# 2000), MAX_BATCH (32).
# Note: the load generator runs on the same machine and takes CPU from the server; on a 2-core
# machine this caps the served fraction of the raw ceiling.
set -euo pipefail
BUILD_DIR=$(cd "${1:-build}" && pwd)
PRESET=${PRESET:-mini}
TOKENS=${TOKENS:-32}
DURATION_S=${DURATION_S:-5}
CONCURRENCY=${CONCURRENCY:-"1 4 16 32"}
THREADS=${THREADS:-2}
DELAY_US=${DELAY_US:-2000}
MAX_BATCH=${MAX_BATCH:-32}
export OMP_NUM_THREADS=$THREADS OPENBLAS_NUM_THREADS=$THREADS OMP_WAIT_POLICY=PASSIVE

for b in collabserve collabctl collabserve-model serving_engine_peak; do
  [[ -x "$BUILD_DIR/bin/$b" ]] || { echo "run_serving_bench: $BUILD_DIR/bin/$b missing; build it" >&2; exit 1; }
done
work=$(mktemp -d)
server_pid=
cleanup() {
  [[ -n "$server_pid" ]] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

"$BUILD_DIR/bin/collabserve-model" make --out "$work/repo/bench/1" --preset "$PRESET" >/dev/null

echo "== raw engine (Engine::Run, $TOKENS tokens/input, $THREADS threads) =="
"$BUILD_DIR/bin/serving_engine_peak" --model="$work/repo/bench/1" --tokens="$TOKENS" \
  --threads="$THREADS" --seconds=$((DURATION_S * 2)) --batches=1,2,4,8,16,$MAX_BATCH | tee "$work/peak.txt"
read -r raw_best raw_batch_ms <<<"$(awk '/^best/ {split($3,a,"="); split($4,b,"="); print a[2], b[2]}' "$work/peak.txt")"

start_server() {  # $@: extra flags
  "$BUILD_DIR/bin/collabserve" --host=127.0.0.1 --port=0 --metrics_port=-1 \
    --model_repository="$work/repo" --poll_interval_s=0 --inference_threads="$THREADS" \
    --max_queue_delay_micros="$DELAY_US" --max_queue_size=4096 "$@" \
    >"$work/server.out" 2>"$work/server.err" &
  server_pid=$!
  for _ in $(seq 1 600); do
    grep -q '^serving' "$work/server.out" 2>/dev/null && break
    kill -0 "$server_pid" 2>/dev/null || { cat "$work/server.err" >&2; exit 1; }
    sleep 0.1
  done
  port=$(awk -F: '/^listening on/ {print $2}' "$work/server.out")
}
stop_server() {
  kill -TERM "$server_pid"
  wait "$server_pid" || { echo "run_serving_bench: server exited non-zero" >&2; exit 1; }
  server_pid=
}

results=()
for mode in batching no-batching; do
  if [[ $mode == batching ]]; then start_server --max_batch_size="$MAX_BATCH"; else start_server --max_batch_size=1; fi
  # Warm the connection and the model up.
  "$BUILD_DIR/bin/collabctl" --address=127.0.0.1:"$port" bench --model=bench --concurrency=2 \
    --duration_s=1 --input_tokens="$TOKENS" >/dev/null
  for c in $CONCURRENCY; do
    line=$("$BUILD_DIR/bin/collabctl" --address=127.0.0.1:"$port" bench --model=bench \
      --concurrency="$c" --duration_s="$DURATION_S" --input_tokens="$TOKENS")
    results+=("$mode $c $line")
  done
  stop_server
done

echo
echo "== served vs raw (preset $PRESET, $TOKENS tokens/input, max_queue_delay ${DELAY_US}us, raw best $raw_best inputs/s, one batch ${raw_batch_ms} ms) =="
printf "%-12s %6s %12s %9s %9s %9s %9s %14s %7s\n" mode conc inputs/s vs_raw p50_ms p90_ms p99_ms p99_bound_ms errors
for r in "${results[@]}"; do
  set -- $r
  mode=$1 c=$2
  shift 2
  declare -A kv=()
  for f in "$@"; do kv[${f%%=*}]=${f#*=}; done
  bound=$(awk -v d="$DELAY_US" -v b="$raw_batch_ms" 'BEGIN {printf "%.3f", 2 * (d / 1000 + b)}')
  ratio=$(awk -v x="${kv[inputs_per_s]}" -v r="$raw_best" 'BEGIN {printf "%.3f", x / r}')
  printf "%-12s %6s %12s %9s %9s %9s %9s %14s %7s\n" "$mode" "$c" "${kv[inputs_per_s]}" "$ratio" \
    "${kv[p50_ms]}" "${kv[p90_ms]}" "${kv[p99_ms]}" "$bound" "${kv[errors]}"
done
echo "vs_raw = served inputs/s / raw engine's best; p99_bound = 2 x (queue delay + one batch at the best size)"
