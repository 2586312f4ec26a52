#!/usr/bin/env bash
# Admin-path benchmark (issue 5, "Speed"): one run, one server, on this machine.
#
#   bench/admin/run_admin_bench.sh BUILD_DIR
#
# 1. End to end: a BERT-base-shaped checkpoint (collabserve-model make --preset base, cached under
#    BUILD_DIR/bench-models/base) is uploaded with `collabctl upload --rank=384 --wait` to a running
#    collabserve. Measures seconds from the start of the upload to the job's end and to the first
#    successful Classify on the new model, the checkpoint size, and the server's peak resident memory
#    (VmHWM) against the checkpoint size.
# 2. Classification latency on the tiny `demo` model: `collabctl bench` idle, then again while a
#    second upload+compress job of the same checkpoint runs. p50/p99 and the during/idle ratio.
# Goals (issue 5): end to end < 60 s; peak RSS < 3x checkpoint; p99 during/idle <= 2x.
# Prints one table at the end, then the server's memory by job step for upload 1. Everything is
# bounded by timeouts; the server is killed on exit. MEMORY_ONLY=1 skips the latency benches and
# upload 2 (part 1 only). SERVER_LOG=FILE keeps the server's log (stderr) there for a closer look
# (the job's steps, "loaded <id> ... in X s"). SERVER_ARGS="--flag=value ..." are added to the
# server's command line (e.g. --noadmin_job_idle_priority for the nice-10 job workers).
set -euo pipefail

if [[ $# -ne 1 || ! -d "$1" ]]; then
  echo "usage: $0 BUILD_DIR   (BUILD_DIR/bin must hold collabserve, collabctl, collabserve-model)" >&2
  exit 2
fi
BUILD_DIR=$(cd "$1" && pwd)
BIN=$BUILD_DIR/bin
for b in collabserve collabctl collabserve-model; do
  [[ -x $BIN/$b ]] || { echo "missing $BIN/$b (build it first)" >&2; exit 2; }
done

export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2
RANK=${RANK:-384}
BENCH_S=${BENCH_S:-10}            # seconds per latency bench
CONCURRENCY=${CONCURRENCY:-2}     # closed-loop clients (2 cores)
INPUT_TOKENS=${INPUT_TOKENS:-32}
MEMORY_ONLY=${MEMORY_ONLY:-0}

WORK=$(mktemp -d /tmp/admin-bench.XXXXXX)
SERVER_PID=""
SRV=""
BG_PID=""
cleanup() {
  local rc=$?
  [[ -n $BG_PID ]] && kill "$BG_PID" 2>/dev/null || true
  if [[ -n $SERVER_PID ]]; then
    # Signal the server itself, not only `timeout` (killing `timeout` with -9 would orphan it).
    local pids=("$SERVER_PID")
    [[ -n ${SRV:-} && $SRV != "$SERVER_PID" ]] && pids+=("$SRV")
    kill "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "${pids[@]}" 2>/dev/null || break; sleep 0.1; done
    kill -9 "${pids[@]}" 2>/dev/null || true
  fi
  [[ -n ${SERVER_LOG:-} && -f $WORK/server.err ]] && cp "$WORK/server.err" "$SERVER_LOG"
  if [[ $rc -ne 0 ]]; then
    echo "FAILED (rc=$rc); server stderr tail:" >&2
    tail -n 30 "$WORK/server.err" 2>/dev/null >&2 || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN{printf "%.1f", b-a}'; }
log() { echo "[$(date -u +%H:%M:%S)] $*" >&2; }

# --- checkpoint (cached) -------------------------------------------------------------------------
MODEL=$BUILD_DIR/bench-models/base
if [[ ! -f $MODEL/model.safetensors ]]; then
  log "making BERT-base-shaped checkpoint in $MODEL"
  rm -rf "$MODEL.tmp"; mkdir -p "$(dirname "$MODEL")"
  timeout 900 "$BIN/collabserve-model" make --out "$MODEL.tmp" --preset base >&2
  rm -rf "$MODEL"; mv "$MODEL.tmp" "$MODEL"
fi
CKPT_BYTES=$(du -cb "$MODEL"/* | tail -1 | cut -f1)
WEIGHT_BYTES=$(stat -c %s "$MODEL/model.safetensors")
log "checkpoint $MODEL: $CKPT_BYTES bytes ($WEIGHT_BYTES in model.safetensors)"

# --- server --------------------------------------------------------------------------------------
REPO=$WORK/repo
mkdir -p "$REPO"
timeout 300 "$BIN/collabserve-model" make --out "$REPO/demo/1" --preset tiny >/dev/null
TOKEN=$WORK/token
(umask 077; head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$TOKEN")

timeout 1800 "$BIN/collabserve" --port=0 --metrics_port=0 --http_port=-1 --admin_token_file="$TOKEN" \
  --model_repository="$REPO" ${SERVER_ARGS:-} >"$WORK/server.out" 2>"$WORK/server.err" &
SERVER_PID=$!
PORT=""
for _ in $(seq 600); do
  kill -0 "$SERVER_PID" 2>/dev/null || { echo "collabserve exited early" >&2; exit 1; }
  if grep -q '^serving' "$WORK/server.out"; then
    PORT=$(sed -n 's/^listening on 127\.0\.0\.1:\([0-9]*\)$/\1/p' "$WORK/server.out" | head -1)
    break
  fi
  sleep 0.1
done
[[ -n $PORT ]] || { echo "collabserve did not print 'serving' within 60 s" >&2; exit 1; }
# `timeout` is the direct child; the server is its child. Read /proc of the server itself.
SRV=$(pgrep -P "$SERVER_PID" -x collabserve || echo "$SERVER_PID")
ADDR=127.0.0.1:$PORT
CTL=("$BIN/collabctl" --address="$ADDR")
ADM=("${CTL[@]}" --token_file="$TOKEN")
log "server pid $SRV on $ADDR"
rss_kb() { awk -v k="$2:" '$1==k{print $2}' "/proc/$1/status"; }
RSS_IDLE_KB=$(rss_kb "$SRV" VmRSS)

bench() {  # prints "p50 p99 rps requests errors"
  local out
  out=$(timeout $((BENCH_S + 60)) "${CTL[@]}" bench --model=demo --concurrency="$CONCURRENCY" \
          --duration_s="$BENCH_S" --input_tokens="$INPUT_TOKENS" 2>"$WORK/bench.err") || {
    echo "bench failed: $out $(cat "$WORK/bench.err")" >&2; exit 1; }
  echo "$out" >&2
  awk '{for(i=1;i<=NF;i++){split($i,kv,"=");v[kv[1]]=kv[2]}}
       END{print v["p50_ms"], v["p99_ms"], v["rps"], v["requests"], v["errors"]}' <<<"$out"
}

# Seconds until `classify --model=$1` first succeeds (the published version is loaded).
wait_loaded() {
  for _ in $(seq 600); do
    if timeout 30 "${CTL[@]}" classify --model="$1" "the bench is done" >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  echo "model $1 never became classifiable" >&2; return 1
}

# --- 2a. idle latency ----------------------------------------------------------------------------
IDLE_P50=- IDLE_P99=- IDLE_RPS=-
if [[ $MEMORY_ONLY != 1 ]]; then
  log "idle bench (${BENCH_S}s, concurrency $CONCURRENCY, $INPUT_TOKENS tokens)"
  R=$(bench)
  read -r IDLE_P50 IDLE_P99 IDLE_RPS _ _ <<<"$R"
fi

# --- 1. end to end upload ------------------------------------------------------------------------
log "upload 1: $MODEL as bert, rank $RANK"
T0=$(now)
timeout 900 "${ADM[@]}" upload --dir="$MODEL" --name=bert --rank="$RANK" --wait \
  >"$WORK/upload1.out" 2>"$WORK/upload1.err" || {
  echo "upload 1 failed:" >&2; cat "$WORK/upload1.out" "$WORK/upload1.err" >&2; exit 1; }
T_JOB=$(now)
wait_loaded bert
T_LOADED=$(now)
HWM_KB=$(rss_kb "$SRV" VmHWM)
RSS_AFTER_KB=$(rss_kb "$SRV" VmRSS)
# The job logs its memory by step when it ends (server/service/admin_jobs.cc): keep upload 1's.
job_steps() {  # the step lines of the N-th job's "memory by step" block in the server's log
  awk -v want="$1" '/memory by step:/{n++; on=(n==want); next}
       on && /^[A-Za-z+]+: [0-9.]+ s, rss /{print; next} {on=0}' "$WORK/server.err"
}
for _ in $(seq 50); do [[ -n $(job_steps 1) ]] && break; sleep 0.1; done
STEPS1=$(job_steps 1)
E2E_JOB=$(secs "$T0" "$T_JOB")
E2E_LOADED=$(secs "$T0" "$T_LOADED")
echo "--- upload 1 report ---" >&2
tr '\r' '\n' <"$WORK/upload1.err" | grep -v '^\[' >&2 || true
cat "$WORK/upload1.out" >&2

BUSY_P50=- BUSY_P99=- BUSY_RPS=- OVERLAP=- JOB_RUNNING_AT_END=- U2S=0 U2E=0 HWM2_KB=0
if [[ $MEMORY_ONLY != 1 ]]; then
  # --- 2b. latency while a second upload+compress job runs -----------------------------------------
  log "upload 2 (bert2) in the background, then bench"
  (
    s=$(now)
    timeout 900 "${ADM[@]}" upload --dir="$MODEL" --name=bert2 --rank="$RANK" --wait \
      >"$WORK/upload2.out" 2>"$WORK/upload2.err"
    echo $? >"$WORK/upload2.rc"
    e=$(now); echo "$s $e" >"$WORK/upload2.t"
  ) &
  BG_PID=$!
  sleep 1
  TB0=$(now)
  R=$(bench)
  read -r BUSY_P50 BUSY_P99 BUSY_RPS _ _ <<<"$R"
  TB1=$(now)
  JOB_RUNNING_AT_END=yes
  [[ -f $WORK/upload2.t ]] && JOB_RUNNING_AT_END=no
  timeout 900 tail --pid="$BG_PID" -f /dev/null || true
  BG_PID=""
  [[ $(cat "$WORK/upload2.rc") == 0 ]] || {
    echo "upload 2 failed:" >&2; cat "$WORK/upload2.out" "$WORK/upload2.err" >&2; exit 1; }
  read -r U2S U2E <"$WORK/upload2.t"
  OVERLAP=$(awk -v a="$TB0" -v b="$TB1" -v s="$U2S" -v e="$U2E" \
    'BEGIN{lo=(a>s?a:s); hi=(b<e?b:e); o=hi-lo; if(o<0)o=0; printf "%.1f/%.1f", o, b-a}')
  HWM2_KB=$(rss_kb "$SRV" VmHWM)
fi

# --- table ---------------------------------------------------------------------------------------
ratio() { awk -v a="$1" -v b="$2" 'BEGIN{if (a == "-" || b == "-") print "-"; else printf "%.2f", a/b}'; }
mb() { awk -v b="$1" 'BEGIN{printf "%.0f MB", b/1e6}'; }
HWM_RATIO=$(ratio $((HWM_KB * 1024)) "$CKPT_BYTES")
P99_RATIO=$(ratio "$BUSY_P99" "$IDLE_P99")
P50_RATIO=$(ratio "$BUSY_P50" "$IDLE_P50")
verdict() { awk -v v="$1" -v g="$2" -v op="$3" 'BEGIN{if (v == "-") {print "-"; exit} ok=(op=="<"?v<g:v<=g); print ok?"ok":"MISSED"}'; }

echo
echo "## collabserve admin bench ($(date -u +%FT%TZ), $(nproc) cores, load:$(uptime | sed 's/.*load average://'))"
echo "checkpoint: $MODEL ($(mb "$CKPT_BYTES"); model.safetensors $(mb "$WEIGHT_BYTES")), rank $RANK;"
echo "latency: collabctl bench --model=demo (tiny) --concurrency=$CONCURRENCY --input_tokens=$INPUT_TOKENS --duration_s=$BENCH_S"
echo
printf "| %-44s | %-22s | %-10s | %-6s |\n" "metric" "value" "goal" "status"
printf "|%s|%s|%s|%s|\n" "$(printf -- '-%.0s' {1..46})" "$(printf -- '-%.0s' {1..24})" "$(printf -- '-%.0s' {1..12})" "$(printf -- '-%.0s' {1..8})"
row() { printf "| %-44s | %-22s | %-10s | %-6s |\n" "$1" "$2" "$3" "$4"; }
row "upload start -> job SUCCEEDED (s)" "$E2E_JOB" "" ""
row "upload start -> first Classify on bert (s)" "$E2E_LOADED" "< 60" "$(verdict "$E2E_LOADED" 60 '<')"
row "server RSS idle (demo only)" "$((RSS_IDLE_KB / 1024)) MiB" "" ""
row "server RSS after upload 1" "$((RSS_AFTER_KB / 1024)) MiB" "" ""
row "server peak RSS (VmHWM) after upload 1" "$((HWM_KB / 1024)) MiB" "" ""
row "peak RSS / checkpoint size" "${HWM_RATIO}x" "< 3x" "$(verdict "$HWM_RATIO" 3 '<')"
row "server VmHWM after upload 2" "$((HWM2_KB / 1024)) MiB" "" ""
row "classify p50 idle / during job (ms)" "$IDLE_P50 / $BUSY_P50" "" ""
row "classify p99 idle / during job (ms)" "$IDLE_P99 / $BUSY_P99" "" ""
row "classify rps idle / during job" "$IDLE_RPS / $BUSY_RPS" "" ""
row "p50 during/idle" "${P50_RATIO}x" "" ""
row "p99 during/idle" "${P99_RATIO}x" "<= 2x" "$(verdict "$P99_RATIO" 2 '<=')"
row "job overlap with 'during' bench (s)" "$OVERLAP" "" ""
row "job still running when bench ended" "$JOB_RUNNING_AT_END" "" ""
row "upload 2 start -> job end (s)" "$(secs "$U2S" "$U2E")" "" ""

# Per step of upload 1's job, sampled every 5 ms in the server (MemoryPhases). "peak" is the
# largest resident size seen during the step, of which "file" is mapped checkpoint pages (RssFile);
# "hwm" is the process's VmHWM when the step ended. x ckpt = peak / checkpoint size.
echo
echo "Server memory by job step (upload 1; idle RSS $((RSS_IDLE_KB / 1024)) MiB):"
echo
printf "| %-12s | %7s | %9s | %9s | %9s | %9s | %6s |\n" step "s" "RSS start" "RSS end" "peak" "of it file" "x ckpt"
printf "|%s|%s|%s|%s|%s|%s|%s|\n" "--------------" "---------" "-----------" "-----------" "-----------" "-----------" "--------"
if [[ -z $STEPS1 ]]; then
  echo "| (the server logged no memory by step: is it built from this tree?) |"
else
  awk -v ckpt="$CKPT_BYTES" '{
      gsub(/[:,()]/, " "); name=$1; secs=$2; start=$5; end=$7; peak=$10; file=$13;
      printf "| %-12s | %7s | %5d MiB | %5d MiB | %5d MiB | %6d MiB | %5.2fx |\n",
             name, secs, start, end, peak, file, peak * 1048576 / ckpt }' <<<"$STEPS1"
fi
