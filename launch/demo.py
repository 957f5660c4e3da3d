"""vpce demo: train a tiny causal LM whose lm_head is vocab-sharded over the ranks, checked against an unsharded run.

Run it (this is ``make demo``)::

    torchrun --standalone --nproc-per-node 1 launch/demo.py --baseline-out demo-out/baseline.json
    torchrun --standalone --nproc-per-node 2 launch/demo.py --compare demo-out/baseline.json

The first command trains the model in one process with the whole lm_head and the plain loss
``F.cross_entropy(F.linear(h, W).float(), y)`` and writes its loss at every step; the second trains the same model
(same init, same data order) with the lm_head split by rows over the ranks and ``vpce.linear_cross_entropy``, and
prints both losses side by side. It exits non-zero if they ever disagree by more than ``REL_TOL``. Any number of
processes works for ``--compare``, one included; so does plain ``python launch/demo.py --compare ...`` (no
torchrun, not distributed). Several nodes use torchrun's rendezvous, the same command on every node::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 --rdzv-id vpce-demo \\
        launch/demo.py --compare demo-out/baseline.json

(``--nnodes``: number of nodes; ``--rdzv-endpoint``: host:port of one node that all of them can reach;
``--rdzv-id``: any name shared by the nodes of this job. Only global rank 0 reads the baseline file, so it must
exist on the node that gets rank 0.) On CUDA machines each rank uses ``cuda:LOCAL_RANK`` and NCCL; otherwise the
CPU and gloo, one thread per rank.

What is trained. The text is the original prose in ``launch/data/*.txt`` (~49 KB). ``WordTokenizer`` splits it
into word pieces (a word, number or punctuation run with its leading space, or whitespace) and gives every
piece of the corpus an id, after 256 byte ids that spell any other piece in UTF-8 bytes: 2418 ids for the
shipped text. The model is a 2-layer pre-norm transformer (``TinyLM``) whose final hidden states ``h`` go
through an untied lm_head ``W``.

How the lm_head is sharded. The vocab is padded to a multiple of 128 rows (Megatron's habit; the padding rows
are excluded from the softmax by ``vocab_size=``) and split unevenly: rank r holds a contiguous block of rows
in proportion to r + 1. ``W`` is initialized whole and identically on every rank, then each rank keeps its
slice, so the sharded model starts exactly where the baseline starts. The trunk is replicated and needs no
gradient all-reduce of its own: vpce returns the gradient of ``h`` already summed over the ranks, so every
rank's trunk gets the full gradient; each rank's ``W`` shard gets the gradient of its own rows.

What is compared. The loss at every step. Matching losses over a few hundred steps of Adam check the loss and,
through the trajectory, dX and dW too: a wrong gradient moves the two runs apart within a few steps. Separately,
the peak memory of the loss step alone (forward + backward of the loss, on one batch) is measured with
``vpce.memory.PeakMemory`` for the unfused loss and for vpce.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import vpce
from vpce.bench.launch_env import local_cuda_device, set_collective_env
from vpce.memory import PeakMemory
from vpce.parallel import end_process_group

DATA_DIR = Path(__file__).resolve().parent / "data"

# Largest |loss_vpce - loss_baseline| / loss_baseline allowed at any step. Both runs are fp32 and differ only in
# rounding: vpce sums exp over vocab shards and token chunks, the baseline in one pass, so the step-1 losses agree
# to an fp32 ulp or two and the gradients to a few ulps; Adam carries that noise along the trajectory, slowly.
# Measured on CPU (3 seeds, 1 and 2 ranks): at most 2.4e-7 over the default 300 steps, 5.3e-7 over 600; on 1 and
# 2 H200s (NCCL): 2.4e-7 over 300. 1e-5 is 20x that, and fails at once on real errors, measured on this demo:
# padding rows leaking into the softmax (no ``vocab_size=``) are off by 6.5e-4 at step 1; a missing dX all-reduce
# by 1e-2 within 10 steps.
REL_TOL = 1e-5


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Everything that must be equal between the baseline run and the sharded run."""

    steps: int = 300
    """Optimizer steps."""
    batch: int = 8
    """Sequences per step (every rank sees the same batch: the ranks split the vocab, not the data)."""
    seq_len: int = 64
    """Tokens per sequence."""
    dim: int = 64
    """Model width D (the lm_head is [vocab, D])."""
    layers: int = 2
    """Transformer blocks."""
    heads: int = 4
    """Attention heads per block."""
    lr: float = 3e-3
    """Adam learning rate."""
    seed: int = 0
    """Seeds the model init (trunk and the whole lm_head) and the batch order."""
    vocab_multiple: int = 128
    """The lm_head's rows are the vocab padded up to a multiple of this."""
    loss_chunk_mib: float = 1.0
    """vpce's budget for live chunk data (its ``memory_budget``, here in MiB). The library default, 256 MiB,
    is more than this toy's whole logits, so the loss would run in one chunk; 1 MiB makes it walk the 512 tokens
    of a batch in chunks of a few dozen, with one statistics exchange per chunk, as it would at real sizes."""


class WordTokenizer:
    """Word-level tokenizer with byte fallback; lossless for any text.

    Ids 0-255 are single bytes; the corpus' pieces follow, most frequent first (ties alphabetical), so the vocab
    is a deterministic function of the corpus. A piece that is not in the vocab is spelled as its UTF-8 bytes.
    """

    # A word, a number or a punctuation run, each with its leading space; or whitespace (a run that ends before
    # a word leaves that word its space). Every character falls in one alternative, so no text is dropped.
    SPLIT = re.compile(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")

    def __init__(self, corpus: str):
        counts = collections.Counter(self.SPLIT.findall(corpus))
        pieces = sorted(counts, key=lambda p: (-counts[p], p))
        self.ids = {p: 256 + i for i, p in enumerate(pieces)}
        self.pieces = [bytes([b]) for b in range(256)] + [p.encode() for p in pieces]

    def __len__(self) -> int:
        return len(self.pieces)

    def encode(self, text: str) -> list[int]:
        out = []
        for piece in self.SPLIT.findall(text):
            i = self.ids.get(piece)
            out.extend(piece.encode() if i is None else (i,))
        return out

    def decode(self, ids) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def load_corpus() -> str:
    return "".join(p.read_text(encoding="utf-8") for p in sorted(DATA_DIR.glob("*.txt")))


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP, each on a residual branch."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm: returns the hidden states [B, T, D].

    The lm_head is not part of the module: it is the whole ``[V, D]`` weight in the baseline and one rank's
    shard of rows under vpce, owned by the training loop.
    """

    def __init__(self, vocab: int, cfg: DemoConfig):
        super().__init__()
        self.tok = nn.Embedding(vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.heads) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos.weight[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.norm(h)


def padded_vocab(vocab: int, cfg: DemoConfig) -> int:
    """Rows of the whole lm_head: the vocab rounded up to a multiple of ``cfg.vocab_multiple``."""
    return -(-vocab // cfg.vocab_multiple) * cfg.vocab_multiple


def shard_bounds(rows: int, world: int) -> list[int]:
    """Row boundaries ``[0, ..., rows]`` of the ``world`` shards; rank r's share is proportional to r + 1."""
    total = world * (world + 1) // 2
    return [rows * (r * (r + 1) // 2) // total for r in range(world + 1)]


def build(cfg: DemoConfig, vocab: int, rows: slice, device: torch.device) -> tuple[TinyLM, nn.Parameter]:
    """The trunk and the lm_head rows ``rows``, initialized identically whatever the rows and the rank."""
    torch.manual_seed(cfg.seed)
    model = TinyLM(vocab, cfg)
    head = torch.empty(padded_vocab(vocab, cfg), cfg.dim)
    nn.init.normal_(head, std=cfg.dim**-0.5)
    return model.to(device), nn.Parameter(head[rows].to(device))


def batches(tokens: torch.Tensor, cfg: DemoConfig, device: torch.device):
    """Random windows of the token stream, the same sequence in every run and on every rank."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    while True:
        starts = torch.randint(0, len(tokens) - cfg.seq_len, (cfg.batch,), generator=g)
        win = torch.stack([tokens[s: s + cfg.seq_len + 1] for s in starts.tolist()]).to(device)
        yield win[:, :-1], win[:, 1:]


def unfused_loss(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The baseline: whole logits [B*T, V], as plain PyTorch code writes it."""
    return F.cross_entropy(F.linear(h, w).flatten(0, 1).float(), y.flatten())


def vpce_loss(group, vocab: int, cfg: DemoConfig):
    """vpce over this rank's shard of rows; ``vocab_size`` excludes the padding rows."""
    budget_gib = cfg.loss_chunk_mib / 1024

    def loss(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return vpce.linear_cross_entropy(h, w, y, group=group, vocab_size=vocab, memory_budget=budget_gib)

    return loss


def loss_step_peak(model, head, loss_fn, tokens, cfg: DemoConfig, device: torch.device) -> int:
    """Peak bytes of the loss's forward + backward alone (dX and dW included), on the first batch."""
    x, y = next(batches(tokens, cfg, device))
    with torch.no_grad():
        h = model(x)
    h.requires_grad_()
    w = head.detach().requires_grad_()
    with PeakMemory(device) as pm:
        loss_fn(h, w, y).backward()
    return pm.peak


def train(model, head, loss_fn, tokens, cfg: DemoConfig, device: torch.device, log) -> list[float]:
    """Adam on the trunk and this rank's lm_head rows; ``log(step, loss)`` after each step; the losses."""
    opt = torch.optim.Adam([*model.parameters(), head], lr=cfg.lr)
    data = batches(tokens, cfg, device)
    losses = []
    for step in range(cfg.steps):
        x, y = next(data)
        loss = loss_fn(model(x), head, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        log(step, losses[-1])
    return losses


def init_distributed() -> tuple[int, int, object, torch.device]:
    """(rank, world, group, device): torchrun's environment when present, else one process, no group."""
    if "WORLD_SIZE" not in os.environ:
        return 0, 1, None, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    set_collective_env()  # NVLink multicast off, as every launch script
    if torch.cuda.is_available():
        device = local_cuda_device()
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), dist.group.WORLD, device


def write_json(path: str, obj) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=1))


def run_baseline(args, cfg: DemoConfig, tokens, vocab: int, world: int, device: torch.device) -> None:
    if world != 1:
        raise SystemExit(f"--baseline-out: the baseline is one process with the whole lm_head, got {world} "
                         f"processes; run it with --nproc-per-node 1")
    model, head = build(cfg, vocab, slice(0, vocab), device)
    peaks = {"unfused": loss_step_peak(model, head, unfused_loss, tokens, cfg, device),
             "vpce": loss_step_peak(model, head, vpce_loss(None, vocab, cfg), tokens, cfg, device)}
    t0 = time.perf_counter()

    def log(step, loss):
        if (step + 1) % args.log_every == 0 or step == 0:
            print(f"baseline step {step + 1:4d}/{cfg.steps} | loss {loss:.7f} | {time.perf_counter() - t0:5.1f} s",
                  flush=True)

    print(f"baseline: 1 process on {device.type}, whole lm_head W [{vocab}, {cfg.dim}], loss "
          f"F.cross_entropy(F.linear(h, W).float(), y); {cfg.steps} Adam steps of {cfg.batch} x {cfg.seq_len} tokens",
          flush=True)
    losses = train(model, head, unfused_loss, tokens, cfg, device, log)
    write_json(args.baseline_out, {"run": run_key(cfg, vocab, tokens), "device": device.type, "losses": losses,
                                   "peak_bytes": peaks})
    print(f"baseline losses of {cfg.steps} steps written to {args.baseline_out}")


def run_key(cfg: DemoConfig, vocab: int, tokens: torch.Tensor) -> dict:
    """What the baseline and the sharded run must share: the configuration and the tokenized corpus' size."""
    return {**asdict(cfg), "vocab": vocab, "tokens": len(tokens)}


def broadcast_json(obj, rank: int, group, device: torch.device):
    """Rank 0's JSON-serializable ``obj``, on every rank of ``group`` (``obj`` is ignored on the other ranks).

    It travels as UTF-8 bytes in a uint8 tensor, its length first, rather than through ``broadcast_object_list``:
    gloo's object collectives need numpy, which torch does not install and ``make demo`` does not either.
    """
    if group is None:
        return obj
    data = json.dumps(obj).encode() if rank == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0, group=group)
    if rank == 0:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=0, group=group)
    return json.loads(bytes(buf.tolist()))


def gather_ints(value: int, world: int, group, device: torch.device) -> list[int]:
    """Every rank's ``value``, in rank order, on every rank (an int64 all-gather, no object collective)."""
    if group is None:
        return [value]
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    return [int(t) for t in every]


def read_baseline(path: str, key: dict, rank: int, group, device: torch.device) -> dict:
    """Rank 0 reads the baseline file and broadcasts it, so that every rank checks it and reaches one verdict."""
    base = broadcast_json(json.loads(Path(path).read_text()) if rank == 0 else None, rank, group, device)
    if base["run"] != key:
        diff = {k: (v, base["run"].get(k)) for k, v in key.items() if base["run"].get(k) != v}
        raise SystemExit(f"--compare: {path} comes from another configuration ({{name: (this run, baseline)}}: "
                         f"{diff}); rerun the baseline with the same flags")
    return base


def run_sharded(args, cfg: DemoConfig, tokens, vocab: int, rank: int, world: int, group, device) -> None:
    base = read_baseline(args.compare, run_key(cfg, vocab, tokens), rank, group, device)
    bounds = shard_bounds(padded_vocab(vocab, cfg), world)
    rows = slice(bounds[rank], bounds[rank + 1])
    model, head = build(cfg, vocab, rows, device)
    loss_fn = vpce_loss(group, vocab, cfg)
    peaks = gather_ints(loss_step_peak(model, head, loss_fn, tokens, cfg, device), world, group, device)

    def say(line: str = "") -> None:
        if rank == 0:
            print(line, flush=True)

    ranks = f"{world} rank" + "s" * (world > 1)
    say(f"vpce demo: {ranks} on {device.type}; {len(tokens)} tokens of launch/data; vocab {vocab} padded to "
        f"{bounds[-1]} lm_head rows, rows per rank {[b - a for a, b in zip(bounds, bounds[1:])]}")
    say(f"model: {cfg.layers} layers, D={cfg.dim}; {cfg.steps} Adam steps of {cfg.batch} x {cfg.seq_len} tokens; "
        f"baseline: {args.compare}")
    diffs = []
    t0 = time.perf_counter()

    def log(step, loss):
        ref = base["losses"][step]
        diffs.append(abs(loss - ref) / abs(ref))
        if (step + 1) % args.log_every == 0 or step == 0:
            say(f"step {step + 1:4d}/{cfg.steps} | vpce, {ranks}: {loss:.7f} | baseline, 1 process: {ref:.7f} | "
                f"rel diff {diffs[-1]:.1e} | {time.perf_counter() - t0:5.1f} s")

    losses = train(model, head, loss_fn, tokens, cfg, device, log)
    worst = max(range(cfg.steps), key=diffs.__getitem__)
    ok = diffs[worst] <= REL_TOL

    rows_mem = [(f"unfused F.cross_entropy(F.linear(h, W).float(), y), W [{vocab}, {cfg.dim}], 1 process",
                 base["peak_bytes"]["unfused"]),
                (f"vpce, W [{vocab}, {cfg.dim}], 1 process", base["peak_bytes"]["vpce"])]
    for r in range(world):
        pad = max(0, bounds[r + 1] - max(bounds[r], vocab))
        rows_mem.append((f"vpce, rank {r} of {world}: W rows {bounds[r]}-{bounds[r + 1] - 1}"
                         + (f" ({pad} of them padding)" if pad else ""), peaks[r]))
    width = max(len(label) for label, _ in rows_mem)
    say(f"\npeak memory of the loss step alone (forward + backward, dX and dW included; {cfg.batch * cfg.seq_len} "
        f"tokens, D={cfg.dim}; vpce chunk budget {cfg.loss_chunk_mib:g} MiB: vpce's memory_budget for live chunk "
        f"data, set this low so that the toy's tokens run in several chunks as at real sizes; the library "
        f"default, 256 MiB, would hold these logits whole):")
    for label, nbytes in rows_mem:
        say(f"  {label:<{width}}  {nbytes / 2**20:6.2f} MiB")
    if rank == 0 and args.report:
        write_json(args.report, {"run": run_key(cfg, vocab, tokens), "world": world, "device": device.type,
                                 "losses": losses, "baseline_losses": base["losses"], "rel_diffs": diffs,
                                 "max_rel_diff": diffs[worst], "tolerance": REL_TOL, "ok": ok,
                                 "peak_bytes": {"baseline": base["peak_bytes"], "vpce_per_rank": peaks}})
        say(f"\nreport (both loss curves, per-step rel diffs, peak memory): {args.report}")
    say(f"\nmax rel diff of the loss, vpce vs baseline, over {cfg.steps} steps: {diffs[worst]:.2e} at step "
        f"{worst + 1} (tolerance {REL_TOL:.0e}): {'OK' if ok else 'FAIL'}")
    if not ok:
        raise SystemExit(1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--baseline-out", metavar="JSON", help="train the unsharded baseline (1 process), write it")
    mode.add_argument("--compare", metavar="JSON", help="train with the vocab-sharded lm_head, compare to this")
    p.add_argument("--report", metavar="JSON", help="with --compare: write both loss curves and the verdict here")
    p.add_argument("--steps", type=int, default=DemoConfig.steps, help="optimizer steps (default %(default)s)")
    p.add_argument("--seed", type=int, default=DemoConfig.seed, help="init and data-order seed")
    p.add_argument("--log-every", type=int, default=25, help="print a progress line every K steps")
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    torch.set_float32_matmul_precision("highest")  # no TF32 on GPUs: both runs are plain fp32
    rank, world, group, device = init_distributed()
    cfg = DemoConfig(steps=args.steps, seed=args.seed)
    text = load_corpus()
    tok = WordTokenizer(text)
    tokens = torch.tensor(tok.encode(text))
    finished = False
    try:
        if args.baseline_out:
            run_baseline(args, cfg, tokens, len(tok), world, device)
        else:
            run_sharded(args, cfg, tokens, len(tok), rank, world, group, device)
        finished = True
    finally:
        if group is not None:
            end_process_group(finished)


if __name__ == "__main__":
    main()
