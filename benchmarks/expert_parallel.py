"""Expert parallelism: bytes, peak memory and step time per MoE step, ``shard_experts`` against the rest.

torchtitan 0.3.0's qwen3 MoE (2 MoE layers, ``--experts`` experts of top-2 routing, width ``--dim``,
expert hidden ``--hidden``), on 4 gloo processes, AdamW, whole steps. Variants, in one run:

- ``torch whole stacks``: torch's ``fully_shard`` on each block and the root; every rank all-gathers
  every expert of every layer (no expert parallelism);
- ``fsdp2 whole stacks``: the same with fsdp2's ``fully_shard``;
- ``fsdp2 ep 2``: ``fsdp2.shard_experts(model, ep=2)``, then ``fully_shard`` on each block and the root;
- ``torch titan ep 2``: torchtitan's own ``parallelize_qwen3`` with ``expert_parallel_degree=2`` on torch's
  ``fully_shard`` (its ``ExpertParallel`` and all-to-all dispatcher, hand-wired meshes, division off).

Per step (the median of ``--steps`` after one warm-up): the bytes each rank's collectives send, by kind
(all-gather: the bytes gathered; reduce-scatter, all-to-all, all-reduce: the bytes sent; counted on
torch's c10d ops), the peak of live
tensor bytes (fsdp2's storage tracker, the same for every variant) and the step time. ``--simulate``:
host time and memory of one rank of 64 (torch's fake process group) with 160 experts at ep 8 (20
local experts over 8 efsdp ranks, [3, 3, 3, 3, 3, 3, 2, 0] rows: rank 63 holds none).

Run:  torchrun --standalone --nproc-per-node 4 benchmarks/expert_parallel.py [--dim 256 --hidden 512]
      python benchmarks/expert_parallel.py --simulate
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _collective_bytes import CollectiveBytes


def _titan(args: argparse.Namespace, ep: bool) -> torch.nn.Module:
    import torchtitan.models.qwen3 as qwen3

    from tests.shared.titan_cpu import tiny_qwen3_moe

    return tiny_qwen3_moe(qwen3, ep, dim=args.dim, experts=args.experts, moe_hidden=args.hidden, seq=args.seq)


def _build(variant: str, args: argparse.Namespace) -> torch.nn.Module:
    import fsdp2

    world = dist.get_world_size()
    if variant == "torch titan ep 2":
        return _titan_parallelized(args)
    model = _titan(args, ep=False)
    if variant.startswith("torch"):
        from torch.distributed.fsdp import fully_shard as shard
    else:
        shard = fsdp2.fully_shard  # type: ignore[assignment]
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    if variant == "fsdp2 ep 2":
        fsdp2.shard_experts(model, ep=2, mesh=mesh)
    for layer in model.layers.values():  # type: ignore[operator]
        shard(layer, mesh=mesh)
    shard(model, mesh=mesh)
    return model


def _titan_parallelized(args: argparse.Namespace) -> torch.nn.Module:
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    import torchtitan.models.qwen3 as qwen3
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import utils as dist_utils

    parallel_dims_module.device_type = "cpu"
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", expert_parallel_degree=2)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    dims = parallel_dims_module.ParallelDims.from_config(parallelism, dist.get_world_size())
    dims.build_mesh()
    model = qwen3.parallelize_qwen3(
        _titan(args, ep=True),
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder=tempfile.mkdtemp(),
    )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer, args: argparse.Namespace, step: int) -> None:
    gen = torch.Generator().manual_seed(10 * step + dist.get_rank())
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen)
    positions = torch.arange(args.seq).repeat(args.batch, 1)
    logits = model(tokens[:, :-1], positions=positions)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    optim.step()
    optim.zero_grad()


def _measure(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    from fsdp2.plan import MemoryTracker, run_tracked

    model = _build(variant, args)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _step(model, optim, args, 0)
    counter = CollectiveBytes()
    with counter:
        _step(model, optim, args, 1)
    times = []
    for step in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        _step(model, optim, args, 2 + step)
        times.append(time.perf_counter() - start)
    tracker = MemoryTracker()
    built: dict[str, Any] = {}

    def build() -> torch.nn.Module:
        built["model"] = _build(variant, args)
        built["optim"] = torch.optim.AdamW(built["model"].parameters(), lr=1e-4)
        return built["model"]

    run_tracked(tracker, build, lambda m: _step(m, built["optim"], args, 0), 2)
    peak = tracker.report(dist.get_world_size(), dist.get_rank()).peak_bytes
    return {"bytes": dict(counter.bytes), "step_ms": 1e3 * statistics.median(times), "peak_bytes": peak}


VARIANTS = ("torch whole stacks", "fsdp2 whole stacks", "fsdp2 ep 2", "torch titan ep 2")


def _run(args: argparse.Namespace) -> None:
    from tests.shared.titan_cpu import stand_in_for_triton_kernels

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    stand_in_for_triton_kernels()
    results = {variant: _measure(variant, args) for variant in VARIANTS}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        _print(gathered, args)
    dist.destroy_process_group()


def _print(per_rank: list[dict[str, Any]], args: argparse.Namespace) -> None:
    kinds = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")
    print(f"# qwen3 MoE: {args.experts} experts, dim {args.dim}, hidden {args.hidden}, 4 gloo ranks (means)")
    print("| variant | " + " | ".join(f"{k} KiB/step" for k in kinds) + " | peak MiB | step ms |")
    print("|---|" + "---|" * (len(kinds) + 2))
    for variant in VARIANTS:
        rows = [r[variant] for r in per_rank]
        cells = [statistics.mean(r["bytes"].get(k, 0) for r in rows) / 1024 for k in kinds]
        peak = statistics.mean(r["peak_bytes"] for r in rows) / 2**20
        step = statistics.mean(r["step_ms"] for r in rows)
        print(f"| {variant} | " + " | ".join(f"{c:,.0f}" for c in cells) + f" | {peak:.2f} | {step:.1f} |")
    print(json.dumps({"args": vars(args), "ranks": per_rank}))


def _simulate(args: argparse.Namespace) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fsdp2
    from tests.shared.experts_models import DIM, Net

    world, ep, experts = 64, 8, 160
    for rank in (1, 63):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        model = Net(experts, top_k=2, counted=False, layers=2)
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        start = time.perf_counter()
        fsdp2.shard_experts(model, ep=ep, mesh=mesh)
        for layer in model.layers:
            fsdp2.fully_shard(layer, mesh=mesh)
        fsdp2.fully_shard(model, mesh=mesh)
        setup = time.perf_counter() - start
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            model(torch.randn(64, DIM)).pow(2).mean().backward()
            optim.step()
            optim.zero_grad()
            times.append(time.perf_counter() - start)
        rows = model.layers[0].experts.down_proj.to_local().shape[0]
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(
            f"rank {rank} of {world}, {experts} experts, ep {ep}: local rows {rows}, "
            f"setup {1e3 * setup:.1f} ms, step {1e3 * min(times[1:]):.1f} ms, peak RSS {rss:.0f} MiB"
        )
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--simulate", action="store_true")
    args = parser.parse_args()
    _simulate(args) if args.simulate else _run(args)


if __name__ == "__main__":
    main()
