"""Peak memory per rank at world 4 and 8, fsdp2 and torch's fully_shard, against the floor.

Both run for real on thread ranks (``fsdp2.testing.measure_memory``: real values, real collectives
between the ranks, live tensor storage bytes counted per rank and phase: what
``torch.cuda.memory_allocated`` would count). The model is the one of ``scale.py`` (blocks with
uneven shards at world 4 and 8), trained two steps with AdamW; the figure is rank 0's peak over
the second step (the first one creates the optimizer states).

The floor is what any FSDP must hold at its peak on rank 0: its shard of the parameters, of the
gradients and of the AdamW states (exp_avg, exp_avg_sq, a step counter each), plus the unsharded
groups in flight (the root, kept gathered from forward to backward, and two blocks: the one running
and the one prefetched), plus the activations of the local batch (measured on the unsharded model,
at the end of its forward).

Run:  python benchmarks/memory_floor.py [--worlds 4 8]
Writes benchmarks/results/memory_floor.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from scale import Model, add_model_arguments
from torch import nn

import fsdp2
from fsdp2.testing import measure_memory


def job(kind: str, blocks: int, dim: int, batch: tuple[int, int]) -> tuple[Any, Any]:
    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = Model(blocks, dim)
        if kind == "torch":
            from torch.distributed.fsdp import fully_shard
        else:
            fully_shard = fsdp2.fully_shard  # type: ignore[assignment]
        if kind != "plain":
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(built: tuple[nn.Module, torch.optim.Optimizer]) -> None:
        model, optim = built
        rank = dist.get_rank() if dist.is_initialized() else 0
        x = torch.randn(*batch, dim, generator=torch.Generator().manual_seed(rank))
        model(x).pow(2).mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    return build, step


def floor_bytes(world: int, blocks: int, dim: int, activations: int) -> dict[str, int]:
    model = Model(blocks, dim)

    def shard_bytes(params: Any) -> int:  # rank 0's padded shard
        return sum(math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) * 4 for p in params)

    params = shard_bytes(model.parameters())
    n_params = len(list(model.parameters()))
    block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    root = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("blocks."))
    parts = {
        "parameters": params,
        "gradients": params,
        "optimizer_states": 2 * params + 4 * n_params,
        "unsharded_in_flight": root + 2 * block,
        "activations": activations,
    }
    parts["floor"] = sum(parts.values())
    return parts


def run(args: argparse.Namespace) -> dict[str, Any]:
    batch = (args.batch, args.seq)
    result: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "config": {"blocks": args.blocks, "dim": args.dim, "batch": args.batch, "seq": args.seq},
        "worlds": {},
    }
    plain = measure_memory(1, *job("plain", args.blocks, args.dim, batch))[0]
    activations = plain.phases["forward"].breakdown["activations"]
    for world in args.worlds:
        row: dict[str, Any] = {"floor": floor_bytes(world, args.blocks, args.dim, activations)}
        for kind in ("torch", "fsdp2"):
            report = measure_memory(world, *job(kind, args.blocks, args.dim, batch))[0]
            row[kind] = {
                "peak_bytes": report.step_peak_bytes,
                "peak_phase": report.peak_phase,
                "breakdown": report.breakdown,
                "over_floor": report.step_peak_bytes / row["floor"]["floor"],
            }
        row["ratio_fsdp2_over_torch"] = row["fsdp2"]["peak_bytes"] / row["torch"]["peak_bytes"]
        result["worlds"][str(world)] = row
    return result


def print_table(result: dict[str, Any]) -> None:
    print(
        f"{'world':>5} {'floor MiB':>10} {'torch MiB':>10} {'/floor':>7} {'fsdp2 MiB':>10} {'/floor':>7} "
        f"{'fsdp2/torch':>12}"
    )
    for world, row in result["worlds"].items():
        mib = lambda b: b / 2**20  # noqa: E731
        print(
            f"{world:>5} {mib(row['floor']['floor']):10.2f} {mib(row['torch']['peak_bytes']):10.2f} "
            f"{row['torch']['over_floor']:7.3f} {mib(row['fsdp2']['peak_bytes']):10.2f} "
            f"{row['fsdp2']['over_floor']:7.3f} {row['ratio_fsdp2_over_torch']:12.3f}"
        )
    print(result["machine"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser, worlds=[4, 8])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    warnings.filterwarnings(
        "ignore", message=r"(?s).*(view tensor|is a view)"
    )  # both FSDPs warn on 3-D Linear outputs
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory_floor.json").write_text(json.dumps(result, indent=2))
    print_table(result)
    return result


if __name__ == "__main__":
    main()
