# The README's commands. Each one installs what is missing first (scripts/install-deps.sh is
# idempotent and fast when everything is there).
BUILD_DIR ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
PORT ?= 8500
METRICS_PORT ?= 9090
# Extra collabserve flags for `make run`, e.g. ARGS=--admin_token_file=/tmp/admin.token
ARGS ?=
# One compiler cache per machine, shared by every checkout: BASEDIR makes paths relative so a fresh
# clone elsewhere (CI) hits the cache too.
export CCACHE_DIR ?= $(HOME)/.cache/collabserve-ccache
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_MAXSIZE ?= 5G
export CCACHE_SLOPPINESS := pch_defines,time_macros,include_file_mtime,include_file_ctime
# The sanitizer trees compile with -g1, and with -g ccache also hashes the working directory, so a
# fresh clone elsewhere missed the cache and rebuilt build-asan from nothing (the Release tree, no -g,
# always hit). Debug info then names the directory the object was first compiled in.
export CCACHE_NOHASHDIR := 1

.PHONY: all deps configure build test test-all test-asan test-tsan run bench soak clean fuzz demo-model \
        check-libtorch2 gpu-check-bare check-fresh-debian check-image

all: build

deps:
	@scripts/install-deps.sh

$(BUILD_DIR)/build.ninja:
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

configure: deps $(BUILD_DIR)/build.ninja

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

# SANITIZERS: after the normal suite, also run it under these sanitizers (scripts/sanitizer-tests.sh:
# asan = ASan + UBSan in build-asan, tsan = TSan in build-tsan). Off for `make test`, the command a
# newcomer runs: on a fresh machine with an empty compiler cache the ASan tree alone costs ~40 min
# to build. CI runs both (`.ci/run`: `make test SANITIZERS="asan tsan"`, or `make test-all`).
SANITIZERS ?=
test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) --timeout 1500
	$(if $(strip $(SANITIZERS)),JOBS=$(JOBS) scripts/sanitizer-tests.sh $(SANITIZERS))

test-all:
	$(MAKE) test SANITIZERS="asan tsan"

test-asan: deps
	JOBS=$(JOBS) scripts/sanitizer-tests.sh asan

test-tsan: deps
	JOBS=$(JOBS) scripts/sanitizer-tests.sh tsan

# Compiles the LibTorch code against LibTorch 2.x headers (Debian trixie's libtorch-dev, fetched
# once into $(BUILD_DIR)/libtorch2), as the CUDA image will build it (C++17), and as C++20, the
# standard LibTorch 2.13 and later need; CI runs both on server/ and tests/.
check-libtorch2: build
	CXX_STANDARD=17 JOBS=$(JOBS) scripts/check-libtorch2.sh $(BUILD_DIR)
	CXX_STANDARD=20 JOBS=$(JOBS) scripts/check-libtorch2.sh $(BUILD_DIR)

# scripts/gpu-check.sh's CPU form as a GPU image with PyTorch alone would run it: abseil, glog,
# GoogleTest and nlohmann-json from a --pack-deps folder, Debian's copies hidden (--bare; in CI).
gpu-check-bare: deps
	scripts/gpu-check.sh --device cpu --quick --bare --build-dir $(BUILD_DIR)-gpu-bare --jobs $(JOBS)

# `make test` on a fresh root of another Debian release (SUITE, default trixie: LibTorch 2.6, GCC 14)
# from the committed HEAD; needs root and mmdebstrap, ~40 min. Not in CI (network, time).
SUITE ?= trixie
check-fresh-debian:
	JOBS=$(JOBS) scripts/check-fresh-debian.sh $(SUITE)

# The CPU image built from the committed HEAD and run as the Helm chart runs it (read-only root, no
# capabilities, user 10001, a model volume): the demo's answers, an upload compressed and served,
# SIGTERM, a restart. Needs a Docker engine; ~25 min. Not in CI (Docker, network, time).
check-image:
	scripts/check-image.sh

run: build
	scripts/run-demo.sh $(BUILD_DIR) $(PORT) $(METRICS_PORT) $(ARGS)

bench: build
	scripts/run-bench.sh $(BUILD_DIR)

# Bounded soak (bench/soak, issue 7): SOAK_MINUTES at 80% of the saturation measured in the same
# run, a version dropped every minute, compression jobs through the Admin API, clients with
# deadlines; exits 1 on a failure code other than shedding, RSS growth > 5% (the lowest sampled in
# the last interval against the second's), fd or thread leaks.
# `make test` runs a one-minute form (ctest soak_short).
SOAK_MINUTES ?= 10
SOAK_PRESET ?= mini
soak: build
	$(BUILD_DIR)/bin/collabserve-soak --minutes=$(SOAK_MINUTES) --preset=$(SOAK_PRESET) \
	  --markdown=$(BUILD_DIR)/soak-results.md

# libFuzzer targets (clang, ASan + UBSan) in their own build dir, each run FUZZ_SECONDS on a copy of
# its seed corpus; see tests/fuzz/run_fuzz.sh.
FUZZ_SECONDS ?= 60
fuzz: deps
	tests/fuzz/run_fuzz.sh --build-dir build-fuzz --seconds $(FUZZ_SECONDS)

# Retrains the built-in demo model from Debian's package descriptions (scripts/demo_model/, about an
# hour on 2 cores): writes server/model/demo/ (compiled into the binaries at the next build) and
# tests/data/demo/ (test split, calibration text, training report).
demo-model: build
	/usr/bin/python3 scripts/demo_model/train_demo.py --tokenizer_bin $(BUILD_DIR)/bin/collabserve-model \
	  --model_out server/model/demo --data_out tests/data/demo
	cmake --build $(BUILD_DIR) -j $(JOBS)

clean:
	rm -rf $(BUILD_DIR)
