# Two commands: `make demo` and `make test` (lint: ruff + mypy + import layers; the docs site; then doctests and pytest); `make referees` runs the slow checks by the trainers themselves (torchtitan resumes). Each creates .venv if it is missing and installs what it needs.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-dev
XLA     := XLA_FLAGS=--xla_force_host_platform_device_count=8
SRC     := ucp_jax tests $(wildcard benchmarks)

.PHONY: demo test test-gpu test-few-devices test-py312 lint docs format bench clean referees maxtext-fixtures

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch is pinned and installed first: torch==2.13.0 is the CPU build; any other spec pulls CUDA.
$(STAMP): pyproject.toml ucp_jax/_src/format/_scatter_read.c | $(BIN)/python
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# megatron-core 0.19.2 (tests/mcore) declares Python>=3.12 but runs on 3.11; its deps come with deepspeed
	$(BIN)/python -m pip install -q --no-deps --ignore-requires-python --only-binary=:all: --python-version 3.12 --upgrade --target "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" megatron-core==0.19.2
	$(BIN)/python -m pip install -q --no-deps --only-binary=:all: --upgrade --target $(VENV)/mcore-0.16.1 megatron-core==0.16.1  # the legacy layout (tests/mcore)
	touch $(STAMP)

demo: $(STAMP)
	$(XLA) $(BIN)/python -m ucp_jax.demo

lint: $(STAMP)
	$(BIN)/ruff check $(SRC)
	$(BIN)/ruff format --check $(SRC)
	$(BIN)/mypy
	$(BIN)/lint-imports

# The documentation site (docs/, mkdocs.yml) into build/site; --strict: a broken link, page or
# docstring fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d build/site

format: $(STAMP)
	$(BIN)/ruff format $(SRC)
	$(BIN)/ruff check --fix $(SRC)

# the trainers as referees run in `make referees`, not in the suite
REFEREE_TESTS := --ignore=tests/test_torchtitan_referee.py

# The library's doctests run first (they are quick), then the test suite in TEST_WORKERS processes
# (pytest-xdist; a test file stays in one process, so its module fixtures are built once; the
# trainers' checkpoints in tests/ds and tests/mcore are built once per run, whichever process asks
# first, the others wait); files go out in the order tests/conftest.py gives them, the longest
# first. TEST_WORKERS=0 runs it in this one process.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: lint docs
	$(XLA) $(BIN)/python -m pytest -q -p no:cacheprovider --doctest-modules ucp_jax
	$(XLA) $(BIN)/python -m pytest -q $(XDIST) $(REFEREE_TESTS) $(PYTEST_ARGS)

# The referees (not part of `make test`): torchtitan 0.3.0 itself resumes from `ucp export
# torchtitan` (tests/torchtitan/runner.py makes its virtualenv), and MaxText 0.2.5 from `ucp
# export maxtext` (referees/maxtext/setup.sh makes its own); each ~2.5 GB under REF_DIR
# (/tmp/ucp-referees) on first use.
referees: $(STAMP)
	UCP_REFEREES=1 $(XLA) $(BIN)/python -m pytest -q -s tests/test_torchtitan_referee.py
	REF_DIR=$(REF_DIR) referees/maxtext/setup.sh
	REF_DIR=$(REF_DIR) $(BIN)/python referees/maxtext/referee.py
	REF_DIR=$(REF_DIR) $(BIN)/python referees/crossing.py

# MaxText 0.2.5's environment, where its users install ucp_jax: Python 3.12 (python3.12, or a
# pyenv 3.12) with jax 0.12.0.1 and no PyTorch (MaxText has none; these machines have torch 2.13
# for CPU as a 3.11 wheel only): the suite, whose PyTorch tests skip (lint and docs: `make test`).
PY312    ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3) python3.12)
VENV312  := .venv312
STAMP312 := $(VENV312)/.installed-dev
$(STAMP312): pyproject.toml
	$(PY312) -m venv $(VENV312)
	$(VENV312)/bin/python -m pip install -q --upgrade pip
	$(VENV312)/bin/python -m pip install -q -e '.[test]' 'jax==0.12.0.1' 'jaxlib==0.12.0.1'
	touch $(STAMP312)

# the modules that import torch at their top (their doctests need it)
TORCH_MODULES := ucp_jax/torch.py ucp_jax/_src/frameworks/common/dcp_files.py ucp_jax/_src/frameworks/dcp \
	ucp_jax/_src/frameworks/deepspeed/export.py ucp_jax/_src/frameworks/megatron
test-py312: $(STAMP312)
	$(XLA) $(VENV312)/bin/python -m pytest -q -p no:cacheprovider --doctest-modules ucp_jax $(addprefix --ignore=,$(TORCH_MODULES))
	$(XLA) $(VENV312)/bin/python -m pytest -q $(XDIST) $(REFEREE_TESTS) $(PYTEST_ARGS)

# On a machine with an accelerator and a Python that has jax for it (GPU_PY): the suite on that
# accelerator, no CPU devices forced (see tests/conftest.py). Installs nothing.
GPU_PY  ?= python3
test-gpu:
	UCP_TEST_ACCELERATOR=1 XLA_PYTHON_CLIENT_PREALLOCATE=false $(GPU_PY) -m pytest -q $(REFEREE_TESTS) $(PYTEST_ARGS)

# One GPU's device count on CPU (UCP_TEST_DEVICES=1): what test-gpu skips and shrinks, checked here.
test-few-devices: $(STAMP)
	UCP_TEST_DEVICES=$(or $(DEVICES),1) $(BIN)/python -m pytest -q $(REFEREE_TESTS) $(PYTEST_ARGS)

# The frameworks themselves as referees (not part of `make test`): MaxText 0.2.5 in its own venv
# (Python 3.12, under REF_DIR) resumes from `ucp export maxtext` output with its own losses, and
# its forward pass gives the logits ucp_jax.models.llama computes (referees/maxtext/referee.py).
REF_DIR ?= /tmp/ucp-referees
# Rewrite tests/data/maxtext with MaxText itself (the fixtures `make test` uses).
maxtext-fixtures: $(STAMP)
	REF_DIR=$(REF_DIR) referees/maxtext/setup.sh
	REF_DIR=$(REF_DIR) $(BIN)/python referees/maxtext/make_fixtures.py

bench: $(STAMP)
	$(XLA) $(BIN)/python benchmarks/save_restore.py

clean:
	rm -rf $(VENV) $(VENV312) demo_out .pytest_cache
