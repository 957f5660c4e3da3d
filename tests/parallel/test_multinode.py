"""The multi-node launch, on one machine: two torchrun agents on localhost, each one node of ``--nnodes 2`` with one
process, meet through the c10d rendezvous and run ``launch/check_tp.py`` as one 2-rank gloo group.

This is the command users run on a cluster (README, "Several nodes"), with ``127.0.0.1`` as every node's address.
A world of 2 can only form if both agents joined the rendezvous. CUDA is hidden from the workers: two one-process
nodes on one machine would otherwise both take ``cuda:0``. Both agents run in their own session with a deadline,
and are killed at it, so a rendezvous or collective that hangs fails the test instead of hanging CI.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

CHECK = Path(__file__).resolve().parents[2] / "launch" / "check_tp.py"
DEADLINE_S = 150


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_agents_on_localhost_run_check_tp():
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"vpce-test-{port}",
           "--local-addr", "127.0.0.1", str(CHECK),
           "--n-per-rank", "96", "--hidden", "40", "--vocab", "700", "--budgets", "auto,lean", "--layouts", "sp"]
    agents = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True) for _ in range(2)]
    outputs, deadline = [], time.monotonic() + DEADLINE_S
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
        outputs = [agent.communicate()[0] for agent in agents]
        raise AssertionError(f"the two agents did not finish within {DEADLINE_S} s:\n" + _show(outputs)) from None

    assert [a.returncode for a in agents] == [0, 0], _show(outputs)
    lines = re.findall(r"(?m)^world=(\d) budget=(\w+) layout=sp rank=(\d): loss \S+  dX \S+  dW \S+$", "".join(outputs))
    assert sorted(lines) == [("2", b, r) for b in ("auto", "lean") for r in "01"], _show(outputs)


def _show(outputs) -> str:
    return "\n".join(f"--- agent {i}\n{out[-3000:]}" for i, out in enumerate(outputs))
