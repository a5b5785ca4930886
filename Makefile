# llmso-lab — the only commands a person needs: `make demo`, `make test` (and `make lab`).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch is installed first and pinned: on a CPU-only host pip takes the 2.13.0 CPU wheel (fast, small);
# on a GPU host the same pin pulls PyPI's default CUDA build. Override with `make setup TORCH_SPEC=...`.
TORCH_SPEC ?= torch==2.13.0
export TRITON_INTERPRET ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 0 || echo 1)

.PHONY: setup demo test test-fast lab release gpu-bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	@touch $@
	@echo "setup done: $(VENV)"

demo: setup
	$(VENV)/bin/llmso-lab demo

# Unit tests, grading tests, then every solution notebook top to bottom (nbval, outputs not compared).
test: setup
	TRITON_INTERPRET=1 LLMSO_LAB_QUICK=1 $(PY) -m pytest -q -ra tests
	TRITON_INTERPRET=1 LLMSO_LAB_QUICK=1 $(PY) -m pytest -q -ra --nbval-lax --nbval-current-env -p no:cacheprovider solutions

test-fast: setup
	TRITON_INTERPRET=1 LLMSO_LAB_QUICK=1 $(PY) -m pytest -q -m "not slow" tests

lab: setup
	$(VENV)/bin/jupyter lab labs/

release: setup
	$(VENV)/bin/llmso-lab release --out dist/student

GPU_NAME = $$($(PY) -c "import torch;print(torch.cuda.get_device_name(0).replace(' ','-') if torch.cuda.is_available() else 'cpu')")
gpu-bench: setup
	$(VENV)/bin/llmso-lab bench attention --json data/gpu_results/attention-$(GPU_NAME).json
	$(VENV)/bin/llmso-lab bench w4a16 --json data/gpu_results/w4a16-$(GPU_NAME).json

clean:
	rm -rf $(VENV) out dist .pytest_cache
