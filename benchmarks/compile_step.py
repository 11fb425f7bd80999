"""Whole-model torch.compile against eager and per-block compile: step time and compile time.

The step-time model of ``scale.py`` (8 blocks of dim 126 + root, AdamW) in gloo processes (run it
under torchrun), whole steps with the optimizer, the slowest rank, for:

- ``fsdp2 eager`` and ``torch eager``: no compile;
- ``torch per-block``: torch's ``fully_shard`` with each block compiled (torch's documented pattern);
- ``fsdp2 per-block``: the same with fsdp2 (eager hooks, graph breaks at each block);
- ``fsdp2 whole``: ``torch.compile(model, fullgraph=True)``: fsdp2's collectives in the graph, one
  all-gather and one reduce-scatter per parameter as traced;
- ``fsdp2 whole bucketed``: the same with inductor's bucketing passes on (``BUCKETING``).

The compile time is the first step's time (tracing and code generation, inductor on the CPU); the
step time is the median of the timed steps after two warm-up steps. Peak memory is not reported: on
the CPU it has no allocator counter for a process, and the resident set size is dominated by the
compiler.

Run:  torchrun --standalone --nproc-per-node 2 benchmarks/compile_step.py [--steps 10]
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
from scale import add_model_arguments, build  # the step-time model

VARIANTS = (
    "fsdp2 eager",
    "torch eager",
    "torch per-block",
    "fsdp2 per-block",
    "fsdp2 whole",
    "fsdp2 whole bucketed",
)
# Inductor's passes that group the collectives of a graph (torch 2.13's names), for "bucketed"
BUCKETING = {"bucket_all_gathers_fx": "all", "bucket_reduce_scatters_fx": "all"}


def _prepare(variant: str, blocks: int, dim: int) -> tuple[Any, torch.optim.Optimizer]:
    model, optim = build("torch" if variant.startswith("torch") else "fsdp2", blocks, dim)
    if variant.endswith("per-block"):
        for block in model.blocks:
            block.compile()
    if variant.startswith("fsdp2 whole"):
        return torch.compile(model, fullgraph=True), optim
    return model, optim


def _step(model: Any, optim: torch.optim.Optimizer, x: torch.Tensor) -> float:
    dist.barrier()
    start = time.perf_counter()
    model(x).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, dist.ReduceOp.MAX)
    return float(elapsed)


def main() -> None:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser, [2])  # the model's shape (the world is torchrun's)
    parser.add_argument("--steps", "--rounds", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    x = torch.randn(args.batch, args.seq, args.dim, generator=torch.Generator().manual_seed(dist.get_rank()))
    rows = {}
    for variant in VARIANTS:
        torch._dynamo.reset()  # noqa: SLF001 - a fresh compile per variant
        model, optim = _prepare(variant, args.blocks, args.dim)
        options = BUCKETING if variant.endswith("bucketed") else {}
        with torch._inductor.config.patch(options):  # noqa: SLF001 - inductor's pass switches
            first = _step(model, optim, x)
            _step(model, optim, x)
            times = [_step(model, optim, x) for _ in range(args.steps)]
        rows[variant] = {"first_step_s": first, "step_ms": 1e3 * statistics.median(times)}
    if dist.get_rank() == 0:
        base = rows["fsdp2 eager"]["step_ms"]
        print(f"world {dist.get_world_size()}, {args.blocks} blocks of dim {args.dim}, {platform.machine()}")
        print("variant               first step s   step ms   / fsdp2 eager")
        for variant, row in rows.items():
            ratio = row["step_ms"] / base
            print(f"{variant:21s} {row['first_step_s']:12.2f} {row['step_ms']:9.1f} {ratio:14.2f}")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
