# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv and install shoal with the pinned constraints on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)  ## the built-in simulation: Synthetic(1,1), 30 clients, logistic regression
	$(BIN)/shoal simulate --out runs/demo

lint: $(STAMP)  ## ruff (lint + format check) and mypy
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python .ci/typecheck.py

test: lint  ## lint and types, then the whole test suite
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=15

clean:
	rm -rf runs .pytest_cache
