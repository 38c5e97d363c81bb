# routelab: one-command setup, main job and tests.
#
#   make run    create .venv, install routelab, run `routelab reproduce --quick`
#   make test   create .venv, install routelab, run the test suite
#   make bench  run the balanced-assignment benchmark
#   make clean  remove the venv, build outputs and results
#
# torch is pinned here, not in pyproject.toml: `torch==2.13.0` resolves to the
# CPU build available locally, whereas an unpinned torch would pull several GB
# of CUDA packages. It is installed first so that `pip install -e .` finds the
# `torch>=2.2` requirement already satisfied.

PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
OUT ?= results

.PHONY: all venv run test bench clean

all: run

venv: $(STAMP)

# The interpreter: created once; never upgrades pip (installs must work offline).
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Re-install only when pyproject.toml changes (the editable install picks up
# source edits by itself), so repeated `make` calls are fast.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -e ".[dev]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/routelab reproduce --quick --out $(OUT)

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/routelab bench assignment

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .hypothesis $(OUT)
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
