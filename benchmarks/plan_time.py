"""Does ``fsdp2.plan(objective="time")`` pick the fastest wrapping that fits? Checked against a grid.

A model of ``--blocks`` blocks (LayerNorm + MLP of width 4 x ``--dim``), batch 8 x 64 tokens, AdamW.
Every rank builds a grid of hand settings (one group per block, pairs, one group of all blocks, root
only; resharding after forward or not; no bucket cap or 25 MiB), measures each one's peak of new
tensors in a step (fsdp2's storage tracker, real tensors) and its step time (median over interleaved
rounds, the slowest rank's). Then for budgets of 1.0x, 1.3x and 1.7x the default's measured peak
(one group per block, resharding), ``plan`` is called inside the job; its plan is applied, measured
in the same interleaved rounds, and compared with the fastest hand setting whose measured peak fits.

Run:  torchrun --standalone --nproc-per-node 2 benchmarks/plan_time.py [--blocks 8 --dim 256]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2.plan._cost import Setting
from fsdp2.plan._memory import MemoryTracker, process_hooks, run_tracked
from fsdp2.plan._plan import apply_setting


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, blocks: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _grid(blocks: int) -> dict[str, Setting]:
    names = [f"layers.{i}" for i in range(blocks)]
    grid: dict[str, Setting] = {"root only": Setting((), ())}
    for k, label in ((1, "per block"), (2, "pairs"), (blocks, "one group")):
        groups = tuple(tuple(names[i : i + k]) for i in range(0, blocks, k))
        for raf in (True, False):
            for cap in (None, 25.0) if len(groups) > 1 else (None,):
                name = f"{label}, {'reshard' if raf else 'keep'}{', 25 MiB buckets' if cap else ''}"
                grid[name] = Setting(groups, (raf,) * len(groups), cap)
    return grid


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per setting and round")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(8, 64, args.dim, generator=torch.Generator().manual_seed(rank))

    def build() -> nn.Module:
        torch.manual_seed(0)
        return Net(args.blocks, args.dim)

    def step(built: tuple[nn.Module, torch.optim.Optimizer]) -> None:
        model, optim = built
        model(x).square().mean().backward()
        optim.step()
        optim.zero_grad()

    def prepared(setting: Setting) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = build()
        apply_setting(model, setting, {"mesh": mesh})
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    def peak(setting: Setting) -> int:
        tracker = MemoryTracker()
        with process_hooks():
            run_tracked(tracker, lambda: prepared(setting), step, 2)
        value = torch.tensor([tracker.report(world, rank).step_peak_bytes], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value.item())

    settings = _grid(args.blocks)
    peaks = {name: peak(s) for name, s in settings.items()}
    default_peak = peaks["per block, reshard"]  # the planner's estimate of it is the same, to the byte
    plans: dict[str, Any] = {}
    for factor in (1.0, 1.3, 1.7):
        budget = int(factor * default_peak)
        start = time.perf_counter()
        chosen = fsdp2.plan(build, step, world_size=world, budget_bytes=budget, optimizer=_adamw)
        took = time.perf_counter() - start
        name = f"plan {factor}x"
        settings[name] = chosen.setting
        peaks[name] = peak(chosen.setting)
        plans[name] = {"budget": budget, "plan": chosen, "seconds": took}
    # time every setting in interleaved rounds (drift on a shared machine hits all alike)
    built = {name: prepared(s) for name, s in settings.items()}
    for b in built.values():
        step(b)
        step(b)
    times: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(args.rounds):
        for name, b in built.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step(b)
            times[name].append((time.perf_counter() - start) / args.steps)
    medians = {}
    for name, values in times.items():
        value = torch.tensor([statistics.median(values)], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        medians[name] = float(value.item())
    if rank == 0:
        _report(args, world, settings, peaks, medians, plans, default_peak)
    dist.destroy_process_group()


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def _report(
    args: Any,
    world: int,
    settings: dict[str, Setting],
    peaks: dict[str, int],
    medians: dict[str, float],
    plans: dict[str, Any],
    default_peak: int,
) -> None:
    base = medians["per block, reshard"]
    print(f"world {world} gloo, {args.blocks} blocks, dim {args.dim}, batch 8 x 64, AdamW, {platform.node()}")
    print(f"{'setting':<40} {'step ms':>8} {'/ default':>9} {'peak MiB':>9}")
    for name in settings:
        if not name.startswith("plan"):
            ms, mib = medians[name] * 1e3, peaks[name] / 2**20
            print(f"{name:<40} {ms:8.2f} {medians[name] / base:9.3f} {mib:9.2f}")
    rows = []
    for name, info in plans.items():
        budget, chosen = info["budget"], info["plan"]
        fitting = [n for n in settings if not n.startswith("plan") and peaks[n] <= budget]
        best = min(fitting, key=medians.__getitem__)
        measured = medians[name]
        predicted = chosen.predicted_step_s
        rows.append(
            {
                "budget_x": budget / default_peak,
                "plan": chosen.setting.describe(),
                "plan_ms": measured * 1e3,
                "best_hand": best,
                "best_hand_ms": medians[best] * 1e3,
                "plan_over_best": measured / medians[best],
                "peak_mib": peaks[name] / 2**20,
                "budget_mib": budget / 2**20,
                "fits": peaks[name] <= budget,
                "predicted_ms": predicted * 1e3,
                "predicted_over_measured": predicted / measured,
                "plan_seconds": info["seconds"],
            }
        )
    print()
    print(
        f"{'budget':>6} {'plan':<58} {'ms':>7} {'best hand':<34} {'ms':>7} {'ratio':>6} "
        f"{'peak/budget MiB':>16} {'pred/meas':>9} {'plan s':>6}"
    )
    for row in rows:
        print(
            f"{row['budget_x']:5.1f}x {row['plan']:<58} {row['plan_ms']:7.2f} {row['best_hand']:<34} "
            f"{row['best_hand_ms']:7.2f} {row['plan_over_best']:6.3f} "
            f"{row['peak_mib']:7.2f}/{row['budget_mib']:<8.2f} {row['predicted_over_measured']:9.3f} "
            f"{row['plan_seconds']:6.1f}"
        )
    for name, info in plans.items():
        print(f"\n{name}:\n{info['plan'].explain()}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
