"""Train a tiny character-level GPT with fsdp2, on CPUs (gloo) or GPUs (NCCL).

    torchrun --standalone --nproc-per-node 2 examples/train.py            # 2 CPU processes, ~1 minute
    torchrun --standalone --nproc-per-node 8 examples/train.py            # 8 GPUs: NCCL, cuda:LOCAL_RANK
    torchrun --standalone --nproc-per-node 2 examples/train.py --explicit-prefetching
    torchrun --standalone --nproc-per-node 2 examples/train.py --compile    # whole model, fullgraph

Read it top to bottom: data, model, sharding, initialisation, training loop. Everything FSDP-specific is
in `shard_model` (fully_shard bottom-up, optional prefetch lists) and `init_weights` (why a model built
on the meta device and then sharded needs an init of its own).
The text it learns from ships in examples/data/; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

import fsdp2
from fsdp2 import fully_shard

DATA_DIR = Path(__file__).resolve().parent / "data"

# -----------------------------------------------------------------------------
# command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64, help="characters per sequence")
    p.add_argument("--dim", type=int, default=128, help="model width")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads (must divide --dim)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate")
    p.add_argument("--seed", type=int, default=1337, help="model seed (same on all ranks)")
    p.add_argument("--explicit-prefetching", action="store_true", help="prefetch the next k blocks")
    p.add_argument("--prefetch-depth", type=int, default=2, help="k for --explicit-prefetching")
    p.add_argument("--sample-chars", type=int, default=0, help="characters to generate after training")
    p.add_argument(
        "--trace",
        metavar="DIR",
        default=None,
        help="record steps 2-3, write DIR/rank<r>.json and .png timelines and DIR/timeline.json (all ranks)",
    )
    p.add_argument("--ckpt-dir", default=None, help="directory for DCP checkpoints (DIR/step_<n>)")
    p.add_argument(
        "--ckpt-dcp",
        action="store_true",
        help="save with torch's dcp.save (default: fsdp2.ShardedCheckpointer: same format, no plan gather)",
    )
    p.add_argument(
        "--ckpt-every", type=int, default=0, help="save every N steps and after the last step (0: never)"
    )
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=0,
        help="every N steps, keep the sharded state in node memory and on the next node; a restart "
        "(any number of ranks) continues from the newest one of this job (0: never; FSDP2_SNAPSHOT_DIR: "
        "where; the job: torchrun's --rdzv-id, or FSDP2_SNAPSHOT_JOB)",
    )
    p.add_argument(
        "--export",
        metavar="DIR",
        default=None,
        help="write the trained weights as a Hugging Face checkpoint (sharded safetensors + index) in DIR",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a dead peer ends the job")
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the whole model (fullgraph): the all-gathers and reduce-scatters in the graph",
    )
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend for --compile")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    if args.dim % args.heads:
        p.error(f"--heads ({args.heads}) must divide --dim ({args.dim}): each head gets dim / heads channels")
    if (args.ckpt_every or args.resume) and not args.ckpt_dir:
        p.error("--ckpt-every and --resume need --ckpt-dir")
    if args.ckpt_every < 0 or args.snapshot_every < 0 or args.timeout <= 0:
        p.error("--ckpt-every and --snapshot-every must be >= 0 and --timeout > 0")
    if args.compile and (args.explicit_prefetching or args.trace):
        # Compiled, the collectives are the compiler's to order: no eager engine to prefetch or record.
        p.error("--compile schedules the collectives in the graph: drop --explicit-prefetching and --trace")
    return args


# -----------------------------------------------------------------------------
# data: every .txt file in examples/data, one character = one token


class CharData:
    def __init__(self, data_dir: Path) -> None:
        text = "".join(path.read_text(encoding="utf-8") for path in sorted(data_dir.glob("*.txt")))
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.tokens = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)  # (N,)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(self, batch_size: int, seq_len: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        # Random windows; the target is the window shifted by one character.
        starts = torch.randint(len(self.tokens) - seq_len - 1, (batch_size,), generator=gen)
        x = torch.stack([self.tokens[s : s + seq_len] for s in starts.tolist()])  # (B, T)
        y = torch.stack([self.tokens[s + 1 : s + 1 + seq_len] for s in starts.tolist()])  # (B, T)
        return x, y

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


# -----------------------------------------------------------------------------
# model: a decoder-only transformer, pre-norm, learned positions


@dataclass
class GPTConfig:
    vocab_size: int
    seq_len: int
    dim: int
    layers: int
    heads: int


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # batch, time, channels
        H = self.heads
        q, k, v = self.qkv(x).split(C, dim=-1)  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))  # 3 x (B, H, T, C/H)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, C/H)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.down = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))  # (B, T, C) -> (B, T, 4C) -> (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))  # (B, T, C)
        return x + self.mlp(self.norm2(x))  # (B, T, C)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        return self.head(self.norm(x))  # (B, T, vocab)


# -----------------------------------------------------------------------------
# sharding and initialisation


def shard_model(model: GPT, mesh: DeviceMesh, prefetch_depth: int) -> None:
    # Bottom-up: each block becomes one all-gather / reduce-scatter unit, then the root picks up
    # what is left (embeddings, final norm, head). Parameters become DTensors sharded on dim 0.
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if prefetch_depth > 0:
        # By default FSDP prefetches one block ahead, implicitly. Here we say which blocks to
        # all-gather early: the next k in forward, and the previous k (next in backward order) in backward.
        blocks = list(model.blocks)
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + prefetch_depth])
        reversed_blocks = blocks[::-1]
        for i, block in enumerate(reversed_blocks):
            block.set_modules_to_backward_prefetch(reversed_blocks[i + 1 : i + 1 + prefetch_depth])


@torch.no_grad()
def init_weights(model: GPT, seed: int) -> None:
    # The model was built on the meta device and `to_empty` gave it uninitialised memory, so every
    # parameter is written here. Each *full* tensor is drawn from one CPU generator, identical on every
    # rank, and each rank keeps only its own shard: the model is the same whatever the world size or
    # device. (DTensor's random ops, e.g. nn.init.normal_ on a sharded parameter, run too, but on a CPU
    # mesh every rank draws the same numbers for its shard, so the full weight repeats itself.)
    # One full tensor at a time is fine at this size; a model too big for that would initialise on
    # rank 0 and broadcast, or use DTensor's RNG on GPU.
    gen = torch.Generator().manual_seed(seed)
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            # GPT-2 scales the init of the layers that write into the residual stream.
            std = 0.02 / math.sqrt(2 * model.cfg.layers) if name.endswith(("proj", "down")) else 0.02
            set_full(module.weight, torch.randn(module.weight.shape, generator=gen) * std)
        elif isinstance(module, nn.LayerNorm):
            set_full(module.weight, torch.ones(module.weight.shape))
        if isinstance(module, (nn.Linear, nn.LayerNorm)) and module.bias is not None:
            set_full(module.bias, torch.zeros(module.bias.shape))


def set_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Writes the full (unsharded) value `full` into `param`, which may be a sharded DTensor."""
    full = full.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank already holds the full tensor, so cut locally, no scatter.
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(full)


# -----------------------------------------------------------------------------
# distributed set-up: torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT


def setup_distributed(timeout_s: float) -> tuple[torch.device, bool]:
    """Returns this rank's device and whether we created the process group (and must destroy it)."""
    created = not dist.is_initialized()  # the test harness creates the group itself
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    # A peer that died makes the others fail after the timeout instead of waiting 30 minutes.
    timeout = timedelta(seconds=timeout_s)
    if created and "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    elif created:  # plain `python examples/train.py`: a world of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # Several ranks share this machine's cores; oversubscribing them makes every rank slower.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return device, created


class Progress:
    """Rank 0's progress line: redrawn in place on a terminal, a line every ~10% otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.start = total, enabled, time.perf_counter()
        self.tty = sys.stdout.isatty()
        self.every = max(1, total // 10)

    def update(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        done = step + 1
        elapsed = time.perf_counter() - self.start
        if self.tty:
            bar = "#" * (30 * done // self.total)
            line = f"[{bar:<30}] step {done}/{self.total} loss {loss:.4f} {elapsed:.0f}s"
            print("\r" + line, end="\n" if done == self.total else "", flush=True)
        elif done == 1 or done % self.every == 0 or done == self.total:
            print(f"step {done:>5}/{self.total} loss {loss:.4f} {elapsed:6.1f}s", flush=True)


# -----------------------------------------------------------------------------
# training


def write_traces(events: list[fsdp2.Event], out: Path, rank: int, world_size: int) -> None:
    """This rank's timeline (JSON and PNG), then all ranks merged into one JSON by rank 0.

    Rank 0 also prints its communication report: per group, how long the collectives took and how
    long training waited on them.
    """
    out.mkdir(parents=True, exist_ok=True)
    fsdp2.save_timeline(events, out / f"rank{rank}.json")
    fsdp2.save_timeline(events, out / f"rank{rank}.png")
    stragglers = fsdp2.straggler_report(events)  # every rank: one exchange of the recorded waits
    dist.barrier()
    if rank == 0:
        fsdp2.merge_timelines([out / f"rank{r}.json" for r in range(world_size)], out / "timeline.json")
        print(f"rank 0: {fsdp2.communication_report(events)}", flush=True)
        print(f"the rank the others waited for (all ranks):\n{stragglers}", flush=True)
        print(f"timelines in {out}/ (open timeline.json in https://ui.perfetto.dev)", flush=True)


def main(argv: list[str] | None = None) -> list[float]:
    """Trains and returns the per-step loss, averaged over ranks (so identical on every rank)."""
    args = parse_args(argv)
    device, created_group = setup_distributed(args.timeout)
    interrupted = False
    try:
        return train(args, device)
    except CheckpointError as error:
        if not created_group:
            raise  # called from the caller's own process group: let it decide
        if dist.get_rank() == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        interrupted = True  # no collective teardown: exit at once, every rank alike
        sys.stdout.flush()
        os._exit(1)
    except KeyboardInterrupt:
        # Ctrl-C reaches every rank: one line each, no traceback; the checkpoints on disk are complete.
        interrupted = True
        hint = f"; continue with --ckpt-dir {args.ckpt_dir} --resume" if args.ckpt_dir else ""
        print(f"rank {dist.get_rank()}: interrupted{hint}", file=sys.stderr, flush=True)
        if not created_group:
            raise  # called from the caller's own process group: let it decide
        sys.stdout.flush()
        os._exit(130)  # skip the teardown: gloo's threads would abort noisily with the peers gone
    finally:
        if created_group and not interrupted:  # after Ctrl-C the peers may be gone: no collective teardown
            # The model, optimizer and mesh died with train()'s frame, but DTensor leaves reference
            # cycles that still hold the process groups. Collect them while the groups can be torn down
            # cleanly: with gloo, a group freed only at interpreter exit sometimes aborts the process.
            gc.collect()
            dist.destroy_process_group()


def build(
    args: argparse.Namespace, device: torch.device
) -> tuple[CharData, GPTConfig, GPT, torch.optim.Optimizer, Any]:
    """The data, the sharded and initialised model, its optimizer and learning-rate schedule."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    data = CharData(DATA_DIR)
    cfg = GPTConfig(data.vocab_size, args.seq_len, args.dim, args.layers, args.heads)
    with torch.device("meta"):
        model = GPT(cfg)  # shapes only, no memory yet
    shard_model(model, mesh, args.prefetch_depth if args.explicit_prefetching else 0)
    model.to_empty(device=device)  # allocates only this rank's shards
    init_weights(model, args.seed)
    # AdamW sees the sharded parameters: its state is sharded too.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    warmup = max(1, args.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / args.steps))
    )
    return data, cfg, model, optimizer, schedule


def resume(
    args: argparse.Namespace,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: Any,
    snapshots: Any,
) -> int:
    """The step to start from: the newest memory snapshot, else (or if newer) the newest disk checkpoint."""
    rank, first_step, lost = dist.get_rank(), 0, False
    if snapshots is not None:
        restored = snapshots.restore()
        lost = restored.lost
        if restored.step is not None:
            first_step = restored.step
            if rank == 0:
                print(restored.message, flush=True)
        elif lost and not args.ckpt_dir:
            raise CheckpointError(
                f"{restored.message}, and there is no --ckpt-dir to fall back to. Start again from step 0 "
                f"after removing {snapshots.directory} on every node, or bring the lost node back."
            )
        elif lost and rank == 0:
            print(f"{restored.message}: falling back to the newest checkpoint in {args.ckpt_dir}", flush=True)
    if args.resume or lost:
        newest = max(complete_checkpoints(Path(args.ckpt_dir))[0], default=0)
        if newest > first_step or (lost and first_step == 0):
            first_step = load_checkpoint(Path(args.ckpt_dir), model, optimizer, schedule)
    return first_step


def train(args: argparse.Namespace, device: torch.device) -> list[float]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data, cfg, model, optimizer, schedule = build(args, device)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{n_params / 1e6:.2f}M parameters, vocab {data.vocab_size}, {world_size} rank(s), {device}")

    snapshots = None
    saver = None if args.ckpt_dcp else fsdp2.ShardedCheckpointer()  # plans once, reused at every save
    if args.snapshot_every:
        # In node memory and on the next node (docs/resilience.md): a restart after a lost node reads no disk.
        snapshots = fsdp2.Snapshots(
            model, optimizer, every=args.snapshot_every, state={"schedule": schedule}, name="train"
        )
    first_step = resume(args, model, optimizer, schedule, snapshots)
    # --compile: one graph for forward and one for backward, each block's all-gathers and
    # reduce-scatters inside them (docs/compile.md). The parameters, optimizer and checkpoints are
    # the same sharded DTensors either way; only the calls go through the compiled wrapper.
    forward = torch.compile(model, fullgraph=True, backend=args.compile_backend) if args.compile else model
    losses: list[float] = []
    progress = Progress(args.steps, enabled=rank == 0)
    model.train()
    trace_steps = (min(1, args.steps - 1), min(2, args.steps - 1))  # after the first step's lazy init
    recording: contextlib.AbstractContextManager[list[fsdp2.Event]] | None = None
    events: list[fsdp2.Event] = []
    for step in range(first_step, args.steps):
        if args.trace and step == trace_steps[0]:
            recording = fsdp2.record_events()
            events = recording.__enter__()
        gen = batch_generator(args.seed, step, rank)  # a function of (step, rank): resumable anywhere
        x, y = (t.to(device) for t in data.batch(args.batch_size, args.seq_len, gen))  # (B, T) each
        phase("forward", step)
        logits = forward(x)  # (B, T, vocab); all-gathers each block's parameters just in time
        loss = F.cross_entropy(logits.view(-1, cfg.vocab_size), y.view(-1))
        phase("backward", step)
        loss.backward()  # reduce-scatters gradients: each rank ends with the mean gradient of its shard
        phase("optimizer", step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # SUM: gloo has no AVG
        losses.append(mean_loss.item() / world_size)
        progress.update(step, losses[-1])
        if snapshots is not None:
            snapshots.save(step + 1)  # every --snapshot-every steps: the copy runs beside the next steps
        if args.ckpt_every and ((step + 1) % args.ckpt_every == 0 or step + 1 == args.steps):
            # every N steps and after the last one, on the cadence or not (as torchtitan's
            # CheckpointManager does): the end of a run can always be resumed with more --steps
            save_checkpoint(Path(args.ckpt_dir), step + 1, model, optimizer, schedule, saver)
        if recording is not None and step == trace_steps[1]:
            recording.__exit__(None, None, None)
            recording = None
            write_traces(events, Path(args.trace), rank, world_size)

    if snapshots is not None:
        snapshots.close(discard=True)  # the run is complete: nothing to resume, free the memory
    if args.sample_chars > 0:
        text = sample(model, data, args.sample_chars, device, args.seed)
        if rank == 0:
            print(f"--- sample ---\n{text}\n--------------")
    if args.export:
        fsdp2.save_pretrained(model, args.export)  # every rank writes its own files, in parallel
        if rank == 0:
            print(
                f"weights written to {args.export}/ (safetensors files and index, plain parameter names)",
                flush=True,
            )
    if rank == 0 and losses:
        print(f"final: first loss {losses[0]:.4f}, last loss {losses[-1]:.4f} after {len(losses)} steps")
    return losses


# -----------------------------------------------------------------------------
# checkpoints: DCP for the sharded model and optimizer, one small file for the rest
#
# A checkpoint is complete or invisible. Every rank writes into DIR/step_<n>.partial; once all have
# finished (a barrier), the ranks hash the files (MANIFEST.json: each file's size and sha256), rank 0
# writes COMPLETE and renames the folder to DIR/step_<n> in one atomic step. --resume verifies the
# newest complete checkpoint against its manifest and falls back to the newest intact one, naming what
# is missing or damaged; with none intact it stops with one line. A kill at any point leaves either a
# .partial folder, which --resume ignores (and the next save of that step clears), or a complete
# step_<n>. Nothing in a checkpoint depends on the world size:
# DCP reshards the model and optimizer onto any number of ranks, the schedule is the same on every
# rank, and each batch is drawn from a generator seeded by (seed, step, rank), so a run resumed on
# another number of ranks continues deterministically.

COMPLETE = "COMPLETE"
MANIFEST = "MANIFEST.json"  # every file of the checkpoint: size and sha256, written before COMPLETE


class CheckpointError(RuntimeError):
    """No intact checkpoint to resume from (main() prints it as one line, without a traceback)."""


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: Path) -> None:
    """Every rank hashes its share of the checkpoint's files; rank 0 writes the manifest."""
    rank, world = dist.get_rank(), dist.get_world_size()
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name not in (COMPLETE, MANIFEST))
    mine = {
        n: {"size": (folder / n).stat().st_size, "sha256": _sha256(folder / n)} for n in names[rank::world]
    }
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        files = {name: entry for part in everyone for name, entry in part.items()}
        (folder / MANIFEST).write_text(json.dumps({"files": files}, indent=1, sort_keys=True))


def damage(folder: Path) -> list[str]:
    """What keeps a complete checkpoint from loading as it was saved ([] when nothing): the same list
    on every rank.

    Total: each rank checks its share of the files and turns anything it cannot check (a manifest of
    another shape, an unreadable file) into a problem, then one exchange gives every rank the union,
    so no rank raises alone while the others wait for it.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        problems = _problems(folder, rank, world)
    except Exception as error:  # whatever was not foreseen is damage too, on every rank alike
        problems = [f"cannot be verified ({type(error).__name__}: {error})"]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, problems)
    return sorted({p for part in everyone for p in part})


def _problems(folder: Path, rank: int, world: int) -> list[str]:
    """This rank's part of ``damage``: the marker, the manifest's shape and coverage, then its share."""
    marker = (folder / COMPLETE).read_text().splitlines()
    step = folder.name[len("step_") :]
    if not marker or marker[0] != f"step {step}":
        said = repr(marker[0]) if marker else "nothing"
        return [f"{COMPLETE} says {said}, not 'step {step}' (a folder renamed after the save)"]
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        if MANIFEST not in marker:
            return []  # saved before manifests existed: loaded unverified, as before
        return [f"{MANIFEST} missing"]
    except ValueError as error:  # not JSON, or not UTF-8
        return [f"{MANIFEST} unreadable ({error})"]
    files, problem = _manifest_files(manifest)
    if problem:
        return [f"{MANIFEST} unreadable ({problem})"]
    needed = (".metadata", "train_state.pt")  # what a load opens besides the shards .metadata names
    problems = [f"{MANIFEST} does not list {name}" for name in needed if name not in files]
    ours = (COMPLETE, MANIFEST)
    unlisted = sorted(p.name for p in folder.iterdir() if p.name not in files and p.name not in ours)
    if unlisted:
        problems.append(f"{', '.join(unlisted)} not in {MANIFEST}")
    for name in sorted(files)[rank::world]:
        path, entry = folder / name, files[name]
        if not path.is_file():
            problems.append(f"{name} missing")
        elif path.stat().st_size != entry["size"]:
            problems.append(f"{name} has {path.stat().st_size} bytes, {entry['size']} written")
        elif _sha256(path) != entry["sha256"]:
            problems.append(f"{name} changed since it was written (sha256)")
        elif name == ".metadata":  # intact: every file DCP will read must be one the manifest vouches for
            from torch.distributed.checkpoint import FileSystemReader

            storage = FileSystemReader(str(folder)).read_metadata().storage_data or {}
            unvouched = sorted({info.relative_path for info in storage.values()} - files.keys())
            if unvouched:
                problems.append(f".metadata reads {', '.join(unvouched)}, which {MANIFEST} does not list")
    return problems


def _manifest_files(manifest: Any) -> tuple[dict[str, Any], str]:
    """``(files, "")`` for a manifest shaped as ``write_manifest`` writes it, else ``({}, what is wrong)``."""
    shape = '{"files": {name: {"size": bytes, "sha256": hex digest}}}'
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return {}, f"a JSON {type(manifest).__name__} where {shape} was written"
    for name, entry in files.items():
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            return {}, f"{name!r} is not a file name of the checkpoint"
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
            return {}, f"the entry of {name} has no sha256"
        size = entry.get("size")
        if isinstance(size, bool) or not isinstance(size, int):
            return {}, f"the entry of {name} has no size"
    return files, ""


def phase(name: str, step: int) -> None:
    """Called before each step's forward, backward and optimizer step (tests stop a rank there)."""


def checkpoint_stage(stage: str) -> None:
    """Called at each point of a save: dcp_written, state_written, marked, renamed (tests kill there)."""


def batch_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """The generator of one rank's batch at one step (ranks draw different batches)."""
    return torch.Generator().manual_seed((seed + 1) * 1_000_003 + step * 1_009 + rank)


def save_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: Any,
    saver: fsdp2.ShardedCheckpointer | None = None,
) -> None:
    """DIR/step_<n>: model and optimizer in DCP's format (each rank writes its shards), schedule, COMPLETE.

    ``saver``: fsdp2's checkpointer (every rank's chunks placed from the layout, no gather of plans);
    ``None``: torch's ``dcp.save``. Either loads with ``dcp.load``.
    """
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    rank = dist.get_rank()
    final, partial = root / f"step_{step}", root / f"step_{step}.partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
    dist.barrier()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    if saver is None:
        dcp.save(state, checkpoint_id=str(partial))
    else:
        saver.save(state, partial)
    checkpoint_stage("dcp_written")
    if rank == 0:
        torch.save(
            {"step": step, "schedule": schedule.state_dict(), "world_size": dist.get_world_size()},
            partial / "train_state.pt",
        )
    checkpoint_stage("state_written")
    dist.barrier()  # every rank's files are written
    write_manifest(partial)  # sizes and checksums, so --resume can tell a damaged checkpoint
    if rank == 0:
        (partial / COMPLETE).write_text(f"step {step}\n{MANIFEST}\n")  # this save wrote a manifest
        checkpoint_stage("marked")
        replaced = root / f"step_{step}.replaced"
        if final.exists():  # an earlier run's step n: set aside, dropped once the new one is in place
            shutil.rmtree(replaced, ignore_errors=True)
            final.rename(replaced)
        partial.rename(final)  # atomic: the checkpoint appears complete or not at all
        shutil.rmtree(replaced, ignore_errors=True)
    checkpoint_stage("renamed")
    dist.barrier()


def complete_checkpoints(root: Path) -> tuple[list[int], list[str]]:
    """Steps of the complete checkpoints under root, and the names of the folders skipped."""
    steps, skipped = [], []
    for path in sorted(root.glob("step_*")):
        if _step_of(path.name) is not None and (path / COMPLETE).is_file():
            steps.append(int(path.name[len("step_") :]))
        else:
            skipped.append(path.name)
    return sorted(steps), skipped


def _step_of(name: str) -> int | None:
    """n for a name a save writes (``step_<n>``, n in ASCII digits without leading zeros), else None."""
    suffix = name[len("step_") :] if name.startswith("step_") else ""
    if suffix.isascii() and suffix.isdigit() and suffix == str(int(suffix)):
        return int(suffix)
    return None


def _why_skipped(name: str) -> str:
    if _step_of(name) is None and not name.endswith((".partial", ".replaced")):
        return "not a name a save writes (step_<n>, n without leading zeros)"
    return "incomplete (a save was interrupted)"


def load_checkpoint(root: Path, model: nn.Module, optimizer: torch.optim.Optimizer, schedule: Any) -> int:
    """Restore the latest complete DIR/step_<n>; returns n, the next step to run (0 when there is none)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    rank = dist.get_rank()
    listing: list[Any] = [complete_checkpoints(root)]
    dist.broadcast_object_list(listing, src=0)  # rank 0's listing: every rank verifies the same folders
    steps, skipped = listing[0]
    for name in skipped if rank == 0 else []:
        print(f"skipped {root / name}: {_why_skipped(name)}", flush=True)
    if not steps:
        if rank == 0:
            print(f"no complete checkpoint in {root}: starting from step 0", flush=True)
        return 0
    damaged = []
    for step in reversed(steps):  # the newest intact one
        problems = damage(root / f"step_{step}")
        if not problems:
            break
        damaged.append(f"step_{step} ({'; '.join(problems)})")
        if rank == 0:
            print(f"skipped damaged checkpoint {root / f'step_{step}'}: {'; '.join(problems)}", flush=True)
    else:
        raise CheckpointError(
            f"every checkpoint in {root} is damaged: {', '.join(damaged)}. Remove them to start from step 0, "
            "or restore the files from a copy."
        )
    path = root / f"step_{step}"
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    if (path / ".fsdp2_layout").exists():  # written by fsdp2.ShardedCheckpointer: no plan gather
        fsdp2.load_sharded(state, path)  # reshards onto this run's ranks
    else:
        dcp.load(state, checkpoint_id=str(path))  # --ckpt-dcp's, or an older run's
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    extra = torch.load(path / "train_state.pt", weights_only=False)
    schedule.load_state_dict(extra["schedule"])
    if rank == 0:
        saved_world = extra["world_size"]
        moved = "" if saved_world == dist.get_world_size() else f", saved on {saved_world} rank(s)"
        print(f"resumed from {path} (step {extra['step']}{moved})", flush=True)
    return int(extra["step"])


@torch.no_grad()
def sample(model: GPT, data: CharData, n_chars: int, device: torch.device, seed: int) -> str:
    # Every rank runs every forward (each one all-gathers), with the same generator, so all agree.
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    idx = [data.stoi["\n"]]
    for _ in range(n_chars):
        context = torch.tensor([idx[-model.cfg.seq_len :]], device=device)  # (1, T)
        probs = F.softmax(model(context)[0, -1].float().cpu(), dim=-1)  # (vocab,)
        idx.append(int(torch.multinomial(probs, 1, generator=gen)))
    model.train()
    return data.decode(idx[1:])


if __name__ == "__main__":
    main()
