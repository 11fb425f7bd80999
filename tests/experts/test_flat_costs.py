"""The token exchange's Python work does not grow with the world size (counted in lines, not timed).

Rank 1 of 8 and of 4,096 simulated ranks (torch's fake process group, ``tests/shared/simulated``)
runs one forward and backward of a two-layer mixture of experts with ``2 N`` experts at ``ep = N``
(two experts per rank, the token exchange over every rank). Four tokens, top 2: at most 8 peers get
rows at either size, so a rank's work is the same. Under the fake group the counts a rank receives
are its own (``fsdp2/experts/_tokens.py``). A loop over every rank (a count list, a split, a send or a
received piece per rank) adds at least 4,088 lines per exchange at 4,096 ranks (before: 1.9 million
more lines than at 8 ranks); the bound allowed is 200.
"""

from __future__ import annotations

import pytest

from tests.shared.simulated import fsdp2_lines

_EXPERTS = """
def setup(world):
    import torch, fsdp2
    from torch.distributed.device_mesh import init_device_mesh
    from tests.shared.experts_models import DIM, Net
    torch.manual_seed(0)
    model = Net(2 * world, top_k=2, counted=False, layers=2)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.5)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    fsdp2.shard_experts(model, ep=world, mesh=mesh)
    for layer in model.layers:
        fsdp2.fully_shard(layer, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    data = torch.randn(4, DIM)
    def run():
        model(data).pow(2).mean().backward()
        model.zero_grad()
    return run
"""


@pytest.mark.slow  # a fresh interpreter: about 10 s
def test_a_step_runs_the_same_lines_at_8_and_4096_ranks() -> None:
    lines = fsdp2_lines(_EXPERTS, (8, 4096))
    assert lines[8] > 100  # the step ran fsdp2's code
    assert lines[4096] - lines[8] <= 200, lines
