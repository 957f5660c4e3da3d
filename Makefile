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

# The main job (launch/demo.py): a tiny causal LM trained with its lm_head vocab-sharded over $(NPROC) torchrun
# ranks, its loss checked at every step against a 1-process unsharded baseline; fails if they disagree.
demo: TORCHRUN = OMP_NUM_THREADS=1 $(PYTHON) -m torch.distributed.run --standalone
demo: setup
	$(TORCHRUN) --nproc-per-node 1 launch/demo.py --baseline-out demo-out/baseline.json
	$(TORCHRUN) --nproc-per-node $(NPROC) launch/demo.py --compare demo-out/baseline.json --report demo-out/report.json

bench: setup
	@$(PIP) -e ".[bench]"
	$(PYTHON) -m vpce.bench
