"""Collectives per step and step time of a model of many tiny groups: bucketed vs not vs torch's.

A stack of ``--layers`` ``Linear(dim, dim) + ReLU`` blocks, each its own ``fully_shard`` group, plus
the root's input and output layers, ``reshard_after_forward=True``, trained with SGD on gloo
processes. The models: torch's ``fully_shard``, fsdp2 without bucketing, and fsdp2 with
``set_bucket_cap_mb(cap, cap)`` for each ``--cap`` (a number of MiB, or ``auto``: caps chosen from a
measurement of the process group, whose fit and time are printed). The targets of the automatic caps
are checked against the figures: at least 4x fewer collectives per step than torch, and a step within
5% of the best fixed cap's. Each model runs ``--rounds`` x ``--steps`` timed steps (forward +
backward, then the optimizer step, timed apart), the models taking turns step by step in a new
random order each time.
Collectives are counted in one extra step per model (``fsdp2.testing.count_collectives``, which is
torch's ``CommDebugMode`` on gloo), outside the timed ones. Reported on rank 0: collectives per step
and the median step times.

Run:  torchrun --nproc-per-node 4 benchmarks/bucketing.py [--layers 64 --dim 32 --cap 25 1 0.05 auto]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import random
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fsdp2
from fsdp2.testing import count_collectives


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class Model(nn.Module):
    def __init__(self, layers: int, dim: int) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _shard(model: Model, impl: Any) -> Model:
    for block in model.blocks:
        impl(block, reshard_after_forward=True)
    impl(model, reshard_after_forward=True)
    return model


def _step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor) -> tuple[float, float]:
    start = time.perf_counter()
    model(x).sum().backward()
    middle = time.perf_counter()
    optim.step()
    optim.zero_grad()
    return middle - start, time.perf_counter() - middle


def _describe(caps: fsdp2.BucketCaps, seconds: float) -> dict[str, Any]:
    """The automatic caps, their fits and the measurement's time, for the report."""
    out: dict[str, Any] = {"measure_s": seconds}
    for kind in ("all_gather", "reduce_scatter"):
        fit = getattr(caps, f"{kind}_fit")
        out[kind] = {
            "cap_mb": getattr(caps, f"{kind}_mb"),
            "latency_us": None if fit is None else fit.latency_s * 1e6,
            "gb_per_s": None if fit is None else fit.bytes_per_second / 1e9,
        }
    return out


def _targets(rows: dict[str, dict[str, float]]) -> dict[str, float]:
    """The automatic caps against their targets: collectives vs torch, step time vs the best fixed cap."""
    auto = rows["fsdp2 bucketed auto"]
    fixed = [row for name, row in rows.items() if name.startswith("fsdp2 bucketed") and "auto" not in name]
    torch_row = rows["torch"]
    collectives = lambda row: row["all_gather"] + row["reduce_scatter"]  # noqa: E731
    result = {"fewer_collectives_than_torch": collectives(torch_row) / max(collectives(auto), 1)}
    if fixed:
        result["step_over_best_fixed"] = auto["step_ms"] / min(row["step_ms"] for row in fixed)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--cap", nargs="+", default=["25", "1", "0.05", "auto"], help="MiB, or auto")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file (rank 0)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)  # view-output warnings of both libraries
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    base = Model(args.layers, args.dim)
    models: dict[str, nn.Module] = {
        "torch": _shard(copy.deepcopy(base), torch_fully_shard),
        "fsdp2": _shard(copy.deepcopy(base), fsdp2.fully_shard),
    }
    auto: dict[str, Any] = {}
    for cap in args.cap:
        bucketed = _shard(copy.deepcopy(base), fsdp2.fully_shard)
        assert isinstance(bucketed, fsdp2.FSDPModule)
        if cap == "auto":
            start = time.perf_counter()
            chosen = bucketed.set_bucket_cap_mb("auto")
            auto = _describe(chosen, time.perf_counter() - start)
            models["fsdp2 bucketed auto"] = bucketed
        else:
            bucketed.set_bucket_cap_mb(float(cap), float(cap))
            models[f"fsdp2 bucketed {float(cap):g} MiB"] = bucketed
    optims = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(8, args.dim, generator=gen)
    counts: dict[str, dict[str, int]] = {}
    for name, model in models.items():
        _step(model, optims[name], x)  # warm-up; records the order bucketing needs
        with count_collectives() as counter:
            _step(model, optims[name], x)
        counts[name] = dict(counter)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
    names = list(models)
    rng = random.Random(0)  # the same orders on every rank
    # The models take turns step by step, in a new order each time: load that comes and goes on a
    # shared machine falls on all of them alike, and none always follows the same model. Medians over
    # every step: a step that pays for its neighbour's after-effects moves no figure.
    for _ in range(args.rounds * args.steps):
        for name in rng.sample(names, len(names)):
            dist.barrier()
            times[name].append(_step(models[name], optims[name], x))
    if rank == 0:
        world = dist.get_world_size()
        print(
            f"{args.layers} layers of dim {args.dim} + root, world {world} (gloo processes), "
            f"{args.rounds} rounds x {args.steps} steps, {platform.machine()}, torch {torch.__version__}"
        )
        print("| model | all-gathers / step | reduce-scatters / step | fwd+bwd (ms) | optimizer (ms) |")
        print("| --- | --- | --- | --- | --- |")
        for name in models:
            fb = statistics.median(t[0] for t in times[name]) * 1e3
            opt = statistics.median(t[1] for t in times[name]) * 1e3
            gathers, scatters = counts[name].get("all_gather", 0), counts[name].get("reduce_scatter", 0)
            print(f"| {name} | {gathers} | {scatters} | {fb:.1f} | {opt:.1f} |")
        rows = {
            name: {
                "all_gather": counts[name].get("all_gather", 0),
                "reduce_scatter": counts[name].get("reduce_scatter", 0),
                "step_ms": statistics.median(t[0] + t[1] for t in times[name]) * 1e3,
            }
            for name in models
        }
        if auto:
            auto["targets"] = _targets(rows)
            print(f"auto: {json.dumps(auto)}")
        if args.json:
            config = {"layers": args.layers, "dim": args.dim, "caps": args.cap, "rounds": args.rounds}
            result = {"world_size": world, "config": config, "models": rows, "auto": auto}
            Path(args.json).write_text(json.dumps(result, indent=2))
    dist.barrier()
    # Free the models (they hold the process group) so destroying it joins gloo's threads now, not
    # during interpreter shutdown (see scale.rank_main).
    models.clear()
    optims.clear()
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
