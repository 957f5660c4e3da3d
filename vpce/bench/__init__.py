"""``python -m vpce.bench``: vpce and its peers side by side, in one process, against the three-GEMM floor.

What is measured, per shape (``N`` tokens, hidden size ``D``, vocab ``V``) and per row:

* **Inputs.** Fresh per shape, drawn on the device from ``(seed, N, D, V)``: ``x ~ N(0, 1)`` ``[N, D]``,
  ``w ~ N(0, s**2 / D)`` ``[V, D]`` so that the logits are about ``N(0, s**2)`` (``--logit-scale s``, default 1:
  the distribution of the project's anchor measurements of the peers, quoted in docs/benchmarks.md), targets
  uniform over the vocab, none ignored.
  Cast to ``--dtype`` (bf16 by default). Every fwd+bwd row differentiates its own clones of ``x`` and ``w``.
* **Floor.** The three GEMMs that exact loss + gradients cannot avoid, through cuBLAS in the run's dtype:
  logits ``X @ W.T``, ``dX = G @ W`` and ``dW = G.T @ X`` with a random ``G [N, V]``, each timed like the rows;
  the floor is their sum, and "x floor" is a row's time over it. The frozen-weight rows are compared with the
  logits and dX GEMMs ("x 2 GEMMs"), the no-grad forward rows with the logits GEMM alone ("x GEMM"); the JSON's
  ``floor_gemms`` says which floor a row is divided by. Where ``G`` and the logits do not fit in free device
  memory, each GEMM runs over equal token chunks (``runner.measure_floor``; the floor record's ``chunks``).
* **Time.** One step is ``x.grad = w.grad = None; loss = f(x, w, y); loss.backward()``. The first call compiles
  or autotunes and is the one checked for accuracy; ``--warmup`` more synchronized calls estimate the step's
  cost; ``--settle`` seconds of untimed steps follow (default 0: none; about 1 times a GPU at its power limit at
  its settled clock); then enough steps to fill ``--rep-time`` seconds (at least ``--reps``, at most 200) run back
  to back, each bracketed by CUDA events (``time.perf_counter`` on CPU), one synchronization at the end. The median
  is reported (``ms_min`` too in the JSON).
* **Memory.** One more step, inputs already allocated and the previous gradients dropped, under
  ``vpce.memory.PeakMemory``: the peak of allocated bytes above what was live before the step, the gradients
  ``dX`` and ``dW`` included (CUDA allocator counters; on CPU every storage created is tracked). Between rows
  everything is released (``del``, ``gc.collect()``, ``torch.cuda.empty_cache()``).
* **Accuracy.** ``|loss - ref| / |ref|`` and ``||g - ref|| / ||ref||`` for ``dX`` and ``dW`` against the float64
  reference ``vpce.reference.chunked_reference``, computed on the device in token chunks (``[C, V]`` float64
  logits at a time, ``dW`` accumulated in float64), so it never needs ``[N, V]`` float64 at once.
* **Rows.** ``floor``; ``torch`` (eager ``F.cross_entropy(F.linear(x, w).float(), y)``); ``compile`` (the same
  under ``torch.compile``); torch's own ``F.linear_cross_entropy`` (torch >= 2.13: ``torch-lce``, its reference
  path, and its chunked path with default options, ``-accurate``, ``-balanced`` and ``-ar1``); ``liger``; ``cce``
  and ``cce-exact`` (``filter_eps=None``); ``quack`` (quack-kernels' ``chunked_linear_cross_entropy``,
  ``chunk_size=4096``) and ``quack-base`` (``use_scaled_exp=False``); ``megatron`` and ``megatron-fused`` (tp=1,
  on a process group of this one process); ``vpce-triton`` (default memory budget), ``vpce-triton-lean``,
  ``vpce-triton-lean-main-grad`` (dW into an fp32 ``weight.main_grad``, as Megatron);
  ``vpce-torch``; vpce with loss options and ``linear_log_probs`` (on the device's backend: Triton on CUDA, torch
  on a CPU); the frozen-lm_head rows ``torch-frozen``, ``compile-frozen``, ``quack-frozen``,
  ``quack-base-frozen``, ``vpce-triton-frozen`` and ``vpce-torch-frozen`` (``w.requires_grad=False``, as LoRA:
  loss and dX only, no dW to check); and no-grad forwards of ``torch``, ``vpce-triton``, ``vpce-torch``
  (``--methods all``, the default; the vocab-parallel-only rows below are left out of it). Peers are in
  ``vpce.bench.peers``, the registry and vpce's rows in ``vpce.bench.methods``. A row whose package is not
  installed or that needs CUDA on a CPU run is reported as ``missing: <reason>``; one that raises (out of memory
  included) as ``failed: <reason>``, with its traceback in the JSON.
* **Time limit.** ``--row-timeout`` (default 300 s; 0: none): a row still running after that is abandoned and
  reported ``failed: timeout after <s> s (in <phase>)``, and the run goes on; if the device then cannot run a tiny
  op (a stalled GPU kernel), the remaining rows are ``failed: not run``, the tables and JSON are written, and the
  process exits with status 3 (``vpce.bench.runner``'s docstring gives the design and why not a subprocess per
  row).
* **Tables** fit 120 columns: rows are named by their ``--methods`` key (the long label is in the JSON and the
  progress lines), the status column is short, and each distinct reason a row was not measured follows its table.
* **--quick** without ``--methods`` runs ``vpce.bench.methods.QUICK``'s rows that run here (installed, and for
  this device), and names the others once on stderr: seconds on a CPU (17 s wall, imports included, on a 2-core
  Xeon). ``--methods all`` still means every row.
* **On a CPU** the times mean nothing (every CPU run says so, on stderr and above the tables) and the default
  shapes are refused with a hint (``--quick`` runs tiny ones); a GPU-sized shape named with ``--shapes`` runs,
  after a warning.

Distillation (``--distill``): every shape becomes a distillation problem: the student head above and a
teacher head of ``--teacher-dim`` ``D_T`` (default 8192, so the default shape ``llama3-8b`` is the target case:
N=16384, D=4096, D_T=8192, V=128256), and the rows are those of ``vpce.linear_distillation_loss`` and its peers,
each the mean over the tokens of one divergence between the teacher's softmax ``q`` and the student's ``p``
(temperature 1, none ignored, the teacher detached, gradients into ``x`` and ``w``): forward KL ``KL(q || p)``,
the generalized JSD with beta 0.5 (``beta KL(q || m) + (1 - beta) KL(p || m)``, ``m = beta q + (1 - beta) p``;
beta the teacher's weight, as TRL's ``generalized_jsd_loss``) and reverse KL ``KL(p || q)``.

* **Inputs.** The student's ``x``, ``w``, ``y`` are the cross-entropy problem's; the teacher's ``xt ~ N(0, 1)``
  ``[N, D_T]`` and ``wt ~ N(0, s**2 / D_T)`` ``[V, D_T]`` come from their own seed ``(seed, N, D_T, V, 1)``.
* **Time, memory.** As above; a step is ``loss = f(x, w, y, xt, wt); loss.backward()``, and the peak extra memory
  is all that the step creates above the inputs (the teacher's logits included, and the gradients).
* **Floor.** The teacher's logits GEMM ``[N, D_T] @ [D_T, V]`` plus the student's logits, dX and dW GEMMs (cuBLAS,
  the run's dtype), measured in the same run (``floor.teacher_logits_ms`` in the JSON, ``floor_gemms: "teacher
  logits+logits+dX+dW"``); "x floor" is a row's time over their sum.
* **Accuracy.** Each row against the float64 reference of its own divergence,
  ``vpce.reference.chunked_reference_distillation`` (both heads' float64 logits in token chunks, the divergence
  by its definition, its gradient by autograd, ``dW`` accumulated in float64), computed before the first row of
  that divergence; the header shows each divergence's float64 loss and, on one device, the loss error of float64
  math on the logits the run's GEMM writes in its dtype (``harness.gemm_logits_loss``): what every row that takes
  its logits from that GEMM (plain torch, Liger, vpce's Triton backend) inherits before its own arithmetic.
* **Rows** (``vpce.bench.methods.DISTILL``), for ``fkl`` (forward KL), ``jsd`` (beta 0.5) and ``rkl`` (reverse
  KL): ``torch-<key>`` (plain eager: both heads' logits ``F.linear`` in the run's dtype, fp32 ``log_softmax``,
  the teacher's under ``no_grad``, the divergence written from its definition); ``liger-<key>`` (liger-kernel's
  ``LigerFusedLinearJSD``, CUDA; ``jsd_beta`` 0, 0.5 and 1: its beta is vpce's, ``vpce.bench.peers`` says why);
  ``vpce-<key>`` (``linear_distillation_loss`` on the device's backend: Triton on CUDA, torch on a CPU) and, for
  ``fkl`` and ``jsd``, ``vpce-<key>-lean`` (``memory_budget="lean"``). Under ``--tp`` vpce's rows run
  vocab-parallel (both heads sharded, with ``--sp`` both hidden states sliced) and the others are ``missing``.
* **Output.** ``--out/bench-distill.json`` (``schema: "vpce.bench.distill/1"``; under ``--tp``
  ``bench-distill-tp<K>[-sp].json``, ``"vpce.bench.tp.distill/1"``): the schema below plus ``task:
  "distillation"``, ``distill: {teacher_dim, temperature, teacher_inputs, loss, divergences, floor}``; shapes have
  ``d_teacher``, ``ref_losses: {divergence: float64 loss}`` instead of ``ref_loss`` and (one device only)
  ``gemm_logits_loss_errs: {divergence: relative error}``; rows have ``d_teacher``,
  ``divergence``, ``beta`` and ``ref_loss``. ``--sweep`` is refused; ``--profile`` profiles ``vpce-fkl`` and
  ``vpce-jsd`` by default.

Output: progress lines on stderr, one Markdown table per shape on stdout, ``--out/bench.json`` (rewritten after
every shape), and (matplotlib; skipped with a note if missing) ``--out/bench-<shape>.png`` per named shape (time
and extra memory of every row) and with ``--sweep`` ``--out/sweep-<N|D|V>.png``.

JSON (``schema: "vpce.bench/1"``)::

    {schema, date, command, commit, device: {type, name, capability, memory_gib, ...}, versions: {torch,
     triton, liger-kernel, cut-cross-entropy, megatron-core, quack-kernels, nvidia-cutlass-dsl, numpy, matplotlib,
     vpce, cuda}, python, dtype, tp,
     settings: {warmup, min_reps, max_reps, rep_time_s, settle_s, logit_scale, seed, ref_chunk_gib, tf32, inputs},
     methods: [...],
     shapes: [{name, n, d, v, sweeps, flops_fwd_bwd, grads_gib, inputs_gib, ref_loss, ref_seconds,
               floor: {logits_ms, dx_ms, dw_ms, total_ms, frozen_ms} | null}],
     rows: [{shape, n, d, v, tp, rank, method, label, mode: "floor" | "fwd+bwd" | "frozen" | "no-grad", status:
             "ok" | "missing: ..." | "failed: ...", ms, ms_min, reps, floor_gemms: "logits+dX+dW" | "logits+dX" |
             "logits", floor_ms, x_floor, extra_gib, loss, loss_err, dx_err, dw_err, [traceback]}]}

Non-finite numbers are written as null. ``floor_ms`` is the floor that ``floor_gemms`` names: ``total_ms`` for
fwd+bwd rows, ``frozen_ms`` (logits + dX) for frozen-weight rows, ``logits_ms`` for no-grad rows.

Profile (``--profile``, ``vpce.bench.profile``): instead of the tables, where one step's time goes, per kernel
and per phase (vpce's fused logits kernel, cuBLAS GEMMs, probs-to-grad, reductions, casts, collectives, ...;
the patterns are ``vpce.bench.profile.PHASES``), under ``torch.profiler``: CUDA kernels on a GPU, CPU ops on a
CPU; for ``vpce-triton`` (``vpce-torch`` on a CPU) or the ``--methods`` rows; ``--out/profile.json``.

Examples::

    python -m vpce.bench                                   # llama3-8b and gemma2-2b heads, every row
    python -m vpce.bench --sweep N --methods floor,torch,compile,vpce-triton
    python -m vpce.bench --methods floor,compile-frozen,quack-base-frozen,vpce-triton-frozen
    python -m vpce.bench --profile --shapes llama3-8b      # vpce-triton's step, kernel by kernel
    python -m vpce.bench --device cpu --quick --methods torch,vpce-torch,floor
    python -m vpce.bench --distill                         # Llama-3-8B student, teacher D_T=8192: every row
    python -m vpce.bench --device cpu --quick --distill    # the same rows on tiny shapes (smoke run)

Peers on the GPU machine: ``vpce/bench/wheels.sh`` downloads their wheels into ``.whl/`` and prints the install
line; ``launch/quack_wheels.sh`` does the same for quack-kernels (``.whl-quack/``, two device calls).

Tensor parallelism: ``torchrun --nproc-per-node K -m vpce.bench --tp [--sp]`` (or ``launch/bench_tp.py``) shards
the vocab over the K processes and measures, on every rank, the rows with a vocab-parallel form (``Method.tp``):
the per-rank floor (the three GEMMs on the rank's shard), megatron-core's two vocab-parallel losses behind
Megatron's copy (or sequence-parallel gather) region, liger-kernel's TP function, ``chunked-tp`` (the idea of
liger-kernel's TP fallback in plain torch), torch ``loss_parallel`` (fp32 and bf16 logits) and vpce; the table
shows the maximum over ranks, ``bench-tp<K>[-sp].json`` every rank's own row, and ``bench-tp<K>[-sp]-<shape>.png``
the maxima. ``vpce.bench.tp`` says how, and ``python -m vpce.bench.plots_tp`` plots several such runs against tp.
The collective environment (NVLink multicast off, NCCL on a high-priority stream) is
``vpce.bench.launch_env.set_collective_env``, which every script in ``launch/`` calls too.
"""

from .cli import main

__all__ = ["main"]
