"""Helpers of the tests of optimizer state sharded across replicas: whole tensors and state bytes."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp2.param import local_box


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.full_tensor()`` through one c10d all-gather of every rank's block (every rank calls).

    On the threaded test backend DTensor's own redistribution over two mesh dims (two functional
    all-gathers in a row, plain ``init_device_mesh`` meshes too) pairs ranks wrongly now and then.
    """
    assert isinstance(tensor, DTensor)
    box = local_box(tensor)
    assert box is not None
    blocks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(blocks, (box, tensor.to_local().detach().clone()))
    out = torch.empty(tensor.shape, dtype=tensor.dtype)
    for where, block in blocks:
        out[where] = block
    return out


def state_bytes(optim: torch.optim.Optimizer) -> int:
    """The bytes of this rank's optimizer state tensors (local parts; scalars left out)."""
    total = 0
    for values in optim.state.values():
        for value in values.values():
            if isinstance(value, DTensor):
                value = value.to_local()
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                total += value.numel() * value.element_size()
    return total
