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

# Writes a generated stream to a temporary Parquet dataset, fits it on a local
# cluster (CUDA when dask-cuda sees a GPU), saves rh-dask-output/demo/.
demo: $(BIN)/rh-dask-installed
	$(BIN)/rh-dask demo

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
