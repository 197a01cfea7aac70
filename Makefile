# make demo     : set up .venv, make a small sample dataset, run the ImageNet pipeline, print images/s
# make test     : set up .venv if needed, then lint (ruff), type-check (mypy) and run the tests (the docs' strict build too)
# make docs     : the documentation site in build/site (mkdocs-material; open build/site/index.html)
# make test-gpu : the gpu-marked tests and `gpupipe doctor --run` (on a machine with a GPU)
#                 PART=K/N: the K-th of N slices of them (doctor with the first), for runs split over calls
# make bench-gpu: gpupipe's recipes beside DALI by hand (bench/gpu.py; a GPU machine, ~5 min); writes bench/results/
#                 (PY=python3: use that interpreter as it is, e.g. on a machine without a package registry)
# make lint     : ruff (lint + format check) and mypy only; make format: apply ruff's fixes and format
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_DATA ?= .demo-data
DEMO_IMAGES ?= 1024

# The CUDA version of the NVIDIA driver (nvidia-smi's "CUDA Version"), whose major picks the builds:
# torch, DALI and CuPy must not need a newer CUDA than the driver supports. Override: make CUDA=12.
#   13 or newer: PyPI's torch (a CUDA 13 build), DALI and CuPy for CUDA 13
#   12:          the newest torch on PyTorch's CUDA 12 index (TORCH_INDEX), DALI and CuPy for CUDA 12
#   none (no driver, as in CI): PyPI's torch and DALI for CUDA 12, both on the CPU
CUDA ?= $(shell nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9.]*\).*/\1/p' | head -n 1)
CUDA_MAJOR := $(firstword $(subst ., ,$(CUDA)))
CONSTRAINTS := constraints.txt
ifeq ($(CUDA_MAJOR),)
  EXTRAS ?= dev,cuda12
else ifeq ($(CUDA_MAJOR),12)
  EXTRAS ?= dev,cuda12,cupy12
  TORCH_INDEX ?= https://download.pytorch.org/whl/cu126
  CONSTRAINTS := $(VENV)/constraints-cuda12.txt
else ifeq ($(shell test "$(CUDA_MAJOR)" -ge 13 2>/dev/null && echo yes),yes)
  EXTRAS ?= dev,cuda13,cupy13
else
  $(error the NVIDIA driver supports CUDA $(CUDA): DALI 2.4 needs 12 or newer; update the driver, or run make CUDA= for a CPU-only install)
endif

# The interpreter's setup: the venv, unless PY names another interpreter (used as it is).
SETUP := $(if $(filter $(VENV)/bin/python,$(PY)),$(VENV)/.installed,)

.PHONY: demo test test-gpu bench-gpu docs lint format clean

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# CUDA 12: torch and torchvision from TORCH_INDEX, then constraints without PyPI's (CUDA 13) torch pins
	$(if $(TORCH_INDEX),$(PY) -m pip install -q torch torchvision --index-url $(TORCH_INDEX))
	$(if $(TORCH_INDEX),grep -v '^torch' constraints.txt > $(CONSTRAINTS))
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[$(EXTRAS)]'
	touch $@

$(DEMO_DATA)/.done: | $(VENV)/.installed
	$(PY) -m gpupipe make-shards $(DEMO_DATA) --synthetic $(DEMO_IMAGES) --shard-size 128 --classes 10
	touch $@

demo: $(VENV)/.installed $(DEMO_DATA)/.done
	$(PY) -m gpupipe bench pipelines/imagenet.py:train '$(DEMO_DATA)/train-{000000..000007}.tar' \
		--batch-size 64 --epochs 3

lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

format: $(VENV)/.installed
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

test: lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

docs: $(SETUP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict
	@echo "open build/site/index.html"

test-gpu: $(SETUP)
	$(if $(filter-out 1/%,$(PART)),,$(PY) -m gpupipe doctor --run)
	$(PY) -m pytest -q -m gpu -rs $(if $(PART),--part $(PART)) $(PYTEST_ARGS)

bench-gpu: $(SETUP)
	$(PY) -m gpupipe doctor
	$(PY) bench/gpu.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(DEMO_DATA) .pytest_cache
