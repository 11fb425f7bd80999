"""Step time at world 2 and 4 (gloo processes) and bytes communicated against the minimum.

Every rank builds four copies of one model, trained with AdamW on its own batch: unsharded with
``DistributedDataParallel`` (the data-parallel baseline), torch's ``fully_shard``, fsdp2, and fsdp2
with ``fsdp2.local_step``. Round by round each model runs a few whole training steps (forward,
backward, optimizer; a barrier before and after), timed on every rank; the step time of a model is
the slowest rank's. The ratio fsdp2 / torch is taken per round; its median and 5th-95th
percentiles over the rounds are reported.

Bytes: during one extra step of each sharded model, rank 0 records every collective's buffer (the
all-gather output, the reduce-scatter input), which is what the ring algorithms move
((W-1)/W of it in and out of each rank). The minimum is what the same schedule needs without
padding: every group's parameters gathered in forward, the blocks' again in backward (they reshard
after forward; the root keeps its own), every group's gradients reduced once.

Run:  python benchmarks/scale.py [--worlds 2 4 --rounds 6 --steps 3]
Writes benchmarks/results/scale.json and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import socket
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from step_overhead import Model, _median_and_band  # the world-1 benchmark's blocks and summary
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp2

KINDS = ("ddp", "torch", "fsdp2", "fsdp2-local", "fsdp2-debug")


def build(kind: str, blocks: int, dim: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model: nn.Module = Model(blocks, dim)
    if kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif kind == "torch":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block)
        fully_shard(model)
    else:
        for block in model.blocks:  # type: ignore[union-attr]
            fsdp2.fully_shard(block)
        fsdp2.fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if kind == "fsdp2-local":
        optim = fsdp2.local_step(optim)
    return model, optim


def train(
    model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor, steps: int, debug: bool = False
) -> float:
    """Seconds per step on this rank, between barriers; ``debug``: with fsdp2's debug mode on."""
    fsdp2.set_debug(debug)  # the divergence guard: installed at the first forward, checked per collective
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        model(x).pow(2).mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    dist.barrier()
    fsdp2.set_debug(False)
    return (time.perf_counter() - start) / steps


class _CollectiveBytes(TorchDispatchMode):
    """Sums the buffer bytes of the collectives issued inside it, by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__.split(".")[0]
        if func.namespace == "c10d":
            if "allgather" in name:
                self.bytes["all_gather"] += _nbytes(args[0])  # the output(s)
            elif "reduce_scatter" in name:
                self.bytes["reduce_scatter"] += _nbytes(args[1])  # the input(s)
            elif "allreduce" in name:
                self.bytes["all_reduce"] += _nbytes(args[0])
        return func(*args, **(kwargs or {}))


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def minimum_bytes(blocks: int, dim: int) -> dict[str, int]:
    model = Model(blocks, dim)
    total = sum(p.numel() * 4 for p in model.parameters())
    block_bytes = sum(p.numel() * 4 for p in model.blocks.parameters())
    return {"all_gather": total + block_bytes, "reduce_scatter": total, "all_reduce": 0}


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings(
        "ignore", message=r"(?s).*(view tensor|is a view)"
    )  # both FSDPs warn on 3-D Linear outputs
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        _measure(rank, world, args, out)
    finally:
        # The models and their meshes hold the process group: free them (cycles included), so that
        # destroying it joins gloo's worker threads now. Otherwise a worker may still be releasing
        # the last collective's tensors during interpreter shutdown, which aborts the process
        # ("terminate called without an active exception").
        gc.collect()
        dist.destroy_process_group()


def _measure(rank: int, world: int, args: argparse.Namespace, out: Any) -> None:
    """Every model's step times and one step's collective bytes; rank 0 puts them on ``out``."""
    x = torch.randn(args.batch, args.seq, args.dim, generator=torch.Generator().manual_seed(rank))
    models = {kind: build(kind, args.blocks, args.dim) for kind in KINDS}
    for kind, (model, optim) in models.items():
        train(model, optim, x, 2, debug=kind == "fsdp2-debug")  # warm-up: lazy init, allocator
    rounds = [
        {kind: train(*models[kind], x, args.steps, debug=kind == "fsdp2-debug") for kind in KINDS}
        for _ in range(args.rounds)
    ]
    comm_bytes = {}
    for kind in ("torch", "fsdp2"):
        with _CollectiveBytes() as counter:
            train(*models[kind], x, 1)
        comm_bytes[kind] = counter.bytes
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rounds)
    if rank == 0:
        slowest = [{k: max(r[i][k] for r in gathered) for k in KINDS} for i in range(args.rounds)]
        out.put({"rounds": slowest, "bytes": comm_bytes})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    result: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "config": {k: getattr(args, k) for k in ("blocks", "dim", "batch", "seq", "rounds", "steps")},
        "minimum_bytes": minimum_bytes(args.blocks, args.dim),
        "worlds": {},
    }
    for world in args.worlds:
        queue = ctx.SimpleQueue()
        port = _free_port()
        procs = [ctx.Process(target=rank_main, args=(r, world, port, args, queue)) for r in range(world)]
        for proc in procs:
            proc.start()
        measured = queue.get()
        for proc in procs:
            proc.join()
            if proc.exitcode != 0:
                raise RuntimeError(f"rank process exited with {proc.exitcode}")
        rounds = measured["rounds"]
        result["worlds"][str(world)] = {
            "step_ms": {k: statistics.median(r[k] for r in rounds) * 1e3 for k in KINDS},
            "ratio_fsdp2_over_torch": _median_and_band([r["fsdp2"] / r["torch"] for r in rounds]),
            "ratio_fsdp2_local_over_torch": _median_and_band([r["fsdp2-local"] / r["torch"] for r in rounds]),
            "ratio_debug_over_fsdp2": _median_and_band([r["fsdp2-debug"] / r["fsdp2"] for r in rounds]),
            "bytes": measured["bytes"],
        }
    return result


def print_table(result: dict[str, Any]) -> None:
    print(f"{'world':>5} {'ddp ms':>8} {'torch ms':>9} {'fsdp2 ms':>9} {'ratio (p05-p95)':>20} {'+local':>7}")
    for world, row in result["worlds"].items():
        ms, r, rl = row["step_ms"], row["ratio_fsdp2_over_torch"], row["ratio_fsdp2_local_over_torch"]
        print(
            f"{world:>5} {ms['ddp']:8.1f} {ms['torch']:9.1f} {ms['fsdp2']:9.1f} "
            f"{r['median']:8.2f} ({r['p05']:.2f}-{r['p95']:.2f}) {rl['median']:7.2f}"
        )
    for world, row in result["worlds"].items():
        d = row["ratio_debug_over_fsdp2"]
        print(
            f"world {world}: debug mode (divergence guard) / fsdp2 step "
            f"{d['median']:.3f} ({d['p05']:.3f}-{d['p95']:.3f})"
        )
    low = result["minimum_bytes"]
    for world, row in result["worlds"].items():
        for kind in ("torch", "fsdp2"):
            got = row["bytes"][kind]
            ag, rs = got["all_gather"], got["reduce_scatter"]
            print(
                f"world {world} {kind:6s} all-gather {ag:>10,} B (minimum {low['all_gather']:,}, "
                f"x{ag / low['all_gather']:.4f}), reduce-scatter {rs:>10,} B "
                f"(x{rs / low['reduce_scatter']:.4f}), all-reduce {got['all_reduce']:,} B"
            )
    print(result["machine"])


def add_model_arguments(parser: argparse.ArgumentParser, worlds: list[int]) -> None:
    """The world sizes and the model shape, shared with memory_floor.py (the same model)."""
    parser.add_argument("--worlds", type=int, nargs="+", default=worlds)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--dim", type=int, default=126, help="126: shards are padded at world 4")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser, worlds=[2, 4])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3, help="steps per model per round")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps(result, indent=2))
    print_table(result)
    return result


if __name__ == "__main__":
    main()
