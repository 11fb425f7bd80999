"""The whole-tensor step runs as one rank of a simulated world (torch's fake process group).

Under the fake process group one process stands in for rank 1 of 4,096 ranks and nothing is
exchanged, so the values mean nothing; what is checked is that the owner step's agreement does not
refuse the job (its one all-reduce returns this rank's own sum there) and that each parameter keeps
the rows ``torch.chunk`` gives rank 1. Costs per rank at such sizes are measured in
``benchmarks/flat_costs.py``, never timed here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_CODE = """
import torch, torch.distributed as dist, torch.nn as nn
from torch.testing._internal.distributed.fake_pg import FakeStore
import fsdp2

world = 4096
dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=world)
model = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(3)])
for layer in model:
    fsdp2.fully_shard(layer)
fsdp2.fully_shard(model)
optimizer = torch.optim.Muon(model.parameters(), lr=0.01)
fsdp2.whole_tensor_step(optimizer)
for _ in range(2):
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
rows = [p.to_local().shape[0] for p in model.parameters()]
expected = [torch.empty(64).chunk(world)[1].numel()] * 3  # torch.chunk's rows of rank 1
print(rows == expected, rows, expected)
"""


@pytest.mark.slow  # a fresh interpreter: about 10 s
def test_the_owner_step_runs_as_one_rank_of_4096() -> None:
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _CODE], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1].startswith("True"), out.stdout
