"""The only module that touches DTensor internals.

Owns: building a DTensor from a local tensor and a precomputed spec without the autograd and
validation work of ``DTensor.from_local`` (hot path: one call per gradient per step), and re-pointing
a DTensor at new local storage. ``tests/unit/test_dtensor.py`` checks both against the public API.
Invariants: the spec passed in describes the local tensor (global shape, stride, dtype, placements).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, _StridedShard

__all__ = [
    "DTensorSpec",
    "local_in_placements",
    "local_of",
    "make_spec",
    "set_local",
    "spec_of",
    "strided_shard",
    "wrap_local",
]


def make_spec(
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    size: torch.Size,
    stride: tuple[int, ...],
    dtype: torch.dtype,
) -> DTensorSpec:
    """A DTensor spec for a global tensor of ``size``/``stride``/``dtype`` laid out by ``placements``."""
    return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(size, stride, dtype))


def wrap_local(local: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool = False) -> DTensor:
    """A DTensor over ``local`` (no copy, no autograd edge)."""
    return DTensor(local, spec, requires_grad=requires_grad)


def local_of(tensor: DTensor) -> torch.Tensor:
    """The local tensor of a DTensor, without the autograd-tracked ``to_local`` call."""
    local: torch.Tensor = tensor._local_tensor  # noqa: SLF001 - this module owns DTensor internals
    return local


def set_local(tensor: DTensor, local: torch.Tensor) -> None:
    """Point ``tensor`` at new local storage (same local shape)."""
    tensor._local_tensor = local  # noqa: SLF001 - this module owns DTensor internals


def spec_of(tensor: DTensor) -> DTensorSpec:
    spec: DTensorSpec = tensor._spec  # noqa: SLF001 - this module owns DTensor internals
    return spec


def strided_shard(dim: int, split_factor: int) -> Placement:
    """DTensor's placement for a dim sharded inside another mesh dim's shards (FSDP inside TP)."""
    return _StridedShard(dim, split_factor=split_factor)


def local_in_placements(tensor: DTensor, placements: Sequence[Placement]) -> torch.Tensor:
    """``tensor``'s local tensor after redistributing it to ``placements`` (e.g. reducing ``Partial``).

    Waits for an asynchronous collective result, so the caller gets a plain tensor.
    """
    if tuple(tensor.placements) != tuple(placements):
        tensor = tensor.redistribute(tensor.device_mesh, placements)
    local = local_of(tensor)
    if isinstance(local, AsyncCollectiveTensor):
        local = local.wait()
    return local
