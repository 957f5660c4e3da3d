# vpce: `make test` and `make demo` each set themselves up on a fresh machine.
PYTHON ?= python3
PIP = $(PYTHON) -m pip install -q --disable-pip-version-check
NPROC ?= 2

.PHONY: setup setup-test test demo bench

# torch only when missing: an unpinned torch requirement on a CPU machine would pull the CUDA wheels.
setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) torch==2.13.0
	@$(PIP) -e .

setup-test: setup
	@$(PIP) -e ".[test]"

test: setup-test
	$(PYTHON) -m pytest -q tests

# The main job: 2-rank vocab-sharded training of a tiny causal LM vs a 1-process unsharded baseline.
demo: setup
	$(PYTHON) launch/demo.py --nproc $(NPROC)

bench: setup
	@$(PIP) -e ".[bench]"
	$(PYTHON) -m vpce.bench
