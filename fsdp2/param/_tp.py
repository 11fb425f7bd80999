"""The DTensor layouts of a managed parameter: its sharded spec, and what tensor parallelism adds.

Owns: the spec of the sharded DTensor parameter (``sharded_spec``): FSDP's placement on the shard
mesh dim (``Replicate`` before it under HSDP), composed with the TP placements for a tensor-parallel
parameter; and ``TPLayout``, a tensor-parallel parameter's TP spec with what is derived from it (the
unsharded parameter's spec, a gradient's local tensor, a full tensor's TP-local part, a meta
stand-in). Does not own: tensor storage (``_shard``, ``_unsharded``) or any collective.

[Note: Tensor parallel]
A tensor-parallel parameter is a DTensor on a TP mesh when ``fully_shard`` sees it. FSDP shards its
TP-local tensor like any other parameter (every size in ``ShardLayout`` is of that local tensor) and
keeps two DTensor layouts:
- the sharded parameter lives on one mesh of the data-parallel dims followed by the TP dims (``spmd_mesh``),
  FSDP's placement first. The data-parallel dims are those of ``fully_shard``'s mesh, or of the mesh
  info ``shard_placement_fn`` gave the parameter (experts on an ``ep`` mesh over ``efsdp``). Where
  TP also shards FSDP's dim, FSDP's chunks are chunks of each TP-local tensor, interleaved across the
  global dim: a ``_StridedShard`` with the TP split factor.
  With ``DataParallelMeshDims`` the parameter already lives on its full SPMD mesh; FSDP's shard takes
  the data-parallel shard dim of that mesh (strided when a later mesh dim also shards dim 0).
- the unsharded parameter is a DTensor with the original TP spec again (in the unsharded dtype), so
  the module computes exactly as under TP alone; its gradient is brought back to the TP placements
  (a ``Partial`` one reduced over TP) before FSDP reduce-scatters the local tensor.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from ..base import MeshInfo, ParamSpec, SpmdDims
from ._dtensor import DTensorSpec, local_in_placements, make_spec, strided_shard, wrap_local

__all__ = ["TPLayout", "sharded_spec"]


class TPLayout:
    """A tensor-parallel parameter's TP layout (see [Note: Tensor parallel]).

    Fields (fixed at ``fully_shard``):
    - ``spec``: the original parameter's DTensor spec: TP mesh, placements, global shape and stride,
      original dtype. Never the sharded parameter's spec (that one adds FSDP's placement).
    - ``dp_dims``: with ``DataParallelMeshDims``, the data-parallel dims of the parameter's own mesh;
      ``None`` for a 2-D/3-D mesh that ``fully_shard`` composed.
    """

    def __init__(self, spec: DTensorSpec, dp_dims: SpmdDims | None) -> None:
        self.spec = spec
        self.dp_dims = dp_dims

    def unsharded_spec(self, dtype: torch.dtype) -> DTensorSpec:
        """The TP spec of the unsharded parameter, in its (compute) ``dtype``."""
        tp = self.spec
        meta = tp.tensor_meta
        assert meta is not None, "a TP spec without tensor metadata"
        return make_spec(tp.mesh, tp.placements, meta.shape, meta.stride, dtype)

    def placeholder(self, local_size: torch.Size, dtype: torch.dtype, requires_grad: bool) -> nn.Parameter:
        """A meta TP DTensor parameter with a TP-local tensor of ``local_size``."""
        local = torch.empty(local_size, dtype=dtype, device="meta")
        return nn.Parameter(wrap_local(local, self.unsharded_spec(dtype)), requires_grad)

    def local_part(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's TP-local part of ``full`` (every rank holds ``full``: no communication)."""
        tp = self.spec
        return distribute_tensor(full, tp.mesh, tp.placements, src_data_rank=None).to_local()

    def local_grad(self, grad: DTensor) -> torch.Tensor:
        """The local gradient laid out like the TP parameter (a ``Partial`` gradient is reduced first)."""
        placements = self.spec.placements
        dims = self.dp_dims
        if dims is None:
            return local_in_placements(grad, placements)
        # Keep the data-parallel dims as autograd left them (Partial or Replicate): the reduce-scatter
        # of the local tensor averages over them; only the other dims follow the parameter.
        dp = dims.dp_indices
        target = tuple(grad.placements[i] if i in dp else p for i, p in enumerate(placements))
        # A gradient that autograd already summed over a data-parallel dim (Replicate there) would
        # be averaged as one rank's contribution: scale it to one, so every parameter gets the same
        # data-parallel mean (torch 2.13 leaves such gradients dp-size times too large).
        replicated = math.prod(grad.device_mesh.size(i) for i in dp if grad.placements[i].is_replicate())
        local = local_in_placements(grad, target)
        return local / replicated if replicated > 1 else local


def sharded_spec(
    spec: ParamSpec, tp: TPLayout | None, mesh_info: MeshInfo, dtype: torch.dtype
) -> DTensorSpec:
    """The spec of ``spec.param``'s sharded DTensor parameter (global shape and stride kept)."""
    param, shard_dim = spec.param, spec.shard_dim
    size, stride = param.size(), param.stride()
    shard = Shard(shard_dim)
    dp_placements = (Replicate(), shard) if mesh_info.is_hsdp else (shard,)
    if tp is None:
        if mesh_info.replicate_only:  # ``replicate``: every rank holds the whole tensor, as torch's
            return make_spec(mesh_info.mesh, (Replicate(),), size, stride, dtype)
        return make_spec(mesh_info.mesh, dp_placements, size, stride, dtype)
    if spec.dp_dims is not None:  # a DTensor on the full SPMD mesh (DataParallelMeshDims)
        dims = spec.dp_dims
        placements = tuple(tp.spec.placements)
        if dims.shard:
            placements = _spmd_sharded_placements(tp.spec, dims.shard[0])
        return make_spec(dims.sharded_mesh, dims.sharded_placements(placements), size, stride, dtype)
    assert spec.spmd_mesh is not None, f"{spec.owners[0][1]}: a DTensor parameter without its (dp, tp) mesh"
    placements = (*dp_placements[:-1], _dp_shard_placement(tp.spec, shard_dim), *tp.spec.placements)
    return make_spec(spec.spmd_mesh, placements, size, stride, dtype)


def _dp_shard_placement(tp_spec: DTensorSpec, shard_dim: int) -> Placement:
    """FSDP's placement on its shard mesh dim for a TP parameter: a strided shard when TP splits that dim.

    TP's shards of ``shard_dim`` come first (outer), FSDP's chunks of each TP-local tensor inside them,
    so FSDP's slices are interleaved ``split_factor`` ways across the global dim.
    """
    split_factor = 1
    for size, placement in zip(tp_spec.mesh.shape, tp_spec.placements, strict=True):
        if isinstance(placement, Shard) and placement.dim == shard_dim:
            split_factor *= size
    return strided_shard(shard_dim, split_factor) if split_factor > 1 else Shard(shard_dim)


def _spmd_sharded_placements(spec: DTensorSpec, shard_index: int) -> tuple[Placement, ...]:
    """The parameter's placements on its full mesh with FSDP's shard on the data-parallel shard dim.

    A later mesh dim that also shards dim 0 makes FSDP's a strided shard (split by those dims' sizes).
    """
    placements = list(spec.placements)
    split_factor = 1
    for index in range(shard_index + 1, len(placements)):
        placement = placements[index]
        if isinstance(placement, Shard) and placement.dim == 0:
            split_factor *= spec.mesh.size(index)
    placements[shard_index] = strided_shard(0, split_factor) if split_factor > 1 else Shard(0)
    return tuple(placements)
