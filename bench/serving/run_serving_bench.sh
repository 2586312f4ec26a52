#!/usr/bin/env bash
# Serving benchmark: build/bin/collabserve under closed-loop load from `collabctl bench` at several
# concurrencies, with batching on and off (--max_batch_size=1), against the engine's best raw
# throughput (serving_engine_peak: batched Engine::Run, no gRPC) measured in the same run.
#   bench/serving/run_serving_bench.sh [BUILD_DIR=build]
# Environment:
#   PRESET (tiny|mini|base; mini)  TOKENS (32 per input)  DURATION_S (5 per point)
#   CONCURRENCY ("1 4 16 32 64 128")  REPEATS (3: every point is run that often, medians shown)
#   THREADS (2: the cores inference may use)  BATCH_THREADS (empty: the server's own plan, one
#   single-threaded batch thread per core on CPU; N: N batch threads, each with THREADS / N
#   intra-op threads)  DELAY_US (max_queue_delay_micros, 2000)
#   MAX_BATCH (32)  RAW_BATCHES (1,2,4,8,16 and MAX_BATCH: the raw ceiling's batch sizes)  MODES ("batching no-batching")  SERVER_FLAGS (extra collabserve flags)
#   BENCH_API (callback|threads: collabctl bench's workers)  INPUTS_PER_REQUEST (1: inputs per
#   Classify call; with N, "conc" counts calls and N x conc inputs are in flight)  OUT (also write the table there, as
#   Markdown)  RECORDS (keep every run's raw figures there, TSV)
#   COLLAB_RANK (empty: off; R: also serve the model compressed at rank R as "bench-collab", and in
#   batching mode measure it at every concurrency right after the original, alternating which goes
#   first, as mode "batching-collab"; the summary then compares the two)
# The raw ceiling does not depend on the server's settings: it is the best of one stream with THREADS
# intra-op threads and THREADS concurrent single-threaded streams (and BATCH_THREADS streams with
# THREADS / BATCH_THREADS each when that is another split), at batch sizes up to MAX_BATCH.
# The load generator runs on the same machine and takes CPU from the server: its CPU share
# (client CPU / (client + server CPU) during each point) is part of the table.
set -euo pipefail
BUILD_DIR=$(cd "${1:-build}" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
PRESET=${PRESET:-mini}
TOKENS=${TOKENS:-32}
DURATION_S=${DURATION_S:-5}
CONCURRENCY=${CONCURRENCY:-"1 4 16 32 64 128"}
REPEATS=${REPEATS:-3}
THREADS=${THREADS:-2}
BATCH_THREADS=${BATCH_THREADS:-}
DELAY_US=${DELAY_US:-2000}
MAX_BATCH=${MAX_BATCH:-32}
SERVER_FLAGS=${SERVER_FLAGS:-}
MODES=${MODES:-"batching no-batching"}
BENCH_API=${BENCH_API:-callback}
INPUTS_PER_REQUEST=${INPUTS_PER_REQUEST:-1}
OUT=${OUT:-}
if [[ -n $BATCH_THREADS ]]; then
  INTRA=$((THREADS / BATCH_THREADS))
  ((INTRA >= 1)) || { echo "run_serving_bench: BATCH_THREADS ($BATCH_THREADS) > THREADS ($THREADS)" >&2; exit 2; }
  THREAD_FLAGS="--num_batch_threads=$BATCH_THREADS --inference_threads=$INTRA"
  PLAN="$BATCH_THREADS batch thread(s) x $INTRA intra-op thread(s)"
else
  # The server's own plan (it pins ATen's and OpenBLAS's threads itself and logs the plan).
  THREAD_FLAGS=""
  PLAN="the server's default thread plan"
fi
# Idle OpenMP workers sleep instead of spinning. The raw runs set ATen's and OpenBLAS's thread
# counts per stream (OpenBLAS's pool is process-wide and a multi-threaded GEMM holds a global lock).
export OMP_WAIT_POLICY=PASSIVE

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
records=${RECORDS:-$work/records.tsv}
: >"$records"
ticks=$(getconf CLK_TCK)

"$BUILD_DIR/bin/collabserve-model" make --out "$work/repo/bench/1" --preset "$PRESET" >/dev/null
COLLAB_RANK=${COLLAB_RANK:-}
if [[ -n $COLLAB_RANK ]]; then
  "$BUILD_DIR/bin/collabserve-model" compress --model "$work/repo/bench/1" \
    --out "$work/repo/bench-collab/1" --rank "$COLLAB_RANK" >/dev/null
fi

# RAW_BATCHES: the batch sizes the raw ceiling tries (its best is the ceiling); default 1..16 and
# MAX_BATCH. On a large model the best is MAX_BATCH; fewer sizes leave time for more repeats.
batches=${RAW_BATCHES:-1,2,4,8,16}
[[ -z ${RAW_BATCHES:-} ]] && ((MAX_BATCH > 16)) && batches="$batches,$MAX_BATCH"
raw() {  # $1 streams, $2 threads per stream; appends "raw" records
  OMP_NUM_THREADS=$2 OPENBLAS_NUM_THREADS=$2 "$BUILD_DIR/bin/serving_engine_peak" \
    --model="$work/repo/bench/1" --tokens="$TOKENS" --threads="$2" --streams="$1" \
    --seconds=$((DURATION_S * 2)) --batches="$batches" >"$work/peak.txt"
  # The best batch size, and the time of one MAX_BATCH batch (what the server's full batches cost).
  awk -v rep="$rep" -v st="$1" -v th="$2" -v mb="$MAX_BATCH" '
    $1 == st && $2 == mb {maxb = $3}
    /^best/ {split($3,a,"="); split($4,b,"="); split($6,c,"=");
      printf "raw\t%s\t%dx%d\tinputs_per_s=%s batch_ms=%s cpu_us=%s maxb_ms=%s\n", rep, st, th, a[2], b[2], c[2], maxb}' \
    "$work/peak.txt" >>"$records"
  sed 's/^/    /' "$work/peak.txt"
}

start_server() {  # $@: extra flags
  # shellcheck disable=SC2086  # THREAD_FLAGS and SERVER_FLAGS are lists of flags
  "$BUILD_DIR/bin/collabserve" --host=127.0.0.1 --port=0 --metrics_port=0 --http_port=-1 \
    --model_repository="$work/repo" --poll_interval_s=0 $THREAD_FLAGS \
    --max_queue_delay_micros="$DELAY_US" \
    --max_queue_size=4096 $SERVER_FLAGS "$@" >"$work/server.out" 2>"$work/server.err" &
  server_pid=$!
  for _ in $(seq 1 600); do
    grep -q '^serving' "$work/server.out" 2>/dev/null && break
    kill -0 "$server_pid" 2>/dev/null || { cat "$work/server.err" >&2; exit 1; }
    sleep 0.1
  done
  port=$(awk -F: '/^listening on/ {print $2}' "$work/server.out")
  mport=$(awk -F: '/^metrics on/ {print $2}' "$work/server.out")
}
stop_server() {
  kill -TERM "$server_pid"
  wait "$server_pid" || { echo "run_serving_bench: server exited non-zero" >&2; exit 1; }
  server_pid=
}
server_cpu_s() { awk -v t="$ticks" '{printf "%.3f", ($14 + $15) / t}' "/proc/$server_pid/stat"; }
# Sums of the batch-size and inference-seconds histograms (all label sets).
scrape() {
  curl -fsS "http://127.0.0.1:$mport/metrics" | awk '
    /^collabserve_batch_size_sum/ {bs += $NF} /^collabserve_batch_size_count/ {bc += $NF}
    /^collabserve_inference_duration_seconds_sum/ {is += $NF}
    /^collabserve_queue_duration_seconds_sum/ {qs += $NF} /^collabserve_queue_duration_seconds_count/ {qc += $NF}
    END {printf "%s %s %s %s %s", bs + 0, bc + 0, is + 0, qs + 0, qc + 0}'
}

for rep in $(seq 1 "$REPEATS"); do
  echo "== repeat $rep/$REPEATS (load average: $(cut -d' ' -f1-3 /proc/loadavg)) =="
  echo "  raw engine, 1 stream x $THREADS threads:"
  raw 1 "$THREADS"
  if ((THREADS > 1)); then
    echo "  raw engine, $THREADS streams x 1 thread:"
    raw "$THREADS" 1
  fi
  if [[ -n $BATCH_THREADS ]] && ((BATCH_THREADS > 1 && BATCH_THREADS != THREADS)); then
    echo "  raw engine, $BATCH_THREADS streams x $INTRA threads:"
    raw "$BATCH_THREADS" "$INTRA"
  fi
  for mode in $MODES; do
    if [[ $mode == batching ]]; then start_server --max_batch_size="$MAX_BATCH"; else start_server --max_batch_size=1; fi
    # The models this mode measures: the original, and in batching mode its compressed form.
    models=(bench)
    [[ -n $COLLAB_RANK && $mode == batching ]] && models=(bench bench-collab)
    # Warm the connection and the models up.
    for model in "${models[@]}"; do
      "$BUILD_DIR/bin/collabctl" --address=127.0.0.1:"$port" bench --model="$model" --concurrency=2 \
        --duration_s=1 --input_tokens="$TOKENS" >/dev/null
    done
    for c in $CONCURRENCY; do
     order=("${models[@]}")
     ((rep % 2 == 0 && ${#models[@]} > 1)) && order=(bench-collab bench)
     for model in "${order[@]}"; do
      label=$mode
      [[ $model == bench-collab ]] && label=$mode-collab
      cpu0=$(server_cpu_s)
      read -r bs0 bc0 is0 qs0 qc0 <<<"$(scrape)"
      line=$("$BUILD_DIR/bin/collabctl" --address=127.0.0.1:"$port" bench --model="$model" \
        --concurrency="$c" --duration_s="$DURATION_S" --input_tokens="$TOKENS" --deadline_ms=60000 \
        --bench_api="$BENCH_API" --inputs_per_request="$INPUTS_PER_REQUEST")
      cpu1=$(server_cpu_s)
      read -r bs1 bc1 is1 qs1 qc1 <<<"$(scrape)"
      extra=$(awk -v c0="$cpu0" -v c1="$cpu1" -v bs0="$bs0" -v bs1="$bs1" -v bc0="$bc0" \
        -v bc1="$bc1" -v is0="$is0" -v is1="$is1" -v qs0="$qs0" -v qs1="$qs1" -v qc0="$qc0" \
        -v qc1="$qc1" 'BEGIN {bc = bc1 - bc0; qc = qc1 - qc0;
        printf "server_cpu_s=%.3f batch_mean=%.2f busy_s=%.3f queue_mean_ms=%.3f", c1 - c0,
        (bc > 0 ? (bs1 - bs0) / bc : 0), is1 - is0, (qc > 0 ? 1000 * (qs1 - qs0) / qc : 0)}')
      printf '%s\t%s\t%s\t%s %s load=%s\n' "$label" "$rep" "$c" "$line" "$extra" \
        "$(cut -d' ' -f1 /proc/loadavg)" >>"$records"
      echo "  $label c=$c: $line $extra"
     done
    done
    stop_server
  done
done

echo
# The server's batch threads x intra-op threads, as it logged them: the raw configuration whose
# full batch is "one batch's compute" in the p99 bound.
server_config=$(sed -n 's/.*inference threads: \([0-9]*\) batch thread(s) per model version x \([0-9]*\) intra-op.*/\1x\2/p' \
  "$work/server.err" | tail -1)
/usr/bin/python3 "$HERE/summarize.py" --records="$records" --delay_us="$DELAY_US" \
  --server_config="$server_config" --max_batch="$MAX_BATCH" \
  --title="preset $PRESET, $TOKENS tokens/input, max_batch_size $MAX_BATCH, max_queue_delay ${DELAY_US} us, $PLAN ($(grep -o 'inference threads: [^(]*' "$work/server.err" | tail -1)), collabctl bench --bench_api=$BENCH_API --inputs_per_request=$INPUTS_PER_REQUEST, $DURATION_S s per point, median of $REPEATS" \
  ${OUT:+--out="$OUT"}
