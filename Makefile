# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv and install shoal with the pinned constraints on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed

.PHONY: demo test test-fast lint bench clean

# The suite on JOBS pytest-xdist workers (the CI machine has 2 cores). --dist loadgroup keeps the
# tests of one xdist_group (the Ray runtimes; a module's tests that share a module fixture) on one
# worker, one after another; every other test goes to whichever worker is free.
JOBS   ?= 2
PYTEST  = $(BIN)/python -m pytest -q -p no:cacheprovider -n $(JOBS) --dist loadgroup

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)  ## the built-in simulation: Synthetic(1,1), 30 clients, logistic regression
	$(BIN)/shoal simulate --out runs/demo

lint: $(STAMP)  ## ruff (lint + format check), mypy, and no import cycle / private name imported across modules
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python .ci/typecheck.py
	$(BIN)/python .ci/import_check.py

test: lint  ## lint and types, then the whole test suite
	$(PYTEST) --durations=40

test-fast: $(STAMP)  ## the edit loop: every test not marked slow, no lint (make test before a commit)
	$(PYTEST) -m "not slow" $(ARGS)

clean:
	rm -rf runs .pytest_cache
