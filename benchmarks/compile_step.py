"""Whole-model torch.compile against eager and per-block compile: step time and compile time.

The step-time model of ``scale.py`` (8 blocks of dim 126 + root, AdamW) in gloo processes (run it
under torchrun), whole steps with the optimizer, the slowest rank, for:

- ``fsdp2 eager`` and ``torch eager``: no compile;
- ``torch per-block``: torch's ``fully_shard`` with each block compiled (torch's documented pattern);
- ``fsdp2 per-block``: the same with fsdp2 (eager hooks, graph breaks at each block);
- ``fsdp2 whole``: ``torch.compile(model, fullgraph=True)``: fsdp2's collectives in the graph, one
  all-gather and one reduce-scatter per parameter as traced;
- ``fsdp2 whole bucketed``: the same with inductor's bucketing passes on (``BUCKETING``), one
  bucket for all adjacent collectives;
- ``fsdp2 whole block buckets``: the passes with a bucket cap of one block's parameter bytes (the
  grouping eager fsdp2 has), ``... reordered`` with inductor's compute/communication reordering,
  and ``... kept`` with ``reshard_after_forward=False`` (no all-gathers again in backward);
- ``fsdp2 whole kept``: ``reshard_after_forward=False`` without the bucketing passes (not in the
  default run; for one GPU, where the passes have nothing to group).

The compile time is the first step's time (tracing and code generation, inductor on the CPU); the
step time is the median of the timed steps after two warm-up steps. The peak is the most memory a
step allocates above what it starts with (parameters, optimizer state: the same in every variant),
on the largest rank: one more step under torch's profiler, whose allocation events
(the CPU allocator's, compiled code included) are summed in time order.

On a machine with CUDA the ranks are GPUs and the backend NCCL (one GPU per process); the step
is timed between ``torch.cuda.synchronize`` calls and the peak is ``torch.cuda.max_memory_allocated``
above the step's start. ``--variants`` picks some of the variants (the bucketing passes group
nothing at one rank).

Run:  torchrun --standalone --nproc-per-node 2 benchmarks/compile_step.py [--steps 10]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from scale import add_model_arguments, build  # the step-time model
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from fsdp2.compile._compiled import torch_too_old  # (the version the compiled path needs)

VARIANTS = (
    "fsdp2 eager",
    "torch eager",
    "torch per-block",
    "fsdp2 per-block",
    "fsdp2 whole",
    "fsdp2 whole bucketed",
    "fsdp2 whole block buckets",
    "fsdp2 whole block buckets reordered",
    "fsdp2 whole block buckets kept",
    "fsdp2 whole kept",
)
# Inductor's passes that group the collectives of a graph (torch 2.13's names), for "bucketed": all
# adjacent collectives in one bucket (the passes' default cap is 2000 MB)
BUCKETING = {"bucket_all_gathers_fx": "all", "bucket_reduce_scatters_fx": "all"}


def _cap_mb(cap: float, bucket: int) -> float:
    """The bucket cap the passes ask for per bucket index: the same for all."""
    return cap


def _pass_options(variant: str, block_mb: float) -> dict[str, Any]:
    """Inductor's settings for ``variant``: bucketing, capped at one block's size, and reordering."""
    options: dict[str, Any] = {"force_disable_caches": True}  # compile times from scratch
    if "bucket" in variant:
        options.update(BUCKETING)
    if "block buckets" in variant:
        cap = functools.partial(_cap_mb, block_mb)  # (picklable: inductor's cache key holds it)
        options["bucket_all_gathers_fx_bucket_size_determinator"] = cap
        options["bucket_reduce_scatters_fx_bucket_size_determinator"] = cap
    if variant.endswith("reordered"):
        options["reorder_for_compute_comm_overlap"] = True
    return options


def _prepare(variant: str, blocks: int, dim: int) -> tuple[Any, torch.optim.Optimizer, float]:
    """The model to step (compiled as ``variant`` says), its optimizer, and one block's MB."""
    model, optim = build("torch" if variant.startswith("torch") else "fsdp2", blocks, dim)
    # (on CUDA, fully_shard moves the CPU-built parameters to the default mesh's GPU)
    block_mb = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters()) / 2**20
    if variant.endswith("per-block"):
        for block in model.blocks:
            block.compile()
    if variant.endswith("kept"):
        model.set_reshard_after_forward(False)  # no re-gathering in backward
    if variant.startswith("fsdp2 whole"):
        return torch.compile(model, fullgraph=True), optim, block_mb
    return model, optim, block_mb


def _step(model: Any, optim: torch.optim.Optimizer, x: torch.Tensor) -> float:
    dist.barrier()
    _sync(x)
    start = time.perf_counter()
    model(x).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()
    _sync(x)
    elapsed = torch.tensor([time.perf_counter() - start], device=x.device)
    dist.all_reduce(elapsed, dist.ReduceOp.MAX)
    return float(elapsed)


def _sync(x: torch.Tensor) -> None:
    if x.is_cuda:
        torch.cuda.synchronize()


def _peak_step_mb_cuda(model: Any, optim: torch.optim.Optimizer, x: torch.Tensor) -> float:
    """The most GPU memory one step allocates above its start, in MB (the largest rank's)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    _step(model, optim, x)
    largest = torch.tensor([(torch.cuda.max_memory_allocated() - start) / 1e6], device=x.device)
    dist.all_reduce(largest, dist.ReduceOp.MAX)
    return float(largest)


def _peak_step_mb(model: Any, optim: torch.optim.Optimizer, x: torch.Tensor) -> float:
    """The most memory one step allocates above its start, in MB (the largest rank's); on CUDA, see
    ``_peak_step_mb_cuda``.

    Blocks are tracked by address: the profiler misses some frees (a tensor whose last reference
    dies on gloo's threads), so an address allocated again counts as freed first.
    """
    if x.is_cuda:
        return _peak_step_mb_cuda(model, optim, x)
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(model, optim, x)
    events = []
    nodes = list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            events.append((node.start_time_ns, fields.alloc_size, fields.ptr))  # frees < 0
        nodes.extend(node.children)
    alive: dict[int, int] = {}
    live = peak = 0
    for _, size, address in sorted(events):
        live -= alive.pop(address, 0)  # a free, or an allocation at an address freed unseen
        if size > 0:
            alive[address] = size
            live += size
        peak = max(peak, live)
    largest = torch.tensor([peak / 1e6])
    dist.all_reduce(largest, dist.ReduceOp.MAX)
    return float(largest)


def main() -> None:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser, [2])  # the model's shape (the world is torchrun's)
    parser.add_argument("--steps", "--rounds", type=int, default=10)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS[:-1]), metavar="VARIANT"
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(args.batch, args.seq, args.dim, generator=gen).to(device)
    rows = {}
    skipped = []
    for variant in args.variants:
        if variant.startswith("fsdp2 whole") and torch_too_old(torch.__version__):
            skipped.append(variant)  # fullgraph=True would fail with fsdp2's message naming the version
            continue
        torch._dynamo.reset()  # noqa: SLF001 - a fresh compile per variant
        model, optim, block_mb = _prepare(variant, args.blocks, args.dim)
        options = _pass_options(variant, block_mb)
        with torch._inductor.config.patch(options):  # noqa: SLF001 - inductor's pass switches
            first = _step(model, optim, x)
            _step(model, optim, x)
            times = [_step(model, optim, x) for _ in range(args.steps)]
            peak = statistics.median(_peak_step_mb(model, optim, x) for _ in range(3))
        rows[variant] = {"first_step_s": first, "step_ms": 1e3 * statistics.median(times), "peak_mb": peak}
    if dist.get_rank() == 0:
        base = rows[args.variants[0]]["step_ms"]
        where = torch.cuda.get_device_name(device) if cuda else platform.machine()
        shape = f"{args.blocks} blocks of dim {args.dim}, batch {args.batch}x{args.seq}"
        print(f"world {dist.get_world_size()}, {shape}, {where}, torch {torch.__version__}")
        print(f"{'variant':36s} first step s   step ms   / {args.variants[0]}   peak MB")
        for variant, row in rows.items():
            ratio = row["step_ms"] / base
            print(
                f"{variant:36s} {row['first_step_s']:12.2f} {row['step_ms']:9.1f} {ratio:14.2f}"
                f" {row['peak_mb']:9.2f}"
            )
        if skipped:
            print(f"skipped (whole-model compile needs a newer torch than {torch.__version__}): {skipped}")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
