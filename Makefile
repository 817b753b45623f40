# The two commands of the README: `make run` (the default continual run) and `make test` (the test suite).
# Each creates the virtual environment and installs what it needs on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= recipes/configs/digits.yaml
# The demo run replaces its previous run folder; any ARGS of yours replace this (e.g. ARGS=resume_from_checkpoint=true).
ARGS ?= overwrite_output_dir=true
# The test suite runs on this many processes (pytest-xdist; each test module stays on one, so its module-scoped runs
# are built once; each worker uses one thread, tests/conftest.py). 1: one process, no xdist.
TEST_WORKERS ?= 2
PYTEST_PARALLEL := $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

.PHONY: install run test test-all lint docs bench clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev,plots]"
	touch $@

install: $(VENV)/.installed

run: install
	$(PY) recipes/train.py --config $(CONFIG) $(ARGS)

test: install
	$(PY) -m pytest -q $(PYTEST_PARALLEL)

test-all: install
	$(PY) -m pytest -q $(PYTEST_PARALLEL) -m "slow or not slow"

# ruff on everything, mypy on hf_ccl/ (pyproject's [tool.mypy]: the package ships py.typed, so its types must hold).
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The docs site (mkdocs.yml, docs/): installs the `docs` extra through the same constraints, then builds into site/
# with --strict, so a broken link or anchor, or a docstring that does not render, fails the build.
$(VENV)/.docs-installed: $(VENV)/.installed
	$(PY) -m pip install --quiet -c constraints.txt -e ".[docs]"
	touch $@

docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: install
	$(PY) benchmarks/framework_overhead.py
	$(PY) benchmarks/eval_scaling.py
	$(PY) benchmarks/method_speed.py

clean:
	rm -rf $(VENV) outputs site .pytest_cache
