# make demo : set up .venv, make a small sample dataset, run the ImageNet pipeline, print images/s
# make test : set up .venv if needed, then lint (ruff), type-check (mypy) and run the tests
# make lint : ruff (lint + format check) and mypy only; make format: apply ruff's fixes and format
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_DATA ?= .demo-data
DEMO_IMAGES ?= 1024
EXTRAS ?= dev,cuda12

.PHONY: demo test lint format clean

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[$(EXTRAS)]'
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

clean:
	rm -rf $(VENV) $(DEMO_DATA) .pytest_cache
