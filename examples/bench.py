"""Per-step CPU overhead of fsdp2 against torch's fully_shard, measured in one run.

What it measures: a stack of N tiny ``Linear + ReLU`` blocks (so compute is negligible and the FSDP
machinery shows), each block its own fully_shard group (the root ``Sequential`` has no parameters of
its own, so it adds no group). Each model runs ``warmup + steps`` steps of forward, backward and an SGD
step; the median step time of the unsharded model (plus an all-reduce of one flat gradient, so
communication latency is not counted as FSDP overhead) is subtracted and the rest divided by N:

    overhead per group per step = (t_sharded - t_plain) / N

The three models run one after another (unsharded, torch, fsdp2), not interleaved, so load changes on a
shared machine move the figures; SGD is cheap, so the optimizer's cost on DTensors is mostly left out.
With the default --world-size 1 (one gloo process) no collective leaves the process, so the difference
is the CPU cost of the FSDP machinery itself (hooks, copy-in/out, registration, reduce-scatter copies);
--world-size 2 adds gloo latency.

On a GPU machine the same script uses NCCL and also reports each implementation's peak memory.

Run it with:  python examples/bench.py            (spawns --world-size gloo processes itself)
or:           torchrun --standalone --nproc-per-node 2 examples/bench.py
Options: --blocks 32 --dim 64 --steps 30 --warmup 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def build(blocks: int, dim: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(blocks)])


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_steps(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, steps: int, warmup: int, sync_grads: bool
) -> float:
    """Median seconds per step (forward, backward, optional gradient all-reduce, optimizer)."""
    times = []
    for i in range(warmup + steps):
        _sync()
        dist.barrier()
        t0 = time.perf_counter()
        model(x).sum().backward()
        if sync_grads:
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            dist.all_reduce(flat)
        opt.step()
        opt.zero_grad()
        _sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, float]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fsdp2

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    x = torch.randn(8, args.dim, device=device)
    plain = build(args.blocks, args.dim).to(device)
    t_plain = time_steps(
        plain, torch.optim.SGD(plain.parameters(), lr=1e-3), x, args.steps, args.warmup, True
    )
    results = {"plain_ms": t_plain * 1e3}
    for name, shard in (("torch", torch_fully_shard), ("fsdp2", fsdp2.fully_shard)):
        model = build(args.blocks, args.dim)
        for block in model:
            shard(block)
        shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        if device is not None:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time_steps(model, opt, x, args.steps, args.warmup, False)
        results[f"{name}_ms"] = t * 1e3
        if device is not None:  # peak memory of the training steps (GPU only)
            results[f"{name}_peak_MiB"] = torch.cuda.max_memory_allocated() / 2**20
        results[f"{name}_overhead_us_per_group"] = (t - t_plain) / args.blocks * 1e6
    results["overhead_ratio_fsdp2_over_torch"] = (
        results["fsdp2_overhead_us_per_group"] / results["torch_overhead_us_per_group"]
    )
    return results


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    main_in_group(args)


def main_in_group(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    try:
        results = run(args)
        if dist.get_rank() == 0:
            for key, value in results.items():
                print(f"{key:36s} {value:10.3f}")
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--world-size",
        type=int,
        default=1,
        help="1 isolates CPU overhead (no collective latency); 2 adds gloo latency",
    )
    args = parser.parse_args()
    if "RANK" in os.environ:
        main_in_group(args)
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args.world_size, port, args), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
