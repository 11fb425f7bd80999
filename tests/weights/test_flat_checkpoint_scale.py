"""``ShardedCheckpointer`` as one rank of 8 and of 4,096 simulated ranks (torch's fake process group).

Counts, no timing: a rank other than 0 places one chunk per sharded tensor at the first save whatever
the world size, and none at later saves (the plan is reused); rank 0 places every rank's chunks once
per distinct tensor shape (its ``.metadata`` lists them) and none at later saves. The chunk each rank
writes is the rows ``torch.chunk`` gives it, checked against the ``.metadata`` rank 0 writes. Times
per rank at these sizes are measured in ``benchmarks/flat_checkpoint.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_CODE = """
import json, pickle, sys, tempfile
import torch, torch.distributed as dist, torch.nn as nn
from torch.testing._internal.distributed.fake_pg import FakeStore
import fsdp2
from fsdp2.weights._flat_layout import TensorLayout

calls = [0]
chunk = TensorLayout.chunk
def counted(self, coordinate):
    calls[0] += 1
    return chunk(self, coordinate)
TensorLayout.chunk = counted

out = {}
for world, rank in [(8, 1), (4096, 1), (4097, 4096), (16, 0), (4098, 0)]:  # torch keeps a mesh per size
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(3)])
    for layer in model:
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
    state = {"model": model.state_dict()}
    saver = fsdp2.ShardedCheckpointer()
    counts = []
    with tempfile.TemporaryDirectory() as folder:
        for step in range(2):
            calls[0] = 0
            saver.save(state, f"{folder}/step{step}")
            counts.append(calls[0])
        chunks = None
        if rank == 0:
            with open(f"{folder}/step1/.metadata", "rb") as handle:
                meta = pickle.load(handle)
            chunks = [[list(c.sizes) for c in e.chunks] for e in meta.state_dict_metadata.values()]
    out[f"{world}/{rank}"] = {"counts": counts, "chunks": chunks}
    dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.slow  # a fresh interpreter: about 10 s
def test_planning_per_rank_does_not_grow_with_the_world() -> None:
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", _CODE], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    sharded = 6  # three weights and three biases
    assert out["8/1"]["counts"] == [sharded, 0]
    assert out["4096/1"]["counts"] == [sharded, 0]
    assert out["4097/4096"]["counts"] == [sharded, 0]  # the last rank: no rows, nothing written
    # rank 0: its own, then every rank's, once per shape (64 x 64 weights, 64 biases)
    assert out["16/0"]["counts"] == [sharded + 2 * 16, 0]
    assert out["4098/0"]["counts"] == [sharded + 2 * 4098, 0]
    # torch.chunk of 64 rows: 4 rows each at 16 ranks; one row for each of the first 64 of 4,098 ranks
    assert out["16/0"]["chunks"] == [[[4, 64]] * 16, [[4]] * 16] * 3
    assert out["4098/0"]["chunks"] == [[[1, 64]] * 64, [[1]] * 64] * 3
