#!/usr/bin/env bash
# `make run`: serves the built-in demo model ("demo": the section of a Debian package from its
# description, trained by `make demo-model`; server/model/demo/) with
# build/bin/collabserve on the given ports until Ctrl-C (SIGINT drains and exits 0).
#   scripts/run-demo.sh [BUILD_DIR=build] [PORT=8500] [METRICS_PORT=9090] [extra collabserve flags...]
set -euo pipefail
build_dir=${1:-build}
port=${2:-8500}
metrics_port=${3:-9090}
shift $(( $# < 3 ? $# : 3 ))
bin="$build_dir/bin/collabserve"
if [[ ! -x "$bin" ]]; then
  echo "run-demo: $bin not found; build first (make build)" >&2
  exit 1
fi
echo "run-demo: serving the demo model on :$port (metrics :$metrics_port)."
echo "run-demo: try: $build_dir/bin/collabctl --address=127.0.0.1:$port classify --model=demo 'a 3D racing game with split-screen multiplayer'"
echo "run-demo: or over REST (--http_port, 8000): curl -s localhost:8000/v2/models/demo/infer -d '{\"inputs\":[{\"name\":\"text\",\"shape\":[1],\"datatype\":\"BYTES\",\"data\":[\"IMAP and POP3 mail server\"]}]}'"
echo "run-demo: or text-embeddings-inference's API: curl -s localhost:8000/predict -d '{\"inputs\":\"IMAP and POP3 mail server\"}'"
# The demo's own repository gains models (an upload); its root TEI routes keep serving "demo".
default_model=(--http_default_model=demo)
for arg in "$@"; do
  [[ "$arg" == --model_repository* ]] && default_model=()
done
exec "$bin" --port="$port" --metrics_port="$metrics_port" "${default_model[@]}" "$@"
