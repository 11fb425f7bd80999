"""How the costs grow with the number of groups: fsdp2 and torch's ``fully_shard`` side by side.

A model of ``n`` blocks (two small ``Linear(16, 16)`` each, one ``fully_shard`` group per block, then
the root), for ``n`` in ``--blocks``. Per implementation and size, the slowest rank's seconds for:
``fully_shard`` of every block and the root, the first training step (lazy init included), a steady
step (median of 3), ``model.state_dict()``, and a DCP save and load of ``{"model": state_dict}``.
Printed per block (milliseconds), so a cost that grows linearly shows as a flat column. The order of
the two implementations alternates from size to size: the second run of a size was measured paying
for the first one's files and garbage (DCP load 40% slower at 100 blocks, for either implementation).

Run:  torchrun --standalone --nproc-per-node 2 benchmarks/scaling.py [--blocks 10 100 500 2000]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fsdp2

COSTS = ("fully_shard", "first step", "steady step", "state_dict", "dcp save", "dcp load")


def _model(n: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)) for _ in range(n)))


def _timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds.item())


def measure(impl: str, n: int, root: Path) -> dict[str, float]:
    shard = fsdp2.fully_shard if impl == "fsdp2" else torch_fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _model(n)

    def wrap() -> None:
        for block in model:
            shard(block, mesh=mesh)
        shard(model, mesh=mesh)

    out = {"fully_shard": _timed(wrap)}
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 16)

    def step() -> None:
        model(x).sum().backward()
        optim.step()
        optim.zero_grad()

    out["first step"] = _timed(step)
    out["steady step"] = statistics.median(_timed(step) for _ in range(3))
    out["state_dict"] = _timed(model.state_dict)
    path = root / f"{impl}-{n}"
    state = {"model": model.state_dict()}
    out["dcp save"] = _timed(lambda: dcp.save(state, checkpoint_id=str(path)))
    out["dcp load"] = _timed(lambda: dcp.load(state, checkpoint_id=str(path)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, nargs="+", default=[10, 100, 500, 2000])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    root = Path(tempfile.mkdtemp()) if dist.get_rank() == 0 else Path()
    box = [str(root)]
    dist.broadcast_object_list(box)
    root = Path(box[0])
    rows = []
    for index, n in enumerate(args.blocks):
        # the second run of a size pays for the first one's garbage and files: alternate the order
        for impl in ("torch", "fsdp2") if index % 2 == 0 else ("fsdp2", "torch"):
            gc.collect()
            rows.append({"impl": impl, "blocks": n, **measure(impl, n, root)})
    rows.sort(key=lambda row: (row["blocks"], row["impl"] != "torch"))
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
        print(f"world {dist.get_world_size()} gloo, blocks of two Linear(16, 16), {platform.node()}")
        print("ms per block:")
        print(f"{'blocks':>6} {'impl':<6} " + " ".join(f"{c:>12}" for c in COSTS))
        for row in rows:
            cells = " ".join(f"{row[c] * 1e3 / row['blocks']:12.3f}" for c in COSTS)
            print(f"{row['blocks']:6d} {row['impl']:<6} {cells}")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
