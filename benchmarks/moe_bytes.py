"""Reduce-scatter bytes of a mixture-of-experts model: what leaving out parameters no rank used saves.

A model of 2 mixture-of-experts layers (8 experts, each a 2-layer MLP of width 4 x dim, top-1 routing;
an expert with no token on a rank is not called, as in Hugging Face's Mixtral), each layer one
``fully_shard`` group, then the root. Every process counts the bytes its reduce-scatter inputs hold
per training step (AdamW), for:

- ``torch``: torch 2.13's ``fully_shard`` with ``set_reduce_scatter_unused_params(True)`` (needed for
  experts idle on some ranks, it reduces every parameter);
- ``fsdp2 all``: fsdp2 with ``set_reduce_scatter_unused_params(True)`` (everything sent, as torch);
- ``fsdp2``: fsdp2's default (parameters no rank used are left out of the reduce-scatter).

Tokens per rank and routing vary: uniform routing, and a skewed router (experts 0 and 1 favoured, as
early in training or with a collapsed router). Also reported: the experts idle on every rank per layer
and step, the agreements (small all-reduces) fsdp2 issued per step, and fsdp2's worst step against
the bytes the parameters some rank used need (the first step included).

Run:  torchrun --standalone --nproc-per-node 2 benchmarks/moe_bytes.py [--dim 128 --steps 6]
(part (h) of ``suite.py``).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fsdp2
import fsdp2.testing

EXPERTS = 8
_RS = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


class Expert(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class MoE(nn.Module):
    """Top-1 routing; experts without a token on this rank are not called."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, EXPERTS)
        self.experts = nn.ModuleList(Expert(dim) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        gates = self.router(h).softmax(-1)
        choice = gates.argmax(-1)
        out = torch.zeros_like(h)
        for e in choice.unique().tolist():
            mask = choice == e
            out = out.index_put((mask,), self.experts[e](h[mask]) * gates[mask, e : e + 1])
        return x + out


def build(dim: int, skew: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(dim, dim), MoE(dim), MoE(dim), nn.Linear(dim, dim))
    if skew:
        with torch.no_grad():
            for layer in (model[1], model[2]):
                layer.router.bias[:2] += 4.0
    return model


class ByteCounter:
    """Counts the bytes of this process's reduce-scatter inputs (patched into torch.distributed)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.original = getattr(dist, _RS)

    def __call__(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.bytes += input.numel() * input.element_size()
        return self.original(output, input, *args, **kwargs)


def _padded_bytes(module: nn.Module, world: int) -> int:
    """Bytes of ``module``'s parameters in a reduce-scatter input: dim 0 padded to a multiple of ``world``."""
    total = 0
    for p in module.parameters():
        rows = -(-p.shape[0] // world) * world
        total += rows * (p.numel() // p.shape[0]) * 4  # fp32 gradients
    return total


def _mark(used: torch.Tensor, layer: int, expert: int) -> Any:
    def hook(module: nn.Module, args: Any) -> None:
        used[layer, expert] = 1

    return hook


def run(variant: str, dim: int, tokens: int, skew: bool, steps: int) -> dict[str, float]:
    model = build(dim, skew)
    shard = torch_fully_shard if variant == "torch" else fsdp2.fully_shard
    for layer in (model[1], model[2]):
        shard(layer)
    shard(model)
    if variant in ("torch", "fsdp2 all"):
        model.set_reduce_scatter_unused_params(True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counter = ByteCounter()
    setattr(dist, _RS, counter)
    rank = dist.get_rank()
    idle = agreements = 0
    per_step: list[int] = []
    used_ratio: list[float] = []  # bytes sent / bytes of the parameters some rank used, per step
    world = dist.get_world_size()
    try:
        for step in range(steps):
            before = counter.bytes
            gen = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(tokens, dim, generator=gen)
            used = torch.zeros(2, EXPERTS)
            hooks = [
                expert.register_forward_pre_hook(_mark(used, i, e))
                for i, layer in enumerate((model[1], model[2]))
                for e, expert in enumerate(layer.experts)
            ]
            with fsdp2.testing.count_collectives() as counts:
                model(x).square().mean().backward()
            for hook in hooks:
                hook.remove()
            optim.step()
            optim.zero_grad()
            dist.all_reduce(used, dist.ReduceOp.MAX)
            idle += int((used == 0).sum())
            agreements += counts["all_reduce"] if variant == "fsdp2" else 0
            per_step.append(counter.bytes - before)
            # what the parameters some rank used need: every padded shard, less the idle experts'
            idle_bytes = sum(
                _padded_bytes(expert, world)
                for i, layer in enumerate((model[1], model[2]))
                for e, expert in enumerate(layer.experts)
                if not used[i, e]
            )
            used_ratio.append((counter.bytes - before) / (_padded_bytes(model, world) - idle_bytes))
    finally:
        setattr(dist, _RS, counter.original)
    return {
        "bytes_per_step": counter.bytes / steps,
        "bytes_per_step_after_first": sum(per_step[1:]) / max(1, steps - 1),
        "worst_step_over_used": max(used_ratio),
        "idle_experts_per_layer_step": idle / (2 * steps),
        "agreements_per_step": agreements / steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--steps", "--rounds", type=int, default=6, help="training steps per case")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2, 8, 32, 128])
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file (rank 0)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows = []
    for skew in (False, True):
        for tokens in args.tokens:
            figures = {v: run(v, args.dim, tokens, skew, args.steps) for v in ("torch", "fsdp2 all", "fsdp2")}
            rows.append({"routing": "skewed" if skew else "uniform", "tokens_per_rank": tokens, **figures})
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        print(f"world {world}, dim {args.dim}, {EXPERTS} experts top-1, 2 MoE layers, {platform.node()}")
        print(
            "routing  tokens/rank  idle/layer  torch MB  fsdp2-all MB  fsdp2 MB  fsdp2/torch  "
            "after step 1  agreements  worst step / used"
        )
        for row in rows:
            torch_b, all_b, ours = (row[v]["bytes_per_step"] / 2**20 for v in ("torch", "fsdp2 all", "fsdp2"))
            later = row["fsdp2"]["bytes_per_step_after_first"] / row["torch"]["bytes_per_step_after_first"]
            print(
                f"{row['routing']:8s} {row['tokens_per_rank']:11d} "
                f"{row['fsdp2']['idle_experts_per_layer_step']:10.2f} {torch_b:9.3f} {all_b:13.3f} "
                f"{ours:9.3f} {ours / torch_b:12.3f} {later:13.3f} "
                f"{row['fsdp2']['agreements_per_step']:11.2f} "
                f"{row['fsdp2']['worst_step_over_used']:18.3f}"
            )
        if args.json:
            Path(args.json).write_text(json.dumps({"world": world, "dim": args.dim, "rows": rows}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
