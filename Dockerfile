# collabserve images.
#   docker build -t collabserve:0.1.0 .                          CPU image (default target: the last stage)
#   docker build --target cuda -t collabserve:0.1.0-cuda .       NVIDIA GPU image
# The CPU image is built from debian:bookworm exactly as on a developer's machine:
# scripts/install-deps.sh, then `make build`. Both runtime stages have the three binaries and, as
# files, the shared libraries they load that the base image lacks (deploy/docker/runtime-libs.sh,
# listed with their packages and versions in /usr/share/collabserve/runtime-libs.tsv), not those
# libraries' packages: Debian's libtorch1.13 depends on OpenCV, FFmpeg and Mesa, which the server
# never loads, and installing them made the CPU image twice the size.
#
# No `# syntax=` line: it would make every build pull a frontend image from Docker Hub first; the
# engine's own frontend has all this file uses, RUN --mount included, with BuildKit: the default
# builder from Docker 23.0; on 20.10-22.x, build with DOCKER_BUILDKIT=1.
#
# `make check-image` (scripts/check-image.sh says what it checks) builds the CPU image and runs it as
# the Helm chart runs its pods. The `cuda` target has NOT been built: its base images and the
# LibTorch zip could not be fetched here, and it rests on unverified assumptions (the base image tags
# below exist; the official LibTorch, built without glog, links next to Ubuntu's glog). Checked by
# hand in an Ubuntu 24.04 root (2026-12-03): the cuda-build apt list below installs, and every
# translation unit compiles with its GCC 13, gRPC 1.51, protobuf 3.21 and abseil 20220623 against
# LibTorch 2.6 (Debian 13's, standing in for the official zip).

ARG DEBIAN_IMAGE=debian:bookworm
ARG DEBIAN_RUNTIME_IMAGE=debian:bookworm-slim
ARG CUDA_DEVEL_IMAGE=nvidia/cuda:12.6.3-cudnn-devel-ubuntu24.04
ARG CUDA_RUNTIME_IMAGE=nvidia/cuda:12.6.3-base-ubuntu24.04
# Official LibTorch, C++11 ABI, CUDA 12.6, with its CUDA/cuDNN libraries bundled ("with-deps").
ARG LIBTORCH_URL=https://download.pytorch.org/libtorch/cu126/libtorch-cxx11-abi-shared-with-deps-2.6.0%2Bcu126.zip
# Optional sha256 of that zip; checked when set.
ARG LIBTORCH_SHA256=

########################################################################################### CPU build
FROM ${DEBIAN_IMAGE} AS build
ENV DEBIAN_FRONTEND=noninteractive
WORKDIR /src
# Dependencies first, so that a source change does not reinstall them.
COPY scripts/install-deps.sh scripts/install-deps.sh
RUN scripts/install-deps.sh && rm -rf /var/lib/apt/lists/*
COPY . .
# Only the binaries: tests and benchmarks are not built into the image. ccache keeps its files in the
# cache mount, kept by the builder between builds (the Makefile's own default is under $HOME).
ENV CCACHE_DIR=/src/.ccache
RUN --mount=type=cache,target=/src/.ccache \
    make build BUILD_DIR=build CMAKE_FLAGS="-DCOLLABSERVE_BUILD_TESTS=OFF -DCOLLABSERVE_BUILD_BENCH=OFF" \
 && install -D -m 0755 -t /out/usr/local/bin build/bin/collabserve build/bin/collabctl build/bin/collabserve-model
RUN deploy/docker/runtime-libs.sh collect /out/libs \
      /out/usr/local/bin/collabserve /out/usr/local/bin/collabctl /out/usr/local/bin/collabserve-model

########################################################################################## CUDA build
FROM ${CUDA_DEVEL_IMAGE} AS cuda-build
ARG LIBTORCH_URL
ARG LIBTORCH_SHA256
ENV DEBIAN_FRONTEND=noninteractive
# Ubuntu 24.04 names of the packages in scripts/install-deps.sh's build list, less LibTorch (official
# CUDA build below) and the test-only ones.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      build-essential cmake ninja-build ccache pkg-config make curl ca-certificates unzip \
      libgoogle-glog-dev libjemalloc-dev libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler \
      prometheus-cpp-dev libabsl-dev nlohmann-json3-dev libssl-dev zlib1g-dev \
 && rm -rf /var/lib/apt/lists/*
RUN curl -fsSL --retry 3 -o /tmp/libtorch.zip "${LIBTORCH_URL}" \
 && if [ -n "${LIBTORCH_SHA256}" ]; then echo "${LIBTORCH_SHA256}  /tmp/libtorch.zip" | sha256sum -c -; fi \
 && unzip -q /tmp/libtorch.zip -d /opt \
 && rm /tmp/libtorch.zip \
 && test -f /opt/libtorch/share/cmake/Torch/TorchConfig.cmake
WORKDIR /src
COPY . .
# Not `make build`: it runs scripts/install-deps.sh, whose Debian package names (libtorch-dev) would
# pull Ubuntu's CPU LibTorch next to the official CUDA one. No GPU is needed to build; the arch list
# only matters to CUDA sources, which collabserve has none of.
ENV TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0" CCACHE_DIR=/src/.ccache
RUN --mount=type=cache,target=/src/.ccache \
    cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH=/opt/libtorch -DCOLLABSERVE_BUILD_TESTS=OFF -DCOLLABSERVE_BUILD_BENCH=OFF \
 && cmake --build build -j "$(nproc)" --target collabserve collabctl collabserve-model \
 && install -D -m 0755 -t /out/usr/local/bin build/bin/collabserve build/bin/collabctl build/bin/collabserve-model
# Not LibTorch's libraries (copied below as they are) nor the CUDA toolkit's (the runtime (cudart)
# that CMake links: the CUDA base image has it, and the check below finds it there).
RUN LD_LIBRARY_PATH=/opt/libtorch/lib deploy/docker/runtime-libs.sh collect --exclude /opt/libtorch/lib --exclude /usr/local/cuda /out/libs \
      /out/usr/local/bin/collabserve /out/usr/local/bin/collabctl /out/usr/local/bin/collabserve-model

######################################################################################## CUDA runtime
FROM ${CUDA_RUNTIME_IMAGE} AS cuda
# The libraries the base lacks, as files (deploy/docker/runtime-libs.sh), before the binaries, so
# that a new build that leaves them unchanged reuses this layer.
RUN --mount=type=bind,from=cuda-build,source=/out/libs,target=/tmp/libs \
    --mount=type=bind,from=cuda-build,source=/src/deploy/docker/runtime-libs.sh,target=/tmp/runtime-libs.sh \
    /tmp/runtime-libs.sh install /tmp/libs /usr/local/lib/collabserve \
 && groupadd --system --gid 10001 collabserve \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin collabserve \
 && install -d -o 10001 -g 10001 /models
# LibTorch's libraries, including the CUDA runtime, cuBLAS and cuDNN it was built with.
COPY --from=cuda-build /opt/libtorch/lib/ /opt/libtorch/lib/
COPY --from=cuda-build /out/usr/local/bin/ /usr/local/bin/
# Prepended, not replaced: the nvidia/cuda base's LD_LIBRARY_PATH (/usr/local/nvidia/lib64) is where
# some node images (GKE's driver installer) mount libcuda.so.1, with no ldconfig in the container.
ENV LD_LIBRARY_PATH=/opt/libtorch/lib:${LD_LIBRARY_PATH} \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    COLLABSERVE_HEALTH_ADDRESS=127.0.0.1:8500
# Fail the build, naming it, when a library is missing. libcuda.so.1 comes from the host driver at
# run time (NVIDIA container toolkit).
RUN --mount=type=bind,from=cuda-build,source=/src/deploy/docker/runtime-libs.sh,target=/tmp/runtime-libs.sh \
    /tmp/runtime-libs.sh check --allow-missing libcuda.so.1 \
      /usr/local/bin/collabserve /usr/local/bin/collabctl /usr/local/bin/collabserve-model
USER 10001:10001
EXPOSE 8500 8501 9090 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=180s --retries=3 \
  CMD collabctl --address="${COLLABSERVE_HEALTH_ADDRESS}" --deadline_ms=3000 health || exit 1
STOPSIGNAL SIGTERM
ENTRYPOINT ["collabserve"]
CMD ["--port=8500", "--admin_port=8501", "--metrics_port=9090", "--http_port=8000", "--device=cuda"]

######################################################################## CPU runtime (default target)
FROM ${DEBIAN_RUNTIME_IMAGE} AS runtime
# The libraries the base lacks, as files (deploy/docker/runtime-libs.sh), before the binaries, so
# that a new build that leaves them unchanged reuses this layer.
RUN --mount=type=bind,from=build,source=/out/libs,target=/tmp/libs \
    --mount=type=bind,from=build,source=/src/deploy/docker/runtime-libs.sh,target=/tmp/runtime-libs.sh \
    /tmp/runtime-libs.sh install /tmp/libs /usr/local/lib/collabserve \
 && groupadd --system --gid 10001 collabserve \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin collabserve \
 && install -d -o 10001 -g 10001 /models
COPY --from=build /out/usr/local/bin/ /usr/local/bin/
# Fail the build, naming it, when a library is missing.
RUN --mount=type=bind,from=build,source=/src/deploy/docker/runtime-libs.sh,target=/tmp/runtime-libs.sh \
    /tmp/runtime-libs.sh check /usr/local/bin/collabserve /usr/local/bin/collabctl /usr/local/bin/collabserve-model
ENV COLLABSERVE_HEALTH_ADDRESS=127.0.0.1:8500
# Non-root; the root filesystem can be mounted read-only (only /tmp and the model repository are written).
USER 10001:10001
# gRPC (Inference, Health, reflection), Admin, Prometheus metrics, REST (KServe v2 over HTTP).
EXPOSE 8500 8501 9090 8000
# Healthy when grpc.health.v1.Health reports SERVING (not while warming up or draining). Set
# COLLABSERVE_HEALTH_ADDRESS when --port changes. With --tls_cert the check cannot work: collabctl
# --tls verifies against system roots and the name 127.0.0.1; override HEALTHCHECK then.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD collabctl --address="${COLLABSERVE_HEALTH_ADDRESS}" --deadline_ms=3000 health || exit 1
# SIGTERM: NOT_SERVING, new calls UNAVAILABLE, in-flight work drains within --drain_timeout_s.
STOPSIGNAL SIGTERM
ENTRYPOINT ["collabserve"]
# Add --model_repository=/models (and mount a volume there) to serve a repository instead of the
# built-in demo model.
CMD ["--port=8500", "--admin_port=8501", "--metrics_port=9090", "--http_port=8000"]
