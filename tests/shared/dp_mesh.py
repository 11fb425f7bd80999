"""A feed-forward model on a full SPMD mesh (DataParallelMeshDims), shared by its thread-rank, gloo and
surface tests.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

DIM = 8


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def tp_placements(name: str, n_dp: int) -> tuple[Any, ...]:
    dp = (Replicate(),) * n_dp
    tp = {"up.weight": Shard(0), "up.bias": Shard(0), "down.weight": Shard(1), "down.bias": Replicate()}
    return (*dp, tp[name])


def distribute_on(model: nn.Module, mesh: DeviceMesh, n_dp: int) -> None:
    for name, param in list(model.named_parameters()):
        owner, attr = name.rsplit(".", 1)
        value = distribute_tensor(param.detach(), mesh, tp_placements(name, n_dp))
        setattr(model.get_submodule(owner), attr, nn.Parameter(value))
