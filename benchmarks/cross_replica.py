"""HSDP 2 x 2 with and without the optimizer sharded across replicas (``python benchmarks/cross_replica.py``).

Four thread ranks on a (replicate=2, shard=2) CPU mesh, a stack of ``LAYERS`` square linears of
``DIM`` (one ``fully_shard`` group each), AdamW. Per rank: the optimizer state's bytes, the measured
peak of a training step (``fsdp2.testing.measure_memory``: live tensor storages by phase), the bytes
sent across the replicate dim per step (``fsdp2.testing.record_collectives``: HSDP's all-reduce,
against the reduce-scatter across replicas plus the parameters' all-gather after the step), and the
median wall time of a step (forward, backward, step; the threads share this machine's cores, so the
times say more about the extra copies than about a network).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fsdp2
from fsdp2.testing import measure_memory, record_collectives, run_ranks

DIM = 512
LAYERS = 4
BATCH = 16
STEPS = 12


def _build(across: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(DIM, DIM) for _ in range(LAYERS)))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for layer in model:
        fsdp2.fully_shard(layer, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if across:
        fsdp2.shard_optimizer_across_replicas(model, optim)
    return model, optim


def _step(built: tuple[nn.Module, torch.optim.Optimizer]) -> None:
    model, optim = built
    x = torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad()


def _state_bytes(optim: torch.optim.Optimizer) -> int:
    total = 0
    for values in optim.state.values():
        for value in values.values():
            local = value.to_local() if isinstance(value, DTensor) else value
            if isinstance(local, torch.Tensor) and local.ndim > 0:
                total += local.numel() * local.element_size()
    return total


def _run(rank: int, world: int, across: bool) -> dict[str, Any]:
    built = _build(across)
    model, optim = built
    _step(built)  # state created
    with record_collectives(model) as log:
        _step(built)
    times = []
    for _ in range(STEPS):
        dist.barrier()
        start = time.perf_counter()
        _step(built)
        times.append(time.perf_counter() - start)
    return {
        "state": _state_bytes(optim),
        "sent": log.sent_bytes(),
        "all_reduce": log.sent_bytes("all_reduce"),
        "calls": dict(log),
        "time": statistics.median(times),
    }


def main() -> None:
    rows = {}
    for across in (False, True):
        results = run_ranks(4, _run, across)
        peaks = [r.step_peak_bytes for r in measure_memory(4, lambda a=across: _build(a), _step, steps=2)]
        rows[across] = (results[0], max(peaks))
    plain, across = rows[False][0], rows[True][0]
    shard_only = plain["sent"] - plain["all_reduce"]  # the forward's and backward's shard-dim collectives
    print(f"HSDP 2 x 2, {LAYERS} x Linear({DIM}, {DIM}), AdamW, 4 thread ranks (rank 0)")
    print("| | plain HSDP | optimizer across replicas |")
    print("| --- | ---: | ---: |")
    print(f"| optimizer state per rank | {plain['state']:,} B | {across['state']:,} B |")
    print(f"| peak memory of a step (measured) | {rows[False][1]:,} B | {rows[True][1]:,} B |")
    print(
        f"| bytes sent across the replicate dim per step | {plain['all_reduce']:,} B | "
        f"{across['sent'] - shard_only:,} B |"
    )
    print(f"| all FSDP bytes sent per step | {plain['sent']:,} B | {across['sent']:,} B |")
    print(f"| collectives per step | {plain['calls']} | {across['calls']} |")
    print(f"| step time (median of {STEPS}) | {plain['time'] * 1e3:.2f} ms | {across['time'] * 1e3:.2f} ms |")


if __name__ == "__main__":
    main()
