"""A whole training step, end to end: a real model trained on launch/data with its stock loss and with vpce.

Megatron-core (``megatron``): a ``GPTModel`` from the local layer spec (no Transformer Engine), Llama-shaped (RMSNorm,
SwiGLU, RoPE on GPUs, no biases), trained with the loss each path gives it:

- ``megatron``: stock; ``forward(..., labels=labels)`` returns the per-token loss from the output layer's
  ``[s, b, V/tp]`` logits and ``vocab_parallel_cross_entropy``; the loop forms ``pretrain_gpt``'s
  ``sum(losses * loss_mask) / loss_mask.sum()``.
- ``megatron-repeat``: the same path again, same seed: the run-to-run noise of Megatron's own bf16 path, the yard
  stick for the vpce curves. One repeat is one draw of that noise; ``--repeats K`` runs every path K times in
  rounds and writes ``agreement`` to the JSON: the per-step |loss difference| of every pair of Megatron's own runs,
  and of each vpce run against the Megatron run of its round, with the medians over the pairs.
- ``vpce``: ``vpce.integrations.megatron.apply(model, reduction="sum")``; the forward gets ``loss_mask=`` and
  returns the masked sum, whose gradients vpce forms in forward (the fast route); the loop divides by
  ``loss_mask.sum()``.
- ``vpce-per-token``: ``apply(model)``; the forward returns the ``[b, s]`` per-token loss as stock does and the loop
  is unchanged (vpce recomputes the logits in backward).
- ``megatron-fused``: stock with ``cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="native"``
  (megatron-core's ``fused_vocab_parallel_cross_entropy``, ``torch.compile``d; GPUs only, compiles in warm-up).

Run it on GPUs (one command per case; ``--out`` gets ``train_step.json`` and ``loss.png``)::

    torchrun --standalone --nproc-per-node 1 launch/train_step.py megatron --out train-out/megatron-tp1
    torchrun --standalone --nproc-per-node 2 launch/train_step.py megatron --out train-out/megatron-tp2
    torchrun --standalone --nproc-per-node 2 launch/train_step.py megatron --vocab 256000 --out train-out/mg-tp2-256k
    CUDA_VISIBLE_DEVICES=0 python launch/train_step.py hf --out train-out/hf
    torchrun --standalone --nproc-per-node 1 launch/train_step.py megatron --find-max-seq --out train-out/mg-max
    CUDA_VISIBLE_DEVICES=0 python launch/train_step.py hf --find-max-seq --out train-out/hf-max
    CUDA_VISIBLE_DEVICES=0 python launch/train_step.py hf --gradient-checkpointing --find-max-seq --out train-out/hf-gc

Hugging Face (``hf``): ``LlamaForCausalLM`` from a config (no download), trained with ``transformers.Trainer`` on
one device, bf16 autocast over fp32 weights (``TrainingArguments(bf16=True)``): ``stock``; ``vpce``
(``vpce.integrations.transformers.apply``); ``liger`` (``apply_liger_kernel_to_llama(fused_linear_cross_entropy=True,
rope=False, rms_norm=False, swiglu=False)``: only the loss is swapped, as for vpce; ``--liger-all`` swaps all four)
where liger-kernel is installed and a GPU is present. On GPUs each path runs in a process of its own (``--isolate``),
so that no memory, Trainer state or Liger class patch carries over; the parent merges the reports. In one process
(``--no-isolate``) Liger runs last, since it patches the Llama classes for the rest of the process. Each path's
``start_gib_per_rank`` (memory allocated before its model is built) shows anything an earlier path left behind.

What is measured, per path, after ``--warmup`` steps: tokens/s (``batch * seq`` per step over the mean step time,
each step timed between device synchronizations), peak allocated memory per rank (``torch.cuda.max_memory_allocated``
over the whole run: weights, fp32 master weights, Adam states, activations, the loss), and the loss at every step.
The JSON also holds, for every path, the largest, the mean and the first step's |loss - loss of the first path|;
the ``megatron-repeat`` row is the noise floor the ``vpce`` rows are read against. Where Megatron's own path is
deterministic on the device, the repeat is identical and the floor is zero; vpce's curve then differs from it by
rounding alone, from step 1: Megatron rounds the logits to bf16 before its fp32 softmax, vpce keeps them in fp32.

Precision (Megatron): bf16 weights and activations, fp32 master weights and AdamW states (what megatron-core's
``Float16OptimizerWithFloat16Params`` keeps), written out in ``MasterAdamW``: megatron-core's DDP and optimizer
allocate their buffers on CUDA only and gradient-accumulation fusion needs apex's CUDA extension, so neither is
used here; every path gets the same loop. Sequence parallelism: the local spec's torch norm refuses it, and apex's
and TE's norms (the ones megatron-core accepts under SP) are not installable without a CUDA toolchain and network,
so ``--sequence-parallel`` uses ``SequenceParallelNorm``: torch's norm whose weight gradient the loop all-reduces
over the tensor-parallel group, which is what megatron-core's ``finalize_model_grads`` does for those norms. On the
CPU (tp=2, ``--tiny``, 8 steps) its losses equal those without SP bit for bit, for Megatron's loss and for vpce's;
tests/integrations/test_integration_megatron.py checks the gradients of every parameter under SP against the model without it.

Attention: ``--attention sdpa`` (default) replaces the local spec's ``DotProductAttention``, which materializes the
``[b, heads, s, s]`` scores, with ``torch.nn.functional.scaled_dot_product_attention`` (causal; flash on GPUs), so
that long sequences fit and the loss is what the comparison is about; ``--attention local`` keeps megatron-core's.

Capacity (``--find-max-seq``, one process): for each path, the longest sequence (``--batch`` sequences per step)
for which a whole step (forward, backward, optimizer) fits in the device's memory: doubling from ``--seq``, then
bisection down to ``--seq-granule`` tokens; ``torch.cuda.OutOfMemoryError`` is caught, memory freed, and the search
goes on.

On a machine without CUDA everything runs on the CPU, with gloo between torchrun's processes, in fp32, with RoPE
replaced by learned absolute positions (megatron-core's RoPE moves its frequencies to CUDA), and megatron-core's
other CUDA-only pieces stood in for by ``megatron_on_cpu`` (only here, never in the package). ``--tiny`` picks a
configuration that trains in seconds there (tests/launch/test_train_step.py runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo import WordTokenizer, load_corpus  # noqa: E402 - launch/ is not a package

from vpce.bench.launch_env import local_cuda_device, set_collective_env  # noqa: E402
from vpce.parallel import end_process_group  # noqa: E402

MEGATRON_PATHS = ("megatron", "megatron-repeat", "megatron-fused", "vpce", "vpce-per-token")
HF_PATHS = ("stock", "vpce", "liger")


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The model trained by every path (Llama-shaped)."""

    vocab: int = 128256
    """Vocab size (Llama 3's; 256000 is Gemma's). Megatron pads it to a multiple of 128 * tp rows."""
    hidden: int = 2048
    """Model width."""
    layers: int = 4
    """Transformer layers."""
    heads: int = 16
    """Attention heads."""
    kv_heads: int = 16
    """Key/value heads (GQA when fewer than ``heads``)."""
    ffn: int = 5632
    """SwiGLU inner width."""
    tied: bool = False
    """Tie the output layer to the input embedding."""


@dataclass(frozen=True, kw_only=True)
class RunShape:
    """How each path trains."""

    seq: int = 8192
    """Tokens per sequence. At 8192 x 1 the stock loss's fp32 logits (N * V / tp * 4 bytes: 4 GiB for V = 128256 at
    tp=1) are 4x what vpce holds in their place (its fp32 weight gradient, V / tp * D * 4 bytes, from forward to
    backward on its fast route); the gap grows with N."""
    batch: int = 1
    """Sequences per step (micro-batch; no accumulation)."""
    steps: int = 200
    """Optimizer steps per path."""
    warmup: int = 20
    """Steps left out of the timing."""
    lr: float = 3e-4
    """AdamW learning rate (constant, betas 0.9/0.95, no weight decay)."""
    seed: int = 1234
    """Init and data-order seed, the same for every path."""


TINY_MODEL = ModelShape(vocab=2560, hidden=32, layers=2, heads=4, kv_heads=4, ffn=64)
TINY_RUN = RunShape(seq=32, batch=2, steps=8, warmup=2, lr=3e-3)


# -- data --------------------------------------------------------------------------------------------------------


def corpus_tokens() -> tuple[torch.Tensor, int]:
    """launch/data's files tokenized by demo.py's ``WordTokenizer``, each followed by an end-of-document token.

    Returns the token stream and the end-of-document id (``len(tokenizer)``): its position is never a target
    (``loss_mask`` 0 there, as Megatron's ``eod_mask_loss``; ``ignore_index`` for transformers).
    """
    tok = WordTokenizer(load_corpus())
    eod = len(tok)
    data = Path(__file__).resolve().parent / "data"
    ids = []
    for path in sorted(data.glob("*.txt")):
        ids += tok.encode(path.read_text(encoding="utf-8")) + [eod]
    return torch.tensor(ids), eod


def windows(tokens: torch.Tensor, seq: int, batch: int, seed: int):
    """Random ``[batch, seq + 1]`` windows of the token stream, repeated end to end where ``seq`` is longer."""
    reps = -(-(seq + 2) // len(tokens)) + 1
    stream = tokens.repeat(reps)
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(stream) - seq - 1, (batch,), generator=g)
        yield torch.stack([stream[s: s + seq + 1] for s in starts.tolist()])


# -- distributed, devices, reporting -----------------------------------------------------------------------------


def init_distributed() -> tuple[int, int, torch.device]:
    """(rank, world, device): torchrun's environment when present (NCCL on GPUs, gloo otherwise), else one process
    in a process group of its own (megatron-core's parallel state needs one)."""
    set_collective_env()  # NVLink multicast off, as every launch script
    cuda = torch.cuda.is_available()
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            from vpce.bench.launch_env import free_port
            os.environ["MASTER_PORT"] = str(free_port())
    device = local_cuda_device() if cuda else torch.device("cpu")
    if cuda:
        dist.init_process_group("nccl", device_id=device)
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_memory(device: torch.device) -> None:
    """Free what the previous path left (megatron-core's global buffer included) and restart the peak counter."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and getattr(ps, "_GLOBAL_MEMORY_BUFFER", None) is not None:
        ps._GLOBAL_MEMORY_BUFFER.buffer.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def allocated_bytes(device: torch.device) -> int | None:
    """Allocated now: at a path's start it should be ~0 (a larger value is memory an earlier path left behind)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def describe(device: torch.device) -> dict:
    """Device, versions and commit, for the JSON (results are named by date, device and commit)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    out = {"date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"), "commit": commit,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        out["device_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    for name in ("megatron.core", "transformers", "triton", "liger_kernel"):
        mod = sys.modules.get(name)
        if mod is not None:
            out[name] = getattr(mod, "__version__", None)
    return out


def summarize(runs: dict, run: RunShape, tokens_per_step: int) -> dict:
    """Per path: tokens/s after warm-up, mean step ms, and the largest |loss - first path's loss| per step."""
    first = next(iter(runs.values()))["losses"] if runs else []
    out = {}
    for name, r in runs.items():
        timed = r["step_s"][run.warmup:] or r["step_s"]
        mean = sum(timed) / len(timed)
        diffs = [abs(a - b) for a, b in zip(r["losses"], first)]
        out[name] = {**r, "mean_step_ms": 1e3 * mean, "tokens_per_s": tokens_per_step / mean,
                     "max_abs_loss_diff_vs_first": max(diffs) if diffs else 0.0,
                     "mean_abs_loss_diff_vs_first": sum(diffs) / len(diffs) if diffs else 0.0,
                     "step1_abs_loss_diff_vs_first": diffs[0] if diffs else 0.0,
                     "final_loss": r["losses"][-1] if r["losses"] else None}
    return out


def write_report(out_dir: Path, report: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "train_step.json").write_text(json.dumps(report, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", flush=True)
        return
    paths = report.get("paths", {})
    if not paths:
        return
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(2, 1))
    first_name, first = next(iter(paths.items()))
    for name, r in paths.items():
        steps = range(1, len(r["losses"]) + 1)
        top.plot(steps, r["losses"], label=f"{name}: {r['tokens_per_s']:,.0f} tok/s"
                 + (f", peak {max(r['peak_gib_per_rank']):.1f} GiB" if r.get("peak_gib_per_rank") else ""), lw=1)
        if name != first_name:
            bottom.plot(steps, [a - b for a, b in zip(r["losses"], first["losses"])], label=name, lw=1)
    top.set_ylabel("loss")
    top.legend(fontsize=8)
    c, m = report["config"]["run"], report["config"]["model"]
    top.set_title(f"{report['stack']}, {report.get('world', 1)} rank(s), {report['env']['device']}: V={m['vocab']}, "
                  f"seq {c['seq']} x {c['batch']}, {m['layers']} layers", fontsize=9)
    bottom.set_ylabel(f"loss - {first_name}")
    bottom.set_xlabel("step")
    if len(paths) > 1:
        bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "loss.png", dpi=120)
    plt.close(fig)


def capacities(paths, make_fits, args, shape, run, device, tokens, eod, say) -> dict:
    """``--find-max-seq`` for each path of one stack: ``make_fits`` (``megatron_fits`` or ``hf_fits``) gives the
    path's ``fits(seq)`` and the state to drop after it; the longest sequence by ``find_max``."""
    out = {}
    for path in paths:
        reset_memory(device)
        fits, state = make_fits(args, shape, run, device, path, tokens, eod, say)
        best, trials = find_max(fits, run.seq, args.max_seq, args.seq_granule)
        out[path] = {"max_seq": best, "batch": run.batch, "trials": trials, "capped": best >= args.max_seq}
        say(f"{path}: longest sequence that fits: {best} x {run.batch}")
        state.clear()
        del fits
    return out


def find_max(fits, start: int, cap: int, granule: int) -> tuple[int, list]:
    """Largest n (a multiple of ``granule``, at most ``cap``) with ``fits(n)``: doubling from ``start``, then
    bisection between the last size that fit and the first that did not. Returns (n or 0, [(n, fits), ...])."""
    trials, lo, hi, n = [], 0, None, start
    while n <= cap:
        ok = fits(n)
        trials.append((n, ok))
        if not ok:
            hi = n
            break
        lo, n = n, n * 2
    if hi is None:
        return lo, trials
    while hi - lo > granule:
        mid = (lo + hi) // 2 // granule * granule
        if mid <= lo:
            break
        ok = fits(mid)
        trials.append((mid, ok))
        lo, hi = (mid, hi) if ok else (lo, mid)
    return lo, trials


def oom_guarded(step, cleanup, device: torch.device, say, label: str, batch: int):
    """``fits(seq)`` for ``find_max``: ``step(seq)`` runs one whole step; an out-of-memory error there is caught,
    ``cleanup()`` drops what the step left (gradients), memory is freed, and ``fits`` returns False. Any other error
    goes through."""

    def fits(seq: int) -> bool:
        ok = True
        try:
            step(seq)
        except RuntimeError as err:  # torch.cuda.OutOfMemoryError is one
            if not is_oom(err):
                raise
            ok = False  # the traceback (and the step's tensors it holds) is gone once the except block ends
        if not ok:
            cleanup()
        reset_memory(device)
        say(f"  {label:>15} seq {seq:7d} x {batch}: {'fits' if ok else 'out of memory'}")
        return ok

    return fits


def is_oom(err: BaseException) -> bool:
    """torch's OutOfMemoryError, or a library's allocation failure reported as a RuntimeError (cuBLAS)."""
    return isinstance(err, torch.cuda.OutOfMemoryError) or any(s in str(err) for s in ("out of memory",
                                                                                          "ALLOC_FAILED"))


# -- Megatron-core -----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def megatron_on_cpu():
    """Stand-ins for the CUDA-only pieces of megatron-core that a ``GPTModel`` touches on the way, so that it runs
    on CPU gloo ranks with dropout off: ``GlobalMemoryBuffer.get_tensor`` allocates on the CPU, and the CUDA RNG
    tracker's ``fork`` is a null context (the attention needs only these two); under sequence parallelism, the
    gather and reduce-scatter of ``tensor_parallel.mappings`` also put their outputs on
    ``torch.cuda.current_device()``, which answers ``"cpu"`` here. Only on a machine without CUDA, for tests and the
    CPU path of this script; never in the package."""
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
    from megatron.core.utils import GlobalMemoryBuffer

    if torch.cuda.is_available():
        raise RuntimeError("megatron_on_cpu: expected a machine without CUDA")

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        return torch.empty(tensor_shape, dtype=dtype)

    def fork(self, name=None):
        return contextlib.nullcontext()

    saved = GlobalMemoryBuffer.get_tensor, CudaRNGStatesTracker.fork, torch.cuda.current_device
    GlobalMemoryBuffer.get_tensor, CudaRNGStatesTracker.fork = get_tensor, fork
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        GlobalMemoryBuffer.get_tensor, CudaRNGStatesTracker.fork, torch.cuda.current_device = saved


class SDPAttention(torch.nn.Module):
    """megatron-core's core-attention interface (``DotProductAttention``'s) over
    ``torch.nn.functional.scaled_dot_product_attention``, causal, no dropout: ``[sq, b, np, hn]`` query,
    ``[sk, b, ng, hn]`` key and value in, ``[sq, b, np * hn]`` out."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        from megatron.core.transformer.enums import AttnMaskType

        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"attn_mask_type: expected causal, got {attn_mask_type}")
        self.config = config
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPAttention: expected no attention_bias and no packed_seq_params")
        sq, b, heads, hn = query.shape
        # [b, heads, s, hn], dense: the flash kernel then takes them as they are
        q, k, v = (t.permute(1, 2, 0, 3).contiguous() for t in (query, key, value))
        if k.shape[1] != heads:  # GQA: each key/value head serves heads / groups query heads
            k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)


class SequenceParallelNorm:
    """megatron-core's ``WrappedTorchNorm`` (torch's LayerNorm/RMSNorm) without its refusal of sequence
    parallelism: under SP each rank normalizes its own slice of the sequence, so each rank's weight gradient is
    partial; its parameters are marked ``sequence_parallel`` and ``MasterAdamW.step`` all-reduces their gradients
    over the tensor-parallel group, as megatron-core's ``finalize_model_grads`` does for apex's and TE's norms."""

    def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                normalization="LayerNorm"):
        norm = (torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm)(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


def gpt_config(shape: ModelShape, tp: int, *, cuda: bool, sequence_parallel: bool = False):
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16 if cuda else torch.float32
    return TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads, ffn_hidden_size=shape.ffn, tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel and tp > 1, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        bf16=cuda, params_dtype=dtype, pipeline_dtype=dtype, use_cpu_initialization=True,
        perform_initialization=True, gradient_accumulation_fusion=False, init_method_std=0.02)


def build_gpt(shape: ModelShape, tp: int, device: torch.device, *, seq: int, seed: int, attention: str = "sdpa",
              sequence_parallel: bool = False, padded_vocab: int | None = None):
    """A megatron-core ``GPTModel`` on ``device``, the same weights for the same seed whatever the path.

    ``use_cpu_initialization``: every rank draws the same master weights from torch's RNG and keeps its shards, so
    the init does not depend on the CUDA RNG tracker. Weights in bf16 on GPUs (as ``Float16Module`` casts them),
    fp32 on CPU. ``padded_vocab``: the output layer's rows (default: ``shape.vocab`` rounded up to 128 * tp).
    """
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cuda = device.type == "cuda"
    config = gpt_config(shape, tp, cuda=cuda, sequence_parallel=sequence_parallel)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    elif attention != "local":
        raise ValueError(f"attention: expected 'sdpa' or 'local', got {attention!r}")
    if config.sequence_parallel:  # every norm, the final one included (the block's layer_norm)
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        spec.submodules.input_layernorm = SequenceParallelNorm
        spec.submodules.pre_mlp_layernorm = SequenceParallelNorm
        spec = TransformerBlockSubmodules(layer_specs=[spec] * shape.layers, layer_norm=SequenceParallelNorm)
    rows = padded_vocab or -(-shape.vocab // (128 * tp)) * 128 * tp
    torch.manual_seed(seed)
    if cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)  # the tracker's states (dropout is off)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=rows, max_sequence_length=seq,
                     position_embedding_type="rope" if cuda else "learned_absolute",
                     share_embeddings_and_output_weights=shape.tied, parallel_output=True)
    return model.to(device=device, dtype=config.params_dtype)


class MasterAdamW:
    """AdamW over fp32 master copies of the (bf16) weights, as megatron-core's mixed-precision optimizer keeps
    them: ``step`` casts each gradient to fp32, all-reduces those of sequence-parallel norms over ``tp_group``,
    steps, and copies the master weights back."""

    def __init__(self, params, lr: float, tp_group=None):
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().float().clone() for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.tp_group = tp_group

    def step(self):
        for p, m in zip(self.params, self.master):
            if p.grad is None:
                m.grad = None
                continue
            if getattr(p, "sequence_parallel", False) and self.tp_group is not None:
                dist.all_reduce(p.grad, group=self.tp_group)
            m.grad = p.grad.float()
            p.grad = None
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)
                m.grad = None

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def megatron_loss(model, path: str, ids, labels, loss_mask, position_ids, attention_mask):
    """One micro-batch's loss as the path forms it (``pretrain_gpt``'s ``sum(losses * loss_mask) / num_tokens``)."""
    num_tokens = loss_mask.sum()
    if path == "vpce":  # apply(model, reduction="sum"): the masked sum, gradients formed in forward
        return model(ids, position_ids, attention_mask, labels=labels, loss_mask=loss_mask) / num_tokens
    losses = model(ids, position_ids, attention_mask, labels=labels)  # [b, s] per-token, stock or vpce-per-token
    return torch.sum(losses.float().view(-1) * loss_mask.view(-1)) / num_tokens


def megatron_batch(win: torch.Tensor, eod: int, device: torch.device):
    ids, labels = win[:, :-1].to(device), win[:, 1:].to(device)
    loss_mask = (labels != eod).float()
    position_ids = torch.arange(ids.shape[1], device=device).expand_as(ids)
    # causal: None lets megatron-core's local attention build its mask, on CUDA; on the CPU it is given
    # ([1, 1, s, s], True where masked); SDPAttention ignores it
    seq = ids.shape[1]
    mask = None if device.type == "cuda" else torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None]
    return ids, labels, loss_mask, position_ids, mask


def megatron_path_model(args, shape: ModelShape, tp: int, device, path: str, seq: int):
    import vpce.integrations.megatron as vm

    model = build_gpt(shape, tp, device, seq=seq, seed=args.seed, attention=args.attention,
                      sequence_parallel=args.sequence_parallel)
    if path == "megatron-fused":
        model.config.cross_entropy_loss_fusion, model.config.cross_entropy_fusion_impl = True, "native"
    elif path == "vpce":
        vm.apply(model, reduction="sum")
    elif path == "vpce-per-token":
        vm.apply(model)
    return model


def train_megatron_path(args, shape: ModelShape, run: RunShape, tp: int, device, path: str, tokens, eod, say):
    from megatron.core import parallel_state as ps

    reset_memory(device)
    start = allocated_bytes(device)
    model = megatron_path_model(args, shape, tp, device, path, run.seq)
    opt = MasterAdamW(model.parameters(), run.lr, ps.get_tensor_model_parallel_group())
    data = windows(tokens, run.seq, run.batch, run.seed + 1)
    losses, times = [], []
    for step in range(run.steps):
        batch = megatron_batch(next(data), eod, device)
        sync(device)
        t0 = time.perf_counter()
        loss = megatron_loss(model, path, *batch)
        loss.backward()
        opt.step()
        sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if step == 0 or (step + 1) % args.log_every == 0:
            say(f"  {path:>15} step {step + 1:4d}/{run.steps} | loss {losses[-1]:.5f} | {1e3 * times[-1]:7.1f} ms")
    peak = peak_bytes(device)
    del model, opt, loss
    return {"losses": losses, "step_s": times, "peak_bytes": peak, "start_bytes": start}


def megatron_fits(args, shape: ModelShape, run: RunShape, device, path: str, tokens, eod, say):
    """``fits(seq)`` for ``find_max``: one whole step at ``seq`` on a model built once (weights, master weights
    and Adam states allocated by a first short step), OOM caught and freed."""
    model = megatron_path_model(args, shape, 1, device, path, max(args.max_seq, run.seq))
    opt = MasterAdamW(model.parameters(), run.lr)
    state = {"model": model, "opt": opt}

    def step(seq):
        batch = megatron_batch(next(windows(tokens, seq, run.batch, run.seed)), eod, device)
        megatron_loss(state["model"], path, *batch).backward()
        state["opt"].step()
        sync(device)

    def cleanup():
        state["opt"].zero_grad()
        for m in state["opt"].master:
            m.grad = None

    step(min(run.seq, 256))  # allocate the optimizer states
    return oom_guarded(step, cleanup, device, say, path, run.batch), state


def run_megatron(args, rank: int, world: int, device: torch.device, say) -> dict:
    from megatron.core import parallel_state as ps

    shape, run = shapes(args)
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    tokens, eod = corpus_tokens()
    if shape.vocab <= eod:
        raise SystemExit(f"--vocab: expected more than {eod} (the corpus' ids and its end-of-document id), got "
                         f"{shape.vocab}")
    rows = -(-shape.vocab // (128 * world)) * 128 * world
    paths = args.paths or ["megatron", "megatron-repeat", "vpce"]
    say(f"megatron-core GPTModel (local spec, {args.attention} attention{', SP' if args.sequence_parallel else ''}) "
        f"on {world} {device.type} rank(s), tp={world}: V={shape.vocab} ({rows} rows), h={shape.hidden}, "
        f"{shape.layers} layers, {'tied' if shape.tied else 'untied'}; seq {run.seq} x {run.batch}; paths {paths}")
    if rows != shape.vocab:
        say(f"  note: {rows - shape.vocab} padding rows, in the softmax of every path (Megatron's own semantics)")
    report = {"stack": "megatron", "world": world, "env": describe(device),
              "config": {"model": asdict(shape), "run": asdict(run), "padded_vocab": rows,
                         "attention": args.attention, "sequence_parallel": bool(args.sequence_parallel and world > 1),
                         "dtype": "bf16 weights, fp32 master weights" if device.type == "cuda" else "fp32"}}
    cm = megatron_on_cpu() if device.type != "cuda" else contextlib.nullcontext()
    with cm:
        if args.find_max_seq:
            if world != 1:
                raise SystemExit("--find-max-seq: expected one process (one device's capacity; an OOM on one TP "
                                 f"rank would hang the others), got {world}")
            report["find_max_seq"] = capacities([p for p in paths if p != "megatron-repeat"], megatron_fits, args,
                                                shape, run, device, tokens, eod, say)
            return report
        runs = {}
        for k in range(args.repeats):  # rounds: every path once per round, so that slow drift hits all alike
            for path in paths:
                name = path if k == 0 else f"{path}#{k + 1}"
                r = train_megatron_path(args, shape, run, world, device, path, tokens, eod, say)
                peaks = gather_peaks(r.pop("peak_bytes"), world, device)
                starts = gather_peaks(r.pop("start_bytes"), world, device)
                runs[name] = {**r, "peak_gib_per_rank": [p / 2**30 for p in peaks] if peaks else None,
                              "start_gib_per_rank": [p / 2**30 for p in starts] if starts else None}
    report["paths"] = summarize(runs, run, run.seq * run.batch)
    if args.repeats > 1 and "megatron" in paths:
        report["agreement"] = agreement(runs, paths, args.repeats)
    return report


def agreement(runs: dict, paths: list, repeats: int) -> dict:
    """The loss curves against Megatron's own run-to-run noise, from ``--repeats K`` rounds. Per pair of runs, the
    largest and the mean |loss difference| over the steps: ``megatron`` against itself (every pair of its K runs:
    the noise of its nondeterministic bf16 path), and each other path's run k against ``megatron``'s run k. The
    medians over the pairs are what the curves are read by: one pair is one draw of the noise."""
    def name(path, k):
        return path if k == 0 else f"{path}#{k + 1}"

    def pair(a, b):
        d = [abs(x - y) for x, y in zip(runs[a]["losses"], runs[b]["losses"])]
        return {"pair": [a, b], "max": max(d), "mean": sum(d) / len(d)}

    def median(xs):
        xs = sorted(xs)
        return 0.5 * (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2])

    groups = {"megatron vs megatron": [pair(name("megatron", i), name("megatron", j))
                                       for i in range(repeats) for j in range(i + 1, repeats)]}
    for path in paths:
        if path != "megatron":
            groups[f"{path} vs megatron"] = [pair(name(path, k), name("megatron", k)) for k in range(repeats)]
    return {g: {"pairs": ps, "median_max": median([x["max"] for x in ps]),
                "median_mean": median([x["mean"] for x in ps])} for g, ps in groups.items()}


def gather_peaks(peak: int | None, world: int, device: torch.device) -> list[int] | None:
    if peak is None:
        return None
    mine = torch.tensor([peak], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return [int(t) for t in every]


# -- Hugging Face ------------------------------------------------------------------------------------------------


def build_llama(shape: ModelShape, seq: int, seed: int, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=max(seq, 8192),
                         tie_word_embeddings=shape.tied, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(device)


def hf_patch(model, path: str, liger_all: bool):
    if path == "vpce":
        import vpce.integrations.transformers as vt
        vt.apply(model)
    elif path == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        flags = {} if liger_all else {"rope": False, "rms_norm": False, "swiglu": False}
        apply_liger_kernel_to_llama(fused_linear_cross_entropy=True, cross_entropy=False, model=model, **flags)
    return model


def hf_examples(tokens, eod: int, run: RunShape, count: int, seq: int | None = None):
    """``count`` examples for Trainer: ``input_ids`` and ``labels`` (the model shifts them), the end-of-document
    targets set to -100 (as ``loss_mask`` in the Megatron runs)."""
    seq = seq or run.seq
    data = windows(tokens, seq - 1, 1, run.seed + 1)
    out = []
    for _ in range(count):
        win = next(data)[0]
        out.append({"input_ids": win, "labels": win.masked_fill(win == eod, -100)})
    return out


def hf_available_paths(paths, device, say) -> list[str]:
    """The paths that can run here, ``liger`` last (it patches the Llama classes for the rest of the process)."""
    keep = []
    for path in sorted(paths, key=lambda p: p == "liger"):
        if path == "liger":
            try:
                import liger_kernel.transformers  # noqa: F401
            except ImportError:
                say("  liger: liger-kernel is not installed; path skipped")
                continue
            if device.type != "cuda":
                say("  liger: needs a GPU; path skipped")
                continue
        keep.append(path)
    return keep


def train_hf_path(args, shape: ModelShape, run: RunShape, device, path: str, tokens, eod, out_dir: Path, say):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    reset_memory(device)
    start = allocated_bytes(device)
    model = hf_patch(build_llama(shape, run.seq, args.seed, device), path, args.liger_all)
    times, losses = [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            sync(device)
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync(device)
            times.append(time.perf_counter() - self.t0)
            if len(times) == 1 or len(times) % args.log_every == 0:
                say(f"  {path:>15} step {len(times):4d}/{run.steps} | loss {losses[-1]:.5f} | "
                    f"{1e3 * times[-1]:7.1f} ms")

    class LossTrainer(Trainer):
        def training_step(self, *a, **k):
            loss = super().training_step(*a, **k)
            losses.append(loss.item())
            return loss

    targs = TrainingArguments(
        output_dir=str(out_dir / "trainer-tmp"), max_steps=run.steps, per_device_train_batch_size=run.batch,
        learning_rate=run.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta2=0.95,
        bf16=device.type == "cuda", use_cpu=device.type != "cuda", logging_strategy="no", save_strategy="no",
        report_to="none", seed=run.seed, data_seed=run.seed, dataloader_num_workers=0, disable_tqdm=True,
        remove_unused_columns=False, gradient_checkpointing=args.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if args.gradient_checkpointing else None)
    trainer = LossTrainer(model=model, args=targs, train_dataset=hf_examples(tokens, eod, run, run.steps * run.batch),
                          callbacks=[Timer()])
    trainer.train()
    peak = peak_bytes(device)
    del trainer, model
    return {"losses": losses, "step_s": times, "peak_gib_per_rank": [peak / 2**30] if peak is not None else None,
            "start_gib_per_rank": [start / 2**30] if start is not None else None}


def hf_fits(args, shape: ModelShape, run: RunShape, device, path: str, tokens, eod, say):
    """``fits(seq)`` for ``find_max``: the step Trainer takes (bf16 autocast over fp32 weights, AdamW), written out
    so that an OOM can be caught between steps; the model and the optimizer states are built once."""
    model = hf_patch(build_llama(shape, max(args.max_seq, run.seq), args.seed, device), path, args.liger_all)
    if args.gradient_checkpointing:  # as Trainer does for TrainingArguments(gradient_checkpointing=True)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr, betas=(0.9, 0.95), weight_decay=0.0)
    state = {"model": model, "opt": opt}
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step(seq):
        ex = hf_examples(tokens, eod, run, run.batch, seq)
        batch = {k: torch.stack([e[k] for e in ex]).to(device) for k in ("input_ids", "labels")}
        with autocast:
            loss = state["model"](**batch).loss
        loss.backward()
        state["opt"].step()
        state["opt"].zero_grad(set_to_none=True)
        sync(device)

    step(min(run.seq, 256))  # allocate the optimizer states
    return oom_guarded(step, lambda: state["opt"].zero_grad(set_to_none=True), device, say, path, run.batch), state


def run_hf(args, device: torch.device, out_dir: Path, say) -> dict:
    shape, run = shapes(args)
    tokens, eod = corpus_tokens()
    if shape.vocab <= eod:
        raise SystemExit(f"--vocab: expected more than {eod}, got {shape.vocab}")
    paths = hf_available_paths(args.paths or list(HF_PATHS), device, say)
    say(f"transformers LlamaForCausalLM on one {device.type} device: V={shape.vocab}, h={shape.hidden}, "
        f"{shape.layers} layers, {'tied' if shape.tied else 'untied'}; seq {run.seq} x {run.batch}; paths {paths}")
    isolate = args.isolate if args.isolate is not None else device.type == "cuda"
    isolate = isolate and len(paths) > 1
    report = {"stack": "hf", "world": 1, "env": describe(device),
              "config": {"model": asdict(shape), "run": asdict(run), "liger_all": args.liger_all,
                         "gradient_checkpointing": args.gradient_checkpointing,
                         "dtype": "bf16 autocast, fp32 weights" if device.type == "cuda" else "fp32",
                         "one_process_per_path": isolate}}
    if isolate:  # each path in a fresh process: no memory, Trainer state or Liger patch carried between them
        children = {path: run_child(args, path, out_dir / f"path-{path}") for path in paths}
        if args.find_max_seq:
            report["find_max_seq"] = {path: c["find_max_seq"][path] for path, c in children.items()}
        else:
            keep = ("losses", "step_s", "peak_gib_per_rank", "start_gib_per_rank")
            runs = {path: {k: c["paths"][path][k] for k in keep} for path, c in children.items()}
            report["paths"] = summarize(runs, run, run.seq * run.batch)
        return report
    if args.find_max_seq:
        report["find_max_seq"] = capacities(paths, hf_fits, args, shape, run, device, tokens, eod, say)
        return report
    runs = {path: train_hf_path(args, shape, run, device, path, tokens, eod, out_dir, say) for path in paths}
    report["paths"] = summarize(runs, run, run.seq * run.batch)
    return report


def run_child(args, path: str, out: Path) -> dict:
    """This script on one path in a fresh process (same flags); its report."""
    cmd = [sys.executable, str(Path(__file__).resolve()), args.stack, "--out", str(out), "--paths", path,
           "--no-isolate", "--max-seq", str(args.max_seq), "--seq-granule", str(args.seq_granule),
           "--log-every", str(args.log_every)]
    for name in ("vocab", "hidden", "layers", "heads", "kv_heads", "ffn", "seq", "batch", "steps", "warmup", "lr",
                 "seed"):
        if getattr(args, name) is not None:
            cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    cmd += [f"--{flag.replace('_', '-')}" for flag in ("tiny", "tied", "liger_all", "find_max_seq",
                                                       "gradient_checkpointing")
            if getattr(args, flag)]
    subprocess.run(cmd, check=True)
    return json.loads((out / "train_step.json").read_text())


# -- main --------------------------------------------------------------------------------------------------------


def shapes(args) -> tuple[ModelShape, RunShape]:
    model, run = (TINY_MODEL, TINY_RUN) if args.tiny else (ModelShape(), RunShape())
    model = replace(model, **{k: v for k, v in (("vocab", args.vocab), ("hidden", args.hidden),
                                                ("layers", args.layers), ("heads", args.heads),
                                                ("kv_heads", args.kv_heads), ("ffn", args.ffn)) if v is not None},
                    tied=args.tied)
    run = replace(run, **{k: v for k, v in (("seq", args.seq), ("batch", args.batch), ("steps", args.steps),
                                            ("warmup", args.warmup), ("lr", args.lr), ("seed", args.seed))
                          if v is not None})
    return model, run


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stack", choices=("megatron", "hf"))
    p.add_argument("--out", required=True, help="folder for train_step.json and loss.png")
    p.add_argument("--paths", type=lambda s: s.split(","), help=f"comma-separated; megatron: {MEGATRON_PATHS} "
                   f"(default megatron,megatron-repeat,vpce); hf: {HF_PATHS} (default all)")
    p.add_argument("--tiny", action="store_true", help="the CPU test's configuration (seconds on a CPU)")
    for name, kind in (("vocab", int), ("hidden", int), ("layers", int), ("heads", int), ("kv-heads", int),
                       ("ffn", int), ("seq", int), ("batch", int), ("steps", int), ("warmup", int), ("lr", float),
                       ("seed", int)):
        p.add_argument(f"--{name}", type=kind, help=f"default: {name.replace('-', '_')} of ModelShape/RunShape "
                                                    f"(or of the --tiny ones)")
    p.add_argument("--tied", action="store_true", help="tie the output layer to the input embedding")
    p.add_argument("--attention", choices=("sdpa", "local"), default="sdpa", help="megatron core attention")
    p.add_argument("--sequence-parallel", action="store_true", help="megatron, tp > 1: SP with SequenceParallelNorm")
    p.add_argument("--liger-all", action="store_true", help="hf: Liger's rope, rms_norm and swiglu kernels too")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="hf: recompute each decoder layer in backward (TrainingArguments(gradient_checkpointing=True)),"
                        " so that the loss's memory, not the layers' activations, bounds the sequence")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="hf: run each path in a process of its own (default: on GPUs)")
    p.add_argument("--find-max-seq", action="store_true", help="find each path's longest sequence (one process)")
    p.add_argument("--max-seq", type=int, default=1 << 18, help="--find-max-seq: largest sequence tried")
    p.add_argument("--seq-granule", type=int, default=512, help="--find-max-seq: bisection stops at this step")
    p.add_argument("--log-every", type=int, default=25, help="progress line every K steps")
    p.add_argument("--repeats", type=int, default=1,
                   help="megatron: run every path K times (rounds), and compare the loss curves against Megatron's "
                        "own run-to-run noise (the JSON's 'agreement')")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats: expected an integer >= 1, got {args.repeats}")
    if args.gradient_checkpointing and args.stack != "hf":
        p.error("--gradient-checkpointing: expected the hf stack (megatron-core's recompute is not wired here), "
                f"got {args.stack}")
    if args.paths:
        known = MEGATRON_PATHS if args.stack == "megatron" else HF_PATHS
        bad = [x for x in args.paths if x not in known]
        if bad:
            p.error(f"--paths: expected names among {known}, got {bad}")
    return args


def main(argv=None) -> None:
    args = parse(argv)
    if args.seed is None:
        args.seed = (TINY_RUN if args.tiny else RunShape()).seed
    out_dir = Path(args.out)
    if args.stack == "hf":
        rank, world = 0, 1
        if torch.cuda.device_count() > 1:  # Trainer would wrap the model in nn.DataParallel over all of them
            raise SystemExit(f"hf: expected one visible GPU, got {torch.cuda.device_count()}; run it with "
                             f"CUDA_VISIBLE_DEVICES=0")
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cpu":
            torch.set_num_threads(1)
    else:
        rank, world, device = init_distributed()
    if device.type == "cuda":  # vpce's paths time the hopper extra's kernels from their first step (where it is)
        import vpce

        vpce.build_hopper_kernels(device)

    def say(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    t0 = time.perf_counter()
    finished = False
    try:
        if args.stack == "megatron":
            report = run_megatron(args, rank, world, device, say)
        else:
            report = run_hf(args, device, out_dir, say)
        finished = True
    finally:
        if args.stack == "megatron":
            from megatron.core import parallel_state as ps
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
            end_process_group(finished)
    report["wall_s"] = time.perf_counter() - t0
    if rank == 0:
        write_report(out_dir, report)
        for name, r in report.get("paths", {}).items():
            peak = f"{max(r['peak_gib_per_rank']):6.2f} GiB" if r.get("peak_gib_per_rank") else "     n/a"
            print(f"{name:>16}: {r['tokens_per_s']:12,.0f} tokens/s | {r['mean_step_ms']:8.1f} ms/step | peak {peak}"
                  f" | final loss {r['final_loss']:.5f} | max |loss - {next(iter(report['paths']))}| "
                  f"{r['max_abs_loss_diff_vs_first']:.2e}")
        for group, a in report.get("agreement", {}).items():
            print(f"{group:>30}: median over {len(a['pairs'])} pairs of the max |loss diff| {a['median_max']:.3e}, "
                  f"of the mean {a['median_mean']:.3e}")
        for name, r in report.get("find_max_seq", {}).items():
            capped = " (the --max-seq cap: raise it to go further)" if r.get("capped") else ""
            print(f"{name:>16}: longest sequence {r['max_seq']} x {r['batch']}{capped}")
        print(f"wrote {out_dir / 'train_step.json'} ({report['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
