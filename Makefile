# vpce: `make test` and `make demo` each set themselves up on a fresh machine.
PYTHON ?= python3
PIP = $(PYTHON) -m pip install -q --disable-pip-version-check
NPROC ?= 2

# torch is installed by `setup` only when `import torch` fails, so a torch that is already there (a GPU image's
# CUDA build, a CPU build, a nightly) is kept: it satisfies the package's `torch>=2.4`. A pin does not choose the
# build: PyPI's x86-64 Linux wheel of every recent torch is the CUDA one (several GB with its nvidia-* packages). So
# without an NVIDIA driver (no nvidia-smi) the wheel comes from PyTorch's CPU index, and with one from PyPI.
# Override: `make setup TORCH_INDEX=https://download.pytorch.org/whl/cu128`, or `TORCH_INDEX=` for PyPI.
TORCH ?= torch==2.13.0
TORCH_INDEX ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,https://download.pytorch.org/whl/cpu)

.PHONY: setup setup-test setup-demo test demo bench

setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	@$(PIP) -e .

# torchtune, torchao and torchdata come first at these exact versions, without their requirements; then the
# `torchtune` extra (torchtune==0.6.1 itself, pyproject.toml) brings what torchtune declares (kagglehub, blobfile,
# Pillow, ...), so pip reports nothing missing. torchdata asks only for some torch >= 2: the installed one is kept.
# About 25 s on a bare machine, then a no-op.
TORCHTUNE ?= torchtune==0.6.1 torchao==0.15.0 torchdata==0.11.0
# trl (the `trl` extra) also comes without its requirements: what it imports (transformers, accelerate, datasets) is
# already there from the `test` and `torchtune` extras, so it can never change the installed torch or transformers.
TRL ?= trl==1.16.0
# verl and OpenRLHF (tests/integrations/test_integration_verl.py, tests/integrations/test_integration_openrlhf.py) come without their
# requirements too (vLLM, flash-attn, deepspeed, wandb: GPU-only or unused); importing verl's loss code
# (verl.trainer.ppo.core_algos, verl.workers.config) takes ray, tensordict and codetiming, which come with theirs.
RL ?= verl==0.9.1 openrlhf==0.11.2
# The bench's peers that run on a CPU too (tests/bench/test_bench_peers.py checks their rows against vpce's):
# liger-kernel's scaled cross-entropy has a torch fallback, fla-core runs in Triton's interpreter.
PEERS ?= liger-kernel==0.8.5 fla-core==0.6.0 einops==0.8.2
RL_DEPS ?= ray==2.60.0 tensordict==0.10.0 codetiming==1.4.0

setup-test: setup
	@$(PIP) --no-deps $(TORCHTUNE) $(TRL) $(RL) $(PEERS)
	@$(PIP) -e ".[test,torchtune]" $(RL_DEPS)

# The suite in TEST_WORKERS pytest-xdist processes: 2 where there is no NVIDIA driver (the CPU machine CI runs on,
# where the Triton interpreter keeps one core busy per test), 1 where there is one (the tests that weigh the GPU's
# free memory want it to themselves; `bash launch/gpu_suite.sh` spreads a GPU machine's run over its GPUs).
# worksteal: an idle worker takes tests queued on the other, so a few long tests at the end do not leave one idle.
TEST_WORKERS ?= $(if $(shell command -v nvidia-smi 2>/dev/null),1,2)

test: setup-test
	$(PYTHON) -m pytest -q $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist worksteal) tests

# `make demo` installs vpce (editable) only when $(PYTHON) does not already import it from this checkout, so a second
# run starts at once; a fresh venv (CI: `make demo PYTHON=<venv>/bin/python`) still gets torch and the install.
# The check drops the current directory from sys.path, where this checkout's vpce would always be found.
DEMO_INSTALLED = import sys, pathlib; sys.path.pop(0); import vpce; \
	sys.exit(pathlib.Path(vpce.__file__).resolve().parents[1] != pathlib.Path.cwd().resolve())

setup-demo:
	@$(PYTHON) -c "$(DEMO_INSTALLED)" 2>/dev/null || $(MAKE) --no-print-directory setup PYTHON="$(PYTHON)"

# The main job (launch/demo.py): a tiny causal LM trained with its lm_head vocab-sharded over $(NPROC) torchrun
# ranks, its loss checked at every step against a 1-process unsharded baseline; fails if they disagree. It needs
# only torch and vpce; torch's import-time warning that numpy is missing is silenced (nothing here uses numpy).
demo: TORCHRUN = OMP_NUM_THREADS=1 PYTHONWARNINGS="ignore:Failed to initialize NumPy" \
	$(PYTHON) -m torch.distributed.run --standalone
demo: setup-demo
	$(TORCHRUN) --nproc-per-node 1 launch/demo.py --baseline-out demo-out/baseline.json
	$(TORCHRUN) --nproc-per-node $(NPROC) launch/demo.py --compare demo-out/baseline.json --report demo-out/report.json

bench: setup
	@$(PIP) -e ".[bench]"
	$(PYTHON) -m vpce.bench
