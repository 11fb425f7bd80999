"""Checkpoint planning per rank at 8 to 4,096 ranks: ``ShardedCheckpointer`` against ``dcp.save``'s planner.

One process acts as one rank of ``N`` (torch's fake process group: nothing is exchanged), a fresh
process per ``N``; a model of 64 ``Linear(256, 256)`` layers, each ``fully_shard``-ed (128 sharded
tensors). The minimum of 3 runs, in milliseconds:

- ``fsdp2 rank plan``: what any rank computes at a save's first call (flattening, each tensor's layout,
  its own chunks and their file offsets); ``fsdp2 reused``: the same at a later save (the layout
  compared with the cached one);
- ``fsdp2 rank-0 metadata``: the ``.metadata`` entries of every rank's chunks, which rank 0 computes
  alone, once per layout (no gather);
- ``dcp local plan``: ``DefaultSavePlanner.set_up_planner`` + ``create_local_plan`` on this rank;
- ``dcp global plan``: rank 0's ``create_global_plan`` over the ``N`` local plans (the plans are built
  here with each rank's chunks, as the gather would deliver them; the gather itself is not timed),
  at every save.

With ``--staging``: one process (no process group), 256 MiB of float32 tensors (64 of 4 MiB) saved
into a temporary folder: ``save`` (blocking), ``save_async`` with a budget of the whole state (the
call returns once everything is copied; ``wait`` after), and with a budget of 32 MiB (the call blocks
until all but 32 MiB are written); each the second save of its checkpointer (the staging buffers are
kept between saves); seconds, and the peak staged bytes. Then a training loop on one gloo rank (16
``fully_shard``-ed ``Linear(1024, 1024)`` and AdamW: 192 MiB of state), a save after a step, then the
next step: the call's time, the next step's forward + backward and optimizer step, for no save,
``save_async`` staging in the call (budgets of 1 GiB and 32 MiB), and with ``stage_in_background=True``
(32 MiB), whose copies run beside the forward and backward and which the optimizer step waits for
(median of 5).

Run:  python benchmarks/flat_checkpoint.py [--worlds 8 64 512 4096] [--staging]
Prints a table and one JSON line per world.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LAYERS, WIDTH = 64, 256


def _best(fn: Callable[[], Any], tries: int = 3) -> float:
    times = []
    for _ in range(tries):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def _one_world(world: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fsdp2
    from fsdp2.weights._flat_layout import flatten, local_items, tensor_layout, tensor_metadata

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=world)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    for layer in model:
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
    state = {"model": model.state_dict()}
    flat, paths = flatten(state)
    values = list(flat.values())
    meshes = [value.device_mesh for value in values]

    def rank_plan() -> Any:
        flat, _ = flatten(state)
        layouts = [tensor_layout(key, value) for key, value in flat.items()]
        coordinates = [tuple(mesh.get_coordinate()) for mesh in meshes]
        return layouts, local_items(layouts, coordinates, 1)

    layouts, _ = rank_plan()

    def reused() -> bool:
        flat, _ = flatten(state)
        return tuple(tensor_layout(key, value) for key, value in flat.items()) == tuple(layouts)

    def metadata() -> Any:
        ranks = {id(mesh): mesh.mesh.flatten().tolist() for mesh in meshes}
        return tensor_metadata(layouts, [ranks[id(mesh)] for mesh in meshes])

    def dcp_local() -> Any:
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, is_coordinator=False)
        return planner.create_local_plan()

    plans = []
    for rank in range(world):
        items = []
        for layout in layouts:
            found = layout.chunk((rank,))
            if found is None:
                continue
            offsets, sizes = found
            chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
            data = TensorWriteData(chunk, TensorProperties(dtype=layout.dtype), torch.Size(layout.shape))
            items.append(WriteItem(MetadataIndex(layout.key, offsets), WriteItemType.SHARD, tensor_data=data))
        plans.append(SavePlan(items, planner_data=dict(paths)))

    def dcp_global() -> Any:
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, is_coordinator=True)
        return planner.create_global_plan(plans)

    row = {
        "fsdp2 rank plan": _best(rank_plan),
        "fsdp2 reused": _best(reused),
        "fsdp2 rank-0 metadata": _best(metadata),
        "dcp local plan": _best(dcp_local),
        "dcp global plan": _best(dcp_global),
    }
    dist.destroy_process_group()
    return row


def _staging() -> None:
    import tempfile

    import torch

    import fsdp2

    state = {"model": {f"w{i}": torch.randn(1024, 1024) for i in range(64)}}
    total = 64 * 4 << 20
    with tempfile.TemporaryDirectory() as folder:
        saver = fsdp2.ShardedCheckpointer(staging_bytes=total)
        saver.save(state, f"{folder}/warm")
        start = time.perf_counter()
        saver.save(state, f"{folder}/sync")
        print(json.dumps({"save (blocking) s": round(time.perf_counter() - start, 3)}))
        for budget in (total, 32 << 20):
            saver = fsdp2.ShardedCheckpointer(staging_bytes=budget)
            saver.save_async(state, f"{folder}/warm{budget}").wait()  # the staging buffers exist after
            start = time.perf_counter()
            pending = saver.save_async(state, f"{folder}/async{budget}")
            returned = time.perf_counter() - start
            pending.wait()
            row = {
                "budget MiB": budget >> 20,
                "save_async returned s": round(returned, 3),
                "wait done s": round(time.perf_counter() - start, 3),
                "peak staged MiB": pending.peak_staged_bytes >> 20,
            }
            print(json.dumps(row))


def _training_path() -> None:
    import os
    import statistics
    import tempfile

    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    import fsdp2

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])
    for layer in model:
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(2048, 1024)

    def step() -> tuple[float, float]:
        start = time.perf_counter()
        model(batch).square().mean().backward()
        middle = time.perf_counter()
        optim.step()
        optim.zero_grad()
        return middle - start, time.perf_counter() - middle

    for _ in range(2):
        step()
    variants = [
        ("no save", 0, False),
        ("save_async, budget 1 GiB", 1 << 30, False),
        ("save_async, budget 32 MiB", 32 << 20, False),
        ("save_async, budget 32 MiB, stage_in_background", 32 << 20, True),
    ]
    with tempfile.TemporaryDirectory() as folder:
        for variant, budget, background in variants:
            saver = fsdp2.ShardedCheckpointer(staging_bytes=budget) if budget else None
            calls, passes, steps = [], [], []
            for attempt in range(6):
                state = {
                    "model": get_model_state_dict(model),
                    "optim": get_optimizer_state_dict(model, optim),
                }
                start = time.perf_counter()
                pending = None
                if saver is not None:
                    pending = saver.save_async(state, f"{folder}/{attempt}", stage_in_background=background)
                call = time.perf_counter() - start
                forward_backward, optimizer_step = step()
                if pending is not None:
                    pending.wait()
                if attempt:  # the first of each variant warms the staging buffers
                    calls.append(call)
                    passes.append(forward_backward)
                    steps.append(optimizer_step)
            row = {
                "variant": variant,
                "call s": round(statistics.median(calls), 3),
                "forward+backward s": round(statistics.median(passes), 3),
                "optimizer step s": round(statistics.median(steps), 3),
                "training path s": round(
                    statistics.median(c + p + o for c, p, o in zip(calls, passes, steps, strict=True)), 3
                ),
            }
            print(json.dumps(row))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 512, 4096])
    parser.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--staging", action="store_true", help="time async saves within a staging budget")
    args = parser.parse_args()
    if args.staging:
        _staging()
        _training_path()
        return
    if args.one:
        print(json.dumps(_one_world(args.one)))
        return
    rows = {}
    for world in args.worlds:
        run = subprocess.run(
            [sys.executable, __file__, "--one", str(world)],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONPATH": str(REPO), **dict(__import__("os").environ)},
        )
        rows[world] = json.loads(run.stdout.strip().splitlines()[-1])
        print(json.dumps({"world": world, **rows[world]}), flush=True)
    names = list(next(iter(rows.values())))
    print(f"{'ms':>24} " + " ".join(f"{world:>9}" for world in rows))
    for name in names:
        print(f"{name:>24} " + " ".join(f"{rows[world][name]:9.2f}" for world in rows))


if __name__ == "__main__":
    main()
