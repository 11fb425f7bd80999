"""``fsdp2.load_sharded`` as rank 1 of 8 and of 4,098 simulated ranks (torch's fake process group).

Counts, no timing: the load's planning runs the same number of fsdp2 Python lines at both world sizes
(the sidecar names the saving mesh as a range; the saved chunks meeting a shard are found per mesh dim
by arithmetic, not by walking the N ranks), reads one saved chunk per sharded tensor, from rank 1's
own file, and the values read are the ones rank 1 saved. Rank 0 writes the sidecar, ``.metadata``
and its file in one interpreter; rank 1 saves and loads in another (fsdp2 keeps a mesh per world size
within a process). Times at these sizes are in ``benchmarks/flat_checkpoint.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_CODE = """
import json, sys
from pathlib import Path
import torch, torch.distributed as dist, torch.nn as nn
from torch.testing._internal.distributed.fake_pg import FakeStore
import fsdp2
from fsdp2.weights import _flat_load

rank, folder = int(sys.argv[1]), Path(sys.argv[2])

def state_at(world):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(3)])
    for layer in model:
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
    return {"model": model.state_dict()}

lines = [0]
def tracer(frame, event, arg):
    if "fsdp2" not in frame.f_code.co_filename:
        return None
    if event == "line":
        lines[0] += 1
    return tracer

out = {}
for world in (8, 4098):
    state = state_at(world)
    path = folder / str(world)
    fsdp2.save_sharded(state, path)
    if rank == 1:
        saved = {key: value.to_local().clone() for key, value in state["model"].items()}
        for value in state["model"].values():
            value.to_local().zero_()
        saved_layout = _flat_load.read_sidecar(path)
        lines[0] = 0
        sys.settrace(tracer)
        plan = _flat_load.plan_load(saved_layout, state)
        sys.settrace(None)
        _flat_load.run_plan(plan, path, state)
        out[world] = {
            "lines": lines[0],
            "chunks": plan.chunks_read,
            "ranks": sorted({piece.rank for _, pieces in plan.tensors for piece in pieces}),
            "equal": all(torch.equal(state["model"][key].to_local(), saved[key]) for key in saved),
            "sidecar bytes": (path / ".fsdp2_layout").stat().st_size,
        }
    dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.slow  # two fresh interpreters: about 10 s
def test_load_planning_per_rank_does_not_grow_with_the_world(tmp_path: Path) -> None:
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    outs = []
    for rank in (0, 1):  # rank 0 first: its sidecar and .metadata, then rank 1's file and its load
        run = subprocess.run(
            [sys.executable, "-c", _CODE, str(rank), str(tmp_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        outs.append(json.loads(run.stdout.strip().splitlines()[-1]))
    small, large = outs[1]["8"], outs[1]["4098"]
    assert small["lines"] == large["lines"]
    assert small["chunks"] == large["chunks"] == 6  # three weights and three biases: one chunk each
    assert small["ranks"] == large["ranks"] == [1]  # its own file only
    assert small["equal"]
    assert large["equal"]
    assert large["sidecar bytes"] - small["sidecar bytes"] < 16  # the mesh shape's digits, not its ranks
