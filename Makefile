# The two commands of the README: `make run` (the default continual run) and `make test` (the test suite).
# Each creates the virtual environment and installs what it needs on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= recipes/configs/digits.yaml
# The demo run replaces its previous run folder; any ARGS of yours replace this (e.g. ARGS=resume_from_checkpoint=true).
ARGS ?= overwrite_output_dir=true

.PHONY: install run test test-all lint bench clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev,plots]"
	touch $@

install: $(VENV)/.installed

run: install
	$(PY) recipes/train.py --config $(CONFIG) $(ARGS)

test: install
	$(PY) -m pytest -q

test-all: install
	$(PY) -m pytest -q -m "slow or not slow"

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) benchmarks/framework_overhead.py
	$(PY) benchmarks/eval_scaling.py
	$(PY) benchmarks/method_speed.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
