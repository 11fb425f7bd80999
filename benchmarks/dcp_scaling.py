"""DCP save and load per block: fsdp2 against torch's ``fully_shard``, each in a fresh process.

A model of ``n`` blocks (two ``Linear(32, 32)`` each, one ``fully_shard`` group per block, then the
root), world 1 (gloo), one training step, then ``torch.distributed.checkpoint.save`` of
``{"model": model.state_dict()}`` ``--saves`` times into fresh folders and ``load`` of the last one
as often. Each (implementation, size) runs in its own interpreter, the two implementations
alternating, ``--rounds`` times: a fresh process is where a user's job saves, and the first save of
a process is where a full garbage collection the process owes lands (see docs/performance.md). Per
size: the first save, the median of the later saves, the median load (milliseconds per block),
whether the first save ran a full collection, and the checkpoint bytes.

Run:  python benchmarks/dcp_scaling.py [--blocks 50 200 800 --rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child(impl: str, n: int, saves: int) -> dict[str, Any]:
    """One process: build, shard, step, then time the saves and loads (world 1)."""
    collections: list[float] = []
    started: list[float] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started.append(time.perf_counter())
            else:
                collections.append(time.perf_counter() - started.pop())

    gc.callbacks.append(on_gc)
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn

    if impl == "fsdp2":
        import fsdp2

        shard = fsdp2.fully_shard
    else:
        from torch.distributed.fsdp import fully_shard as shard
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)) for _ in range(n)))
    for block in model:
        shard(block)
    shard(model)
    model(torch.randn(4, 32)).sum().backward()
    root = Path(tempfile.mkdtemp())
    state = {"model": model.state_dict()}
    save_s, save_gc = [], []
    for i in range(saves):
        before = len(collections)
        start = time.perf_counter()
        dcp.save(state, checkpoint_id=str(root / str(i)))
        save_s.append(time.perf_counter() - start)
        save_gc.append(sum(collections[before:]))
    load_s = []
    for _ in range(saves):
        start = time.perf_counter()
        dcp.load(state, checkpoint_id=str(root / str(saves - 1)))
        load_s.append(time.perf_counter() - start)
    size = sum(f.stat().st_size for f in (root / "0").iterdir())
    dist.destroy_process_group()
    return {"save_s": save_s, "save_gc_s": save_gc, "load_s": load_s, "bytes": size}


def _run_child(impl: str, n: int, saves: int) -> dict[str, Any]:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    command = [sys.executable, __file__, "--child", impl, str(n), "--saves", str(saves)]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, nargs="+", default=[50, 200, 800])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--child", nargs=2, default=None, metavar=("IMPL", "BLOCKS"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.saves)))
        return
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for n in args.blocks:
        for r in range(args.rounds):
            for impl in ("torch", "fsdp2") if r % 2 == 0 else ("fsdp2", "torch"):
                runs.setdefault((impl, n), []).append(_run_child(impl, n, args.saves))
    print("world 1 gloo, blocks of two Linear(32, 32); ms per block (median over rounds)")
    print(
        f"{'blocks':>6} {'impl':<6} {'1st save':>9} {'later saves':>11} {'load':>8} "
        f"{'1st save gc ms':>14} {'bytes':>9}"
    )
    rows = []
    for (impl, n), results in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0] != "torch")):
        row = {
            "impl": impl,
            "blocks": n,
            "first_save_s": statistics.median(r["save_s"][0] for r in results),
            "later_save_s": statistics.median(s for r in results for s in r["save_s"][1:]),
            "load_s": statistics.median(s for r in results for s in r["load_s"]),
            "first_save_gc_s": statistics.median(r["save_gc_s"][0] for r in results),
            "bytes": results[0]["bytes"],
        }
        rows.append(row)
        per = 1e3 / n
        print(
            f"{n:6d} {impl:<6} {row['first_save_s'] * per:9.3f} {row['later_save_s'] * per:11.3f} "
            f"{row['load_s'] * per:8.3f} {row['first_save_gc_s'] * 1e3:14.1f} {row['bytes']:9d}"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rows": rows, "runs": [[*k, v] for k, v in runs.items()]}, indent=1)
        )


if __name__ == "__main__":
    main()
