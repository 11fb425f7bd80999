"""Whole-step CPU overhead of fsdp2 against torch's fully_shard, by phase, interleaved round by round.

Four models: unsharded, torch's ``fully_shard``, fsdp2, and fsdp2 with ``fsdp2.local_step`` (the
optimizer step on local shards).

One process, a gloo group of one rank (no collective leaves the process, so what is measured is the
FSDP machinery's own cost): a stack of small transformer blocks, each block its own group plus the
root, trained with AdamW and gradient clipping. Every round runs a few steps of each of three models
in turn (unsharded, torch's ``fully_shard``, fsdp2), timing each phase: forward, backward, clipping,
optimizer step. Overhead per group per step = (sharded - unsharded) / groups, per phase; the ratio
fsdp2 / torch is computed per round, and its median and 5th-95th percentiles over rounds are reported.

Clipping uses ``torch.nn.utils.clip_grad_norm_`` for torch and the unsharded model, and
``fsdp2.clip_grad_norm_`` for fsdp2 (the user-facing choice each offers).

Run:  python benchmarks/step_overhead.py [--blocks 32 --dim 64 --rounds 10 --steps 5]
Writes benchmarks/results/step_overhead.json and .png (matplotlib) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fsdp2

PHASES = ("forward", "backward", "clip", "optimizer")


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.down(torch.relu(self.up(self.norm2(x))))


class Model(nn.Module):
    def __init__(self, blocks: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.reshape(-1, x.size(-1)))  # 2-D: the output is not a view


def build(kind: str, blocks: int, dim: int) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = Model(blocks, dim)
    clip = torch.nn.utils.clip_grad_norm_
    if kind == "torch":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif kind in ("fsdp2", "fsdp2-local"):
        for block in model.blocks:
            fsdp2.fully_shard(block)
        fsdp2.fully_shard(model)
        clip = fsdp2.clip_grad_norm_
    return model, clip


def time_steps(
    model: nn.Module, clip: Any, optim: torch.optim.Optimizer, x: torch.Tensor, steps: int
) -> dict[str, float]:
    """Mean seconds per phase over ``steps`` training steps."""
    totals = dict.fromkeys(PHASES, 0.0)
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = model(x).sum()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        clip(model.parameters(), 1.0)
        t3 = time.perf_counter()
        optim.step()
        optim.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        for phase, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            totals[phase] += dt
    return {phase: total / steps for phase, total in totals.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    groups = args.blocks + 1
    x = torch.randn(4, 16, args.dim)
    models = {}
    for kind in ("plain", "torch", "fsdp2", "fsdp2-local"):
        model, clip = build(kind, args.blocks, args.dim)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if kind == "fsdp2-local":  # the optimizer step on local shards: fsdp2.local_step
            optim = fsdp2.local_step(optim)
        time_steps(model, clip, optim, x, 3)  # warm-up (lazy init, allocator)
        models[kind] = (model, clip, optim)
    per_round: list[dict[str, dict[str, float]]] = []
    for _ in range(args.rounds):
        per_round.append({kind: time_steps(*models[kind], x, args.steps) for kind in models})
    kinds = ("torch", "fsdp2", "fsdp2-local")
    overhead: dict[str, dict[str, list[float]]] = {k: {p: [] for p in (*PHASES, "step")} for k in kinds}
    ratios: dict[str, list[float]] = {p: [] for p in (*PHASES, "step")}
    local_ratios: dict[str, list[float]] = {p: [] for p in (*PHASES, "step")}
    for measured in per_round:
        for kind in kinds:
            for phase in PHASES:
                overhead[kind][phase].append(
                    (measured[kind][phase] - measured["plain"][phase]) / groups * 1e6
                )
            overhead[kind]["step"].append(sum(overhead[kind][p][-1] for p in PHASES))
        for phase in (*PHASES, "step"):
            theirs = overhead["torch"][phase][-1]
            ratios[phase].append(overhead["fsdp2"][phase][-1] / theirs if theirs > 0 else float("nan"))
            local = overhead["fsdp2-local"][phase][-1]
            local_ratios[phase].append(local / theirs if theirs > 0 else float("nan"))
    summary = {
        kind: {phase: statistics.median(values) for phase, values in phases.items()}
        for kind, phases in overhead.items()
    }
    ratio_summary = {phase: _median_and_band(values) for phase, values in ratios.items()}
    local_summary = {phase: _median_and_band(values) for phase, values in local_ratios.items()}
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "config": {
            "blocks": args.blocks,
            "dim": args.dim,
            "rounds": args.rounds,
            "steps_per_round": args.steps,
        },
        "overhead_us_per_group_per_step": summary,
        "ratio_fsdp2_over_torch": ratio_summary,
        "ratio_fsdp2_local_step_over_torch": local_summary,
    }


def _median_and_band(values: list[float]) -> dict[str, float]:
    clean = sorted(v for v in values if v == v)
    if not clean:
        return {"median": float("nan"), "p05": float("nan"), "p95": float("nan")}
    pick = lambda q: clean[min(len(clean) - 1, max(0, round(q * (len(clean) - 1))))]  # noqa: E731
    return {"median": statistics.median(clean), "p05": pick(0.05), "p95": pick(0.95)}


def write(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_overhead.json").write_text(json.dumps(result, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.27
    positions = range(len(PHASES))
    for offset, kind in ((-width, "torch"), (0.0, "fsdp2"), (width, "fsdp2-local")):
        values = [result["overhead_us_per_group_per_step"][kind][p] for p in PHASES]
        ax.bar([p + offset for p in positions], values, width, label=kind)
    ax.set_xticks(list(positions), list(PHASES))
    ax.set_ylabel("µs per group per step")
    ratio = result["ratio_fsdp2_over_torch"]["step"]
    ax.set_title(f"overhead over the unsharded model; fsdp2/torch per step: {ratio['median']:.2f}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "step_overhead.png", dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5, help="steps per model per round")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        result = run(args)
    finally:
        dist.destroy_process_group()
    write(result, Path(args.out))
    print(
        f"{'phase':10s} {'torch µs':>9s} {'fsdp2 µs':>9s} {'ratio':>6s} {'(p05-p95)':>12s} "
        f"{'+local µs':>10s} {'ratio':>6s}"
    )
    for phase in (*PHASES, "step"):
        per = result["overhead_us_per_group_per_step"]
        r = result["ratio_fsdp2_over_torch"][phase]
        rl = result["ratio_fsdp2_local_step_over_torch"][phase]
        print(
            f"{phase:10s} {per['torch'][phase]:9.1f} {per['fsdp2'][phase]:9.1f} {r['median']:6.2f} "
            f"({r['p05']:.2f}-{r['p95']:.2f}) {per['fsdp2-local'][phase]:10.1f} {rl['median']:6.2f}"
        )
    print(result["machine"])
    return result


if __name__ == "__main__":
    main()
