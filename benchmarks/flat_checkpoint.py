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

With each world, the load's planning on rank 1 (the checkpoint's ``.metadata`` and sidecar built
as rank 0 would write them for that world):

- ``fsdp2 load plan``: ``fsdp2.load_sharded``'s planning: read and parse the ``.fsdp2_layout``
  sidecar, check every entry, find the saved chunks meeting each local shard and their file slots;
- ``dcp .metadata unpickle``: what every rank of ``dcp.load`` does first (every chunk of every rank);
- ``dcp load local plan``: ``DefaultLoadPlanner.set_up_planner`` + ``create_local_plan`` on this rank
  (each local shard compared with every saved chunk of its key);
- ``dcp load rank-0 plans``: rank 0's share of the plan exchange: the ``N`` local plans unpickled as
  the gather delivers them, ``create_global_plan``, the ``N`` plans pickled for the scatter (the
  messages themselves are not timed).

With ``--load``: one process, no process group, 256 MiB (64 float32 tensors of 4 MiB) saved by
``save_sharded`` and read back by ``fsdp2.load_sharded`` and by ``dcp.load`` (seconds, best of 3).

Run:  python benchmarks/flat_checkpoint.py [--worlds 8 64 512 4096] [--staging] [--load]
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
        **_load_planning(world, state, layouts, metadata(), paths, meshes),
    }
    dist.destroy_process_group()
    return row


def _load_planning(
    world: int, state: Any, layouts: list[Any], tensors: Any, paths: Any, meshes: list[Any]
) -> dict[str, float]:
    """A load's planning on rank 1 of ``world``: fsdp2's from the sidecar against ``dcp.load``'s."""
    import pickle
    import tempfile

    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    from fsdp2.weights._flat_layout import full_metadata
    from fsdp2.weights._flat_load import plan_load
    from fsdp2.weights._flat_sidecar import MeshRanks, read_sidecar, sidecar_bytes

    metadata = pickle.dumps(full_metadata(tensors, {}, paths, list(paths)))
    ranks = MeshRanks.of((world,), list(range(world)))
    folder = Path(tempfile.mkdtemp())
    (folder / ".metadata").write_bytes(metadata)
    (folder / ".fsdp2_layout").write_bytes(sidecar_bytes(layouts, [ranks] * len(layouts), {}))

    def fsdp2_plan() -> Any:
        return plan_load(read_sidecar(folder), state)

    unpickled = pickle.loads(metadata)

    def dcp_local() -> Any:
        planner = DefaultLoadPlanner()
        planner.set_up_planner(state, unpickled, is_coordinator=False)
        return planner.create_local_plan()

    plans = []  # every rank's local plan as rank 0's gather receives it: pickled, one per rank
    for rank in range(world):
        items = []
        for layout in layouts:
            found = layout.chunk((rank,))
            if found is not None:
                index = MetadataIndex(layout.key, found[0])
                zeros = torch.Size([0] * len(found[0]))
                items.append(ReadItem(LoadItemType.TENSOR, index, zeros, index, zeros, torch.Size(found[1])))
        plans.append(pickle.dumps(LoadPlan(items)))

    def dcp_global() -> Any:
        planner = DefaultLoadPlanner()
        received = [pickle.loads(plan) for plan in plans]
        return [pickle.dumps(plan) for plan in planner.create_global_plan(received)]  # scattered back

    return {
        "fsdp2 load plan": _best(fsdp2_plan),
        "dcp .metadata unpickle": _best(lambda: pickle.loads(metadata)),
        "dcp load local plan": _best(dcp_local),
        "dcp load rank-0 plans": _best(dcp_global),
        "sidecar KiB": (folder / ".fsdp2_layout").stat().st_size / 1024,
        ".metadata KiB": len(metadata) / 1024,
    }


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


def _real_load() -> None:
    """One process, no process group: 256 MiB saved by ``save_sharded``, read back by each loader."""
    import tempfile

    import torch
    import torch.distributed.checkpoint as dcp

    import fsdp2

    state = {"model": {f"w{i}": torch.randn(1024, 1024) for i in range(64)}}
    target = {"model": {key: torch.empty_like(value) for key, value in state["model"].items()}}
    with tempfile.TemporaryDirectory() as folder:
        fsdp2.save_sharded(state, folder)
        row = {
            "fsdp2.load_sharded s": _best(lambda: fsdp2.load_sharded(target, folder)) / 1e3,
            "dcp.load s": _best(lambda: dcp.load(target, checkpoint_id=folder)) / 1e3,
        }
        assert all(torch.equal(target["model"][k], v) for k, v in state["model"].items())
    print(json.dumps({key: round(value, 3) for key, value in row.items()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 512, 4096])
    parser.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--staging", action="store_true", help="time async saves within a staging budget")
    parser.add_argument("--load", action="store_true", help="time a real load at one rank")
    args = parser.parse_args()
    if args.load:
        _real_load()
        return
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
