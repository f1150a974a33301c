# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create ./.venv on first use, with the project and its test/IO extras at
# the exact versions of requirements/ci.txt (see docs/development.md).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(BIN)/rh-dask-installed
LOCK := requirements/ci.txt
LOCKTOOL := requirements/lockfile.py
EXTRAS := dev,io,report,bench
OLDEST_LOCK ?= requirements/oldest.txt
OLDEST_VENV := .venv-oldest
PIP_QUIET := -q
# Extra pytest arguments for test and test-oldest, e.g. PYTEST_ARGS=tests/test_golden.py.
PYTEST_ARGS ?=

.PHONY: demo test test-oldest test-latest lock lint format clean

# The stamp holds "locked" when .venv is exactly the lock: pip and setuptools
# first (so the build backend is the locked one), then the project with
# --no-build-isolation, then a check that nothing outside the lock came in.
# The lock is made on CI's Python (its header names the minor). On another
# Python the lock is still tried first; only where it cannot install there
# (no wheel of a pinned version for that Python) does .venv get the newest
# releases instead, the stamp saying "unlocked" and `make test` saying so.
$(STAMP): pyproject.toml $(LOCK)
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	@set -e; \
	$(PYTHON) $(LOCKTOOL) check-python $(LOCK) >/dev/null 2>&1 || echo "note: $(LOCK) was made" \
		"for another Python minor than $(PYTHON)'s; trying it all the same" >&2; \
	if $(BIN)/python -m pip install $(PIP_QUIET) -c $(LOCK) --upgrade pip setuptools && \
		$(BIN)/python -m pip install $(PIP_QUIET) -c $(LOCK) --no-build-isolation \
			-e ".[$(EXTRAS)]"; then \
		$(BIN)/python $(LOCKTOOL) verify $(LOCK); \
		echo locked > $@; \
	elif $(PYTHON) $(LOCKTOOL) check-python $(LOCK) >/dev/null 2>&1; then \
		echo "error: $(LOCK) does not satisfy pyproject.toml; refresh it with: make lock" >&2; \
		exit 1; \
	else \
		echo "note: $(LOCK) cannot install on this Python: installing the newest releases" >&2; \
		$(BIN)/python -m pip install $(PIP_QUIET) --upgrade pip setuptools; \
		$(BIN)/python -m pip install $(PIP_QUIET) --no-build-isolation -e ".[$(EXTRAS)]"; \
		echo unlocked > $@; \
	fi

# Writes a generated stream to a temporary Parquet dataset, fits it on a local
# cluster (CUDA when dask-cuda sees a GPU), saves rh-dask-output/demo/.
demo: $(STAMP)
	$(BIN)/rh-dask demo

# The locked suite: what decides CI (where CI=true, an unlocked .venv is an
# error). pytest's own exit status (5 when no test ran) fails the target.
test: $(STAMP)
	@if ! grep -qx locked $(STAMP); then \
		if [ "$${CI:-}" = true ]; then echo "error: $(VENV) was not installed from $(LOCK)" >&2; \
			exit 1; fi; \
		echo "note: $(VENV) holds the newest releases, not $(LOCK) (another Python)" >&2; \
	fi
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The suite on the oldest supported Dask: a fresh .venv-oldest constrained by
# OLDEST_LOCK (any name==version file; `make test-oldest OLDEST_LOCK=...`).
# The project builds in pip's isolated build environment (pyproject.toml's
# build-system), which -c does not constrain: the lock may pin any setuptools.
test-oldest:
	@test -f $(OLDEST_LOCK) || { echo "error: no $(OLDEST_LOCK)" >&2; exit 1; }
	$(PYTHON) $(LOCKTOOL) check-python $(OLDEST_LOCK)
	rm -rf $(OLDEST_VENV)
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install $(PIP_QUIET) -c $(OLDEST_LOCK) --upgrade pip setuptools
	$(OLDEST_VENV)/bin/python -m pip install $(PIP_QUIET) -c $(OLDEST_LOCK) -e ".[dev,io,report]"
	@$(OLDEST_VENV)/bin/python $(LOCKTOOL) versions dask distributed numpy pandas
	$(OLDEST_VENV)/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

# The suite against the newest releases (no lock) in .venv-latest; prints a
# DRIFT STAGE banner and keeps pytest's output in .ci-logs/drift.log.
test-latest:
	PYTHON=$(PYTHON) bash .ci/drift

# Refreshes requirements/ci.txt: a throwaway environment with the newest
# releases of everything pyproject.toml asks for, frozen.
lock:
	@set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	$(PYTHON) -m venv "$$tmp/venv"; \
	"$$tmp/venv/bin/python" -m pip install $(PIP_QUIET) --upgrade pip setuptools; \
	"$$tmp/venv/bin/python" -m pip install $(PIP_QUIET) --upgrade --no-build-isolation -e \
		".[$(EXTRAS)]"; \
	"$$tmp/venv/bin/python" $(LOCKTOOL) write $(LOCK)

lint: $(STAMP)
	$(BIN)/ruff format --check . && $(BIN)/ruff check .

format: $(STAMP)
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .venv-latest $(OLDEST_VENV) .ci-logs .pytest_cache .ruff_cache
