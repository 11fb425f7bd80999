"""The owner steps' Python work does not grow with the world size (counted in lines, not timed).

Rank 1 of 8 and of 4,096 simulated ranks (torch's fake process group, ``tests/shared/simulated``)
steps three matrices of 6 rows: it owns one at both sizes and exchanges rows with the same 6 holders,
so what it does is the same work. A loop over every rank (a send list, an expected size or a received
part per rank, a state copy per rank) would add at least 4,088 lines at 4,096 ranks; the bound
allowed is 200. The general owner step's optimizer keeps tensors only: a plain Python value in the
state that changes every step is announced every step, by an object all-gather (one object per rank,
torch's ``all_gather_object``).

The same for a step with the optimizer sharded across HSDP's replicas
(``shard_optimizer_across_replicas``) on a (N/4 replicas, 4 shards) mesh: the slices of a parameter
go into and out of the replicas' rows as two strided copies, not a copy per replica (before: two
Python loops over every replica per parameter: 122,800 more lines at 1,024 replicas).
"""

from __future__ import annotations

import pytest

from tests.shared.simulated import fsdp2_lines

# Each setup's step: one forward, backward and optimizer step (prepended to every setup below).
_STEPPER = """
def stepper(model, optim, data):
    def run():
        model(data).sum().backward()
        optim.step()
        optim.zero_grad()
    return run
"""

_MUON = """
def setup(world):
    import torch, torch.nn as nn, fsdp2
    torch.manual_seed(0)
    layers = [nn.Linear(8, 6, bias=False), nn.Linear(6, 6, bias=False), nn.Linear(6, 6, bias=False)]
    model = nn.Sequential(*layers)
    for layer in model:
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
    optim = torch.optim.Muon(model.parameters(), lr=0.01)
    fsdp2.whole_tensor_step(optim)
    run = stepper(model, optim, torch.randn(2, 8))
    run()  # the first step (state made)
    return run
"""

_GENERAL = """
def setup(world):
    import torch, torch.nn as nn, torch.distributed as dist, fsdp2
    from tests.shared.owner_step import GramMomentum
    plain = dist.all_gather_object
    def all_gather_object(out, obj, group=None):  # the fake group carries no objects: every owner
        layout = next(iter(obj.values()))         # announces rank 1's layout (all shapes alike)
        out[:] = [{i: layout for i in range(3)}] * len(out)
    dist.all_gather_object = all_gather_object
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 6, bias=False) for _ in range(3)])
    model[1].weight, model[2].weight = nn.Parameter(torch.randn(6, 8)), nn.Parameter(torch.randn(6, 8))
    model.forward = lambda x: sum(layer(x) for layer in model)
    for layer in model:
        fsdp2.fully_shard(layer)
    optim = fsdp2.whole_tensor_step(GramMomentum(model.parameters(), lr=0.01, scalar=False))
    run = stepper(model, optim, torch.randn(2, 8))
    run()  # the first step (state made, layouts announced)
    dist.all_gather_object = plain
    return run
"""


_ACROSS = """
def setup(world):
    import torch, torch.nn as nn, fsdp2
    from torch.distributed.device_mesh import init_device_mesh
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world // 4, 4), mesh_dim_names=("replicate", "shard"))
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
    for layer in model:
        fsdp2.fully_shard(layer, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    optim = fsdp2.shard_optimizer_across_replicas(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    run = stepper(model, optim, torch.randn(2, 8))
    run()  # the first step (state made)
    return run
"""


@pytest.mark.slow  # a fresh interpreter: about 10 s
@pytest.mark.parametrize(
    "setup", [_MUON, _GENERAL, _ACROSS], ids=["muon_rows", "general_owner_step", "across_replicas"]
)
def test_a_step_runs_the_same_lines_at_8_and_4096_ranks(setup: str) -> None:
    lines = fsdp2_lines(_STEPPER + setup, (8, 4096))
    assert lines[8] > 100  # the step ran fsdp2's code
    assert lines[4096] - lines[8] <= 200, lines
