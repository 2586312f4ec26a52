#!/usr/bin/env bash
# Runs the benchmarks (`make bench`): one section per benchmark, each printing its own table.
#   scripts/run-bench.sh BUILD_DIR [SECTION...]     sections: engine compress serving admin batching
#                                                   (default: all, in that order)
# Environment: BENCH_THREADS (2), ENGINE_BENCH_FLAGS (extra flags for all three engine programs,
# e.g. "--batches=1,8 --seqs=16,128 --budget_s=2").
set -euo pipefail

BUILD_DIR=${1:?usage: run-bench.sh BUILD_DIR [SECTION...]}
shift
BUILD_DIR=$(cd "$BUILD_DIR" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=/usr/bin/python3  # Debian's Python, the one with torch
THREADS=${BENCH_THREADS:-2}
MODELS="$BUILD_DIR/bench-models"
SECTIONS=("$@")
[ ${#SECTIONS[@]} -eq 0 ] && SECTIONS=(engine compress serving admin batching)

# Same thread settings for every implementation: ATen/OpenMP, OpenBLAS and ONNX Runtime intra-op
# pools all get $THREADS threads; idle OpenMP workers sleep instead of spinning (on a shared or
# oversubscribed machine spinning workers steal the cores the BLAS threads need).
export OMP_NUM_THREADS=$THREADS OPENBLAS_NUM_THREADS=$THREADS OMP_WAIT_POLICY=PASSIVE

section_engine() {
  echo "== engine: Engine::Run vs PyTorch eager vs ONNX Runtime (BERT-base shape, random weights) =="
  local model_tool="$BUILD_DIR/bin/collabserve-model" bench="$BUILD_DIR/bin/engine_bench"
  for f in "$model_tool" "$bench"; do
    [ -x "$f" ] || { echo "run-bench: $f is missing (build the targets collabserve-model and engine_bench)" >&2; return 1; }
  done
  if [ ! -d "$ROOT/bench/engine/node_modules/onnxruntime-node" ]; then
    (cd "$ROOT/bench/engine" && ONNXRUNTIME_NODE_INSTALL_CUDA=skip npm ci --no-audit --no-fund --loglevel=error)
  fi
  mkdir -p "$MODELS"
  # Cached: the checkpoint is deterministic and compressing it takes minutes.
  if [ ! -f "$MODELS/base/config.json" ]; then
    rm -rf "$MODELS/base"
    "$model_tool" make --out "$MODELS/base" --preset base
  fi
  # D~ = D_k/2 and D_k/4.
  for r in 384 192; do
    if [ ! -f "$MODELS/base-collab$r/config.json" ]; then
      rm -rf "$MODELS/base-collab$r"
      "$model_tool" compress --model "$MODELS/base" --out "$MODELS/base-collab$r" --rank "$r" >/dev/null
    fi
  done
  # Each program's own results stay next to the models (the README's table is made from them).
  local work="$BUILD_DIR/bench-results"
  mkdir -p "$work"
  # shellcheck disable=SC2086  # ENGINE_BENCH_FLAGS is a list of flags
  local flags=(--threads="$THREADS" ${ENGINE_BENCH_FLAGS:-})
  local pyflags=()
  for f in "${flags[@]}"; do pyflags+=("${f%%=*}" "${f#*=}"); done
  if [ ! -f "$MODELS/base/model.onnx" ]; then
    "$PY" "$ROOT/bench/engine/pytorch_bench.py" --model "$MODELS/base" --out "$work/pytorch.tsv" \
      --export_onnx "$MODELS/base/model.onnx" "${pyflags[@]}"
  else
    "$PY" "$ROOT/bench/engine/pytorch_bench.py" --model "$MODELS/base" --out "$work/pytorch.tsv" "${pyflags[@]}"
  fi
  node "$ROOT/bench/engine/ort_bench.mjs" --model "$MODELS/base/model.onnx" --out "$work/ort.tsv" "${pyflags[@]}"
  "$bench" --model="$MODELS/base" --collab_model="$MODELS/base-collab384,$MODELS/base-collab192" \
    --pytorch_tsv="$work/pytorch.tsv" --ort_tsv="$work/ort.tsv" \
    --tsv_out="$work/collabserve.tsv" "${flags[@]}"
}

section_compress() {
  echo "== compress: factorised CP-ALS vs dense (textbook) CP-ALS, one BERT-base layer =="
  "$BUILD_DIR/bin/cp_bench"
  echo
  echo "== compress: whole BERT-base-shaped model (12 layers), collabserve-model compress =="
  local model_tool="$BUILD_DIR/bin/collabserve-model" out="$BUILD_DIR/bench-results/compress"
  mkdir -p "$MODELS" "$out"
  [ -f "$MODELS/base/config.json" ] || { rm -rf "$MODELS/base"; "$model_tool" make --out "$MODELS/base" --preset base >/dev/null; }
  [ -f "$MODELS/base-planted/config.json" ] || { rm -rf "$MODELS/base-planted";
    "$model_tool" make --out "$MODELS/base-planted" --preset base --planted_rank 256 >/dev/null; }
  printf '%-8s %-5s %9s %9s %10s %10s %9s %9s %9s\n' model rank wall_s cp_s max_err qk_ratio top1 max_dlogit mean_kl
  for m in base base-planted; do
    for r in 384 256; do
      rm -rf "$out/$m-$r"
      local t0=$(date +%s.%N)
      "$model_tool" compress --model "$MODELS/$m" --out "$out/$m-$r" --rank "$r" > "$out/$m-$r.json"
      local t1=$(date +%s.%N)
      "$PY" - "$out/$m-$r.json" "$m" "$r" "$t0" "$t1" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
err = max(l["relative_error"] for l in r["layers"])
p, f = r["parameters"], r["fidelity"]
print(f"{sys.argv[2]:<8} {sys.argv[3]:<5} {float(sys.argv[5]) - float(sys.argv[4]):9.1f} {r['decompose_seconds']:9.1f} {err:10.4f} "
      f"{p['attention_qk_ratio']:10.2f} {f['top1_agreement']:9.3f} {f['max_abs_logit_diff']:9.3f} {f['mean_kl']:9.4f}")
PYEOF
    done
  done
}

section_serving() {
  # The goal run: the BERT-base shape, one input per unary call (README, "Serving and batching").
  echo "== serving: collabserve under closed-loop load vs the raw engine (same run), BERT-base shape =="
  PRESET=base TOKENS=32 MAX_BATCH=16 RAW_BATCHES=8,16 DELAY_US=15000 CONCURRENCY="8 16 32 48" \
    DURATION_S=10 "$ROOT/bench/serving/run_serving_bench.sh" "$BUILD_DIR"
  # The stress run: a small model, where gRPC's per-call CPU is a visible share of an input's cost.
  echo "== serving: the same on the mini model (4 x 256), where per-call overhead shows =="
  "$ROOT/bench/serving/run_serving_bench.sh" "$BUILD_DIR"
}

section_admin() {
  echo "== admin: upload + compress + load a BERT-base-shaped checkpoint; classify p99 during the job =="
  "$ROOT/bench/admin/run_admin_bench.sh" "$BUILD_DIR"
}

section_batching() {
  echo "== batching: the scheduler alone, arrival order vs length-aware =="
  "$BUILD_DIR/bin/batching_bench"
}

for s in "${SECTIONS[@]}"; do
  case "$s" in
    engine) section_engine ;;
    compress) section_compress ;;
    serving) section_serving ;;
    admin) section_admin ;;
    batching) section_batching ;;
    *) echo "run-bench: unknown section '$s'" >&2; exit 2 ;;
  esac
  echo
done
