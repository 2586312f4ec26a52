#!/usr/bin/env bash
# The CPU image, built from a commit (HEAD) and run the way the Helm chart runs its pods: read-only
# root filesystem, every capability dropped, no privilege escalation, user 10001, /tmp a tmpfs, the
# model repository a volume, the admin token a read-only file. Checks, in order:
#   1. `docker build` of the Dockerfile's default target (the build stage's `make build` included);
#   2. the image: user 10001, ports 8500 8501 9090, its HEALTHCHECK, its size;
#   3. the default command (the built-in demo model): Docker's health check turns "healthy",
#      classify gives the demo's answers, /metrics is served on the published port, the start-up
#      log names jemalloc as the allocator;
#   4. the chart's flags, an empty repository: upload the demo checkpoint through the Admin service
#      with compression, classify with the compressed model; SIGTERM drains and exits 0;
#   5. a second container on the same volume serves the compressed model from the repository.
#
#   scripts/check-image.sh
#
# Environment: REV (the commit to build; default HEAD), DOCKER (default docker), IMAGE (the tag to build; default collabserve:check),
# DOCKER_NETWORK (build and run network; "host" where the engine has no bridge network; default
# the engine's), BASE=auto|pull|mirror (where debian:bookworm and debian:bookworm-slim come from:
# pull them, or make one from Debian's mirror with mmdebstrap and `docker import` it as
# collabserve-check/debian:bookworm, kept for reruns (FRESH_BASE=1 remakes it); auto pulls, and
# makes it when the registry cannot be reached),
# MIRROR (default http://deb.debian.org/debian), KEEP=1 (keep the image, containers and volume),
# LOG (default /var/tmp/collabserve-check-image.log). Needs a Docker engine (20.10 or later) and,
# for BASE=mirror, mmdebstrap. About 25 min on 2 cores: 5 to install the build stage's packages,
# 15 to build from an empty compiler cache, 2 for the runtime stage, 1 to run.
# Exit status: 0 when every check passed.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
docker=${DOCKER:-docker}
image=${IMAGE:-collabserve:check}
network=${DOCKER_NETWORK:-}
base=${BASE:-auto}
mirror=${MIRROR:-http://deb.debian.org/debian}
log=${LOG:-/var/tmp/collabserve-check-image.log}
rev=$(git -C "$ROOT" rev-parse --verify "${REV:-HEAD}^{commit}")
name=collabserve-check-$$
volume=$name-models
secrets=$(mktemp -d /tmp/collabserve-check-image.XXXXXX)
chmod 0755 "$secrets"  # read by the containers' user 10001
context=$(mktemp -d /var/tmp/collabserve-check-image-context.XXXXXX)
: >"$log"
t0=$SECONDS

say() { echo "check-image: $*" | tee -a "$log" >&2; }
fail() { say "FAILED: $*"; exit 1; }
cleanup() {
  if [ "${KEEP:-0}" != 1 ]; then
    "$docker" rm -f "$name-demo" "$name-1" "$name-2" >/dev/null 2>&1 || true
    "$docker" volume rm "$volume" >/dev/null 2>&1 || true
  fi
  rm -rf "$secrets" "$context"
}
trap cleanup EXIT

"$docker" version --format '{{.Server.Version}}' >/dev/null 2>&1 ||
  { say "no Docker engine answers ('$docker version' failed)"; exit 2; }
net_flag=(); [ -z "$network" ] || net_flag=(--network "$network")

# --- base images ---------------------------------------------------------------------------------
build_args=()
make_base() {
  command -v mmdebstrap >/dev/null || fail "BASE=$base needs mmdebstrap (apt-get install mmdebstrap)"
  local tag=collabserve-check/debian:bookworm
  build_args=(--build-arg "DEBIAN_IMAGE=$tag" --build-arg "DEBIAN_RUNTIME_IMAGE=$tag")
  # Kept between runs, so that a rerun reuses the build's cached layers; FRESH_BASE=1 remakes it.
  if [ "${FRESH_BASE:-0}" != 1 ] && "$docker" image inspect "$tag" >/dev/null 2>&1; then
    say "using $tag, made $("$docker" image inspect -f '{{.Created}}' "$tag" | cut -c1-16) (FRESH_BASE=1 remakes it)"
    return 0
  fi
  say "making $tag from $mirror (mmdebstrap minbase, bookworm + updates + security)"
  local sec=${mirror%/debian}/debian-security
  mmdebstrap --variant=minbase bookworm - "deb $mirror bookworm main" \
      "deb $mirror bookworm-updates main" "deb $sec bookworm-security main" 2>>"$log" |
    "$docker" import -c 'CMD ["bash"]' - "$tag" >>"$log" || fail "making $tag (see $log)"
}
pull_base() { { "$docker" pull -q debian:bookworm && "$docker" pull -q debian:bookworm-slim; } >>"$log" 2>&1; }
case "$base" in
  mirror) make_base ;;
  pull) pull_base || fail "pulling debian:bookworm(-slim) (BASE=mirror makes the base from Debian's mirror)" ;;
  auto) pull_base || { say "the registry cannot be reached; the base comes from Debian's mirror"; make_base; } ;;
  *) say "BASE must be auto, pull or mirror, not '$base'"; exit 2 ;;
esac

# --- 1. build ------------------------------------------------------------------------------------
say "building $image from ${rev:0:10} (log: $log)"
tb=$SECONDS
# The commit's tree as the context, in a folder so that the client applies .dockerignore as it does
# to `docker build .` (it does not to a tar on stdin): no build trees or uncommitted changes.
git -C "$ROOT" archive --format=tar "$rev" | tar -x -C "$context"
DOCKER_BUILDKIT=1 "$docker" build --progress=plain "${net_flag[@]}" "${build_args[@]}" -t "$image" "$context" \
  >>"$log" 2>&1 || { tail -30 "$log" >&2; fail "docker build (see $log)"; }
say "built in $(( (SECONDS - tb) / 60 )) min $(( (SECONDS - tb) % 60 )) s"

# --- 2. the image --------------------------------------------------------------------------------
user=$("$docker" image inspect -f '{{.Config.User}}' "$image")
ports=$("$docker" image inspect -f '{{range $p, $_ := .Config.ExposedPorts}}{{$p}} {{end}}' "$image")
health=$("$docker" image inspect -f '{{if .Config.Healthcheck}}{{join .Config.Healthcheck.Test " "}}{{end}}' "$image")
size=$("$docker" image inspect -f '{{.Size}}' "$image")
say "image: user $user, ports $ports, $(( size / 1048576 )) MiB; health check: $health"
[ "$user" = 10001:10001 ] || fail "the image runs as '$user', not 10001:10001"
for p in 8500/tcp 8501/tcp 9090/tcp; do [[ " $ports" == *" $p "* ]] || fail "port $p not exposed"; done
[ -n "$health" ] || fail "no HEALTHCHECK"

# --- running containers --------------------------------------------------------------------------
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# The pod's security context and volumes (helm/collabserve/values.yaml, templates/deployment.yaml).
# shellcheck disable=SC2054  # the commas are tmpfs's mount options
pod_flags=(--read-only --tmpfs /tmp:rw,nosuid,nodev --cap-drop ALL --security-opt no-new-privileges
           --user 10001:10001)
# With the host's network the server takes free host ports; otherwise the standard ones, published
# on 127.0.0.1 at ports the engine picks.
start() {  # NAME [extra docker run flags...] -- [collabserve flags...]
  local cname=$1; shift
  local run=() args=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do run+=("$1"); shift; done
  [ $# -gt 0 ] && shift; args=("$@")
  if [ "$network" = host ]; then
    gport=$(free_port); aport=$(free_port); mport=$(free_port)
    "$docker" run -d --name "$cname" --network host "${pod_flags[@]}" \
      -e "COLLABSERVE_HEALTH_ADDRESS=127.0.0.1:$gport" "${run[@]}" "$image" \
      --port="$gport" --admin_port="$aport" --metrics_port="$mport" "${args[@]}" >>"$log"
  else
    "$docker" run -d --name "$cname" "${net_flag[@]}" "${pod_flags[@]}" \
      -p 127.0.0.1::8500 -p 127.0.0.1::8501 -p 127.0.0.1::9090 "${run[@]}" "$image" \
      --port=8500 --admin_port=8501 --metrics_port=9090 "${args[@]}" >>"$log"
    gport=$("$docker" port "$cname" 8500/tcp | head -1 | sed 's/.*://')
    aport=$("$docker" port "$cname" 8501/tcp | head -1 | sed 's/.*://')
    mport=$("$docker" port "$cname" 9090/tcp | head -1 | sed 's/.*://')
  fi
}
wait_healthy() {  # NAME: Docker's own HEALTHCHECK (collabctl health inside the container)
  local cname=$1 ts=$SECONDS status=
  while [ $((SECONDS - ts)) -lt 300 ]; do
    status=$("$docker" inspect -f '{{.State.Status}} {{.State.Health.Status}}' "$cname")
    case "$status" in
      "running healthy") say "$cname healthy after $((SECONDS - ts)) s"; return 0 ;;
      "running unhealthy"|exited*|dead*) break ;;
    esac
    sleep 2
  done
  "$docker" logs --tail 40 "$cname" >&2 || true
  fail "$cname is '$status' after $((SECONDS - ts)) s"
}
# The image's own client, run in a container that shares the server's network: what a pod beside it
# would run, without a client built on this host.
ctl() {  # NAME PORT collabctl-args...   (PORT: $gport for inference, $aport for the Admin service)
  local cname=$1 port=$2; shift 2
  "$docker" run --rm --network "container:$cname" "${pod_flags[@]}" -v "$secrets:/etc/collabserve/admin:ro" \
    -v "$ROOT/server/model/demo:/demo:ro" -v "$ROOT/tests/data/demo:/data:ro" \
    --entrypoint collabctl "$image" --address="127.0.0.1:$port" "$@"
}
expect() {  # WHAT PATTERN OUTPUT
  grep -qE "$2" <<<"$3" || { echo "$3" >&2; fail "$1: no match for '$2'"; }
}
metrics() { curl -fsS --max-time 10 "http://127.0.0.1:$mport/metrics"; }
# The demo's answers (README): games, graphics, mail.
texts=("a 3D racing game with split-screen multiplayer" "command-line tool to convert between image formats"
       "IMAP and POP3 mail server")
check_answers() {  # WHAT OUTPUT
  local out=$2
  if [ "$(grep -cE '^(games|graphics|mail)[[:space:]]' <<<"$out")" != 3 ] || ! grep -qE '^games[[:space:]].*racing' <<<"$out" ||
     ! grep -qE '^graphics[[:space:]].*image formats' <<<"$out" || ! grep -qE '^mail[[:space:]].*IMAP' <<<"$out"; then
    echo "$out" >&2; fail "$1: not the demo's answers"
  fi
}

# --- 3. the default command: the built-in demo model ---------------------------------------------
start "$name-demo" --
wait_healthy "$name-demo"
out=$(ctl "$name-demo" "$gport" classify "${texts[@]}") || fail "classify on the default command"
check_answers "demo model" "$out"
m=$(metrics) || fail "GET /metrics on the published port $mport"
expect "/metrics" '^collabserve_model_parameters\{.*model="demo"' "$m"
# The allocator the server is built with is the one it runs on (the library came with the image).
expect "start-up log" 'allocator: jemalloc ' "$("$docker" logs "$name-demo" 2>&1)"
say "default command: demo answers right, /metrics served, allocator jemalloc"
"$docker" rm -f "$name-demo" >/dev/null

# --- 4. the chart's flags: repository volume, admin token, upload with compression ----------------
head -c 32 /dev/urandom | base64 >"$secrets/token"
chmod 0644 "$secrets/token"
"$docker" volume create "$volume" >/dev/null
# A fresh named volume takes the image's /models (owned by 10001), as a pod's fsGroup makes its PVC.
chart=(-v "$volume:/models" -v "$secrets:/etc/collabserve/admin:ro" --)
chart_args=(--model_repository=/models --admin_token_file=/etc/collabserve/admin/token --drain_timeout_s=10)
start "$name-1" "${chart[@]}" "${chart_args[@]}"
wait_healthy "$name-1"
out=$(ctl "$name-1" "$aport" --deadline_ms=600000 upload --token_file=/etc/collabserve/admin/token --dir=/demo \
        --name=demo-small --rank=64 --calibration=/data/calibration.txt --wait 2>&1) ||
  { echo "$out" >&2; fail "upload with --rank=64"; }
echo "$out" >>"$log"
job=$(grep -E ' UPLOAD +SUCCEEDED ' <<<"$out" | tail -1) || { echo "$out" >&2; fail "upload: the job did not succeed"; }
say "upload job: $(tr -s ' ' <<<"$job")"
out=$(ctl "$name-1" "$gport" --model=demo-small classify "${texts[@]}") || fail "classify demo-small"
check_answers "demo-small (D̃ = 64)" "$out"
m=$(metrics) || fail "GET /metrics"
expect "/metrics" '^collabserve_model_parameters\{.*model="demo-small"' "$m"
say "chart's flags: uploaded, compressed at D̃ = 64 and served; answers right"
ts=$SECONDS
"$docker" stop -t 30 "$name-1" >/dev/null
code=$("$docker" inspect -f '{{.State.ExitCode}}' "$name-1")
[ "$code" = 0 ] || { "$docker" logs --tail 20 "$name-1" >&2; fail "SIGTERM: exit status $code, not 0"; }
say "SIGTERM: drained and exited 0 in $((SECONDS - ts)) s"

# --- 5. the same volume, a new container ---------------------------------------------------------
start "$name-2" "${chart[@]}" "${chart_args[@]}"
wait_healthy "$name-2"
out=$(ctl "$name-2" "$gport" models) || fail "models after restart"
expect "models after restart" 'demo-small' "$out"
out=$(ctl "$name-2" "$gport" --model=demo-small classify "${texts[@]}") || fail "classify demo-small after restart"
check_answers "demo-small after restart" "$out"
say "restart: demo-small served from the volume"
if [ "${KEEP:-0}" != 1 ]; then "$docker" image rm "$image" >/dev/null 2>&1 || true; fi
say "all checks passed in $(( (SECONDS - t0) / 60 )) min (log: $log)"
