"""Each rank's own part of every parameter, with its place in the full tensor: no collective.

Owns: ``LocalShard`` (one parameter's local part: values, global shape, offset, mesh, placements)
and ``local_shards``, which yields one per parameter for receivers that reshard the weights
themselves. Does not own: gathering (``_gather_buckets``) or the changed-only bookkeeping
(``_weight_sync``).
Invariants: a shard's values are ``full[offset[0] : offset[0] + shape[0], offset[1] : ...]`` of the
full tensor; ranks that hold the same block (replicas) yield equal shards.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..param import local_box

__all__ = ["LocalShard", "local_shards"]


@dataclass(frozen=True)
class LocalShard:
    """One rank's part of one parameter, as ``WeightSync.local_shards()`` yields it.

    Attributes:
        name: the parameter's name in the unsharded model.
        tensor: this rank's values, in the sync dtype (a copy: the trainer may change its shard).
        global_shape: the full parameter's shape.
        offset: where ``tensor`` starts in the full parameter, per dim; it covers
            ``full[offset[0] : offset[0] + tensor.shape[0], ...]``.
        mesh: the device mesh the parameter is laid out on (``None``: a plain tensor, whole on
            every rank).
        placements: its placements on ``mesh`` (``Shard(0)`` for FSDP, ``(Replicate(), Shard(0))``
            for HSDP; ``()`` for a plain tensor).
    """

    name: str
    tensor: torch.Tensor
    global_shape: torch.Size
    offset: tuple[int, ...]
    mesh: DeviceMesh | None
    placements: tuple[Placement, ...]


def local_shards(model: nn.Module, dtype: torch.dtype) -> Iterator[LocalShard]:
    """One ``LocalShard`` per parameter of ``model``, values in ``dtype`` (see ``LocalShard``)."""
    for name, param in model.named_parameters():
        with torch.no_grad():
            if not isinstance(param, DTensor):
                values = param.detach().to(dtype, copy=True)
                yield LocalShard(name, values, param.shape, (0,) * param.dim(), None, ())
                continue
            offset = _offset(name, param)
            values = param.to_local().detach().to(dtype, copy=True)
        yield LocalShard(name, values, param.shape, offset, param.device_mesh, tuple(param.placements))


def _offset(name: str, param: DTensor) -> tuple[int, ...]:
    """Where this rank's block of ``param`` starts.

    Each ``Shard(d)`` on a mesh dim splits the block it is given as ``torch.chunk`` does, in mesh-dim
    order (DTensor's layout).
    """
    coordinate = param.device_mesh.get_coordinate() or [0] * param.device_mesh.ndim
    box = local_box(param, coordinate)
    if box is None:
        mesh_dim, placement = next(
            (i, p) for i, p in enumerate(param.placements) if type(p) not in (Shard, Replicate)
        )
        raise ValueError(
            f"WeightSync.local_shards cannot place {name!r}: its placement {placement} on mesh dim "
            f"{mesh_dim} is not one block per rank (partial sums, or rows interleaved by tensor "
            "parallelism). Gather it with WeightSync.updates() instead."
        )
    return tuple(piece.start for piece in box)
