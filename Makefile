# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create ./.venv with the project and its test/IO extras on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint format clean

$(BIN)/rh-dask-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev,io,report,bench]"
	touch $@

demo: $(BIN)/rh-dask-installed
	$(BIN)/python -m rh_dask.demo

test: $(BIN)/rh-dask-installed
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(BIN)/rh-dask-installed
	$(BIN)/ruff format --check . && $(BIN)/ruff check .

format: $(BIN)/rh-dask-installed
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
