"""The only module that touches DTensor internals.

Owns: building a DTensor from a local tensor and a precomputed spec without the autograd and
validation work of ``DTensor.from_local`` (hot path: one call per gradient per step), and re-pointing
a DTensor at new local storage. ``tests/unit/test_dtensor.py`` checks both against the public API.
Invariants: the spec passed in describes the local tensor (global shape, stride, dtype, placements).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement


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
