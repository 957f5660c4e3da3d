"""Tensor-parallel benchmark: ``python -m vpce.bench --tp`` under torchrun (what it measures: ``vpce.bench.tp``).

The vocab is sharded over every process of the launch (tp = number of processes; one works too). From the
repository root, on one node with K GPUs (NCCL, one process per GPU on ``cuda:LOCAL_RANK``)::

    torchrun --standalone --nproc-per-node 1 launch/bench_tp.py
    torchrun --standalone --nproc-per-node 2 launch/bench_tp.py
    torchrun --standalone --nproc-per-node 4 launch/bench_tp.py
    torchrun --standalone --nproc-per-node 8 launch/bench_tp.py

each writing ``bench-out/bench-tp<K>.json``; add ``--sp`` for the sequence-parallel layout
(``bench-tp<K>-sp.json``). Several nodes, the vocab sharded over all ``nnodes x nproc-per-node`` processes, the
same command on every node (``--rdzv-endpoint``: host:port of one node that all of them reach; ``--rdzv-id``: any
name the nodes of this job share)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 --rdzv-id vpce-bench \\
        launch/bench_tp.py --shapes llama3-8b,llama3-70b

Then, time and memory against tp from several runs::

    python -m vpce.bench.plots_tp bench-out/bench-tp1.json bench-out/bench-tp2.json bench-out/bench-tp4.json

Every argument goes on to ``python -m vpce.bench --tp`` (``--help`` lists them): ``--shapes`` (default
llama3-8b; llama3-70b is the D=8192 head), ``--methods`` (default: every row with a vocab-parallel form),
``--sp``, ``--out``, ``--timeout``; ``--device cpu --quick`` runs tiny shapes on CPU processes with gloo, e.g.
``torchrun --standalone --nproc-per-node 2 launch/bench_tp.py --device cpu --quick``. Without torchrun,
``python launch/bench_tp.py`` is a group of one process. This script imports the ``vpce`` of the checkout it
sits in, installed or not.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vpce.bench.cli import main  # noqa: E402
from vpce.bench.launch_env import set_collective_env  # noqa: E402

if __name__ == "__main__":
    set_collective_env()  # NVLink multicast off, NCCL on a high-priority stream (the runner sets it again)
    sys.exit(main(["--tp", *sys.argv[1:]]))
