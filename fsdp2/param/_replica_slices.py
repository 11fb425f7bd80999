"""Replica slices: each replica's part of a shard, for optimizer state sharded across replicas.

Owns: the slice layout (``slice_rows``: the rows of a local shard a replica steps, ``torch.chunk``'s
pieces over the replicas), the slice mesh (``slice_mesh``: the parameter's mesh with its shard dim
first and its replicate dim last), the DTensor spec of a slice (``slice_spec``: ``Shard(0)`` on every
dim of the slice mesh, the parameter's global shape), the slice row group (``slice_row_group``: all
``R x S`` ranks as one process group, numbered in the slices' row order, for the optimizers that
move rows between them), ``is_slice`` and ``accumulate_slice_grad`` (a reduced slice of the gradient
set or added as the parameter's ``.grad``). Does not own: the collectives that make or gather slices
(``group._replica_reduce``, ``optim._cross_replica``).

[Note: Replica slices]
HSDP keeps a parameter as ``(Replicate(), Shard(0))`` on a ``(replicate, shard)`` mesh: the ``S`` shard
ranks hold ``torch.chunk``'s row pieces, and the ``R`` replicas of a shard rank hold the same piece.
Sharding the optimizer across replicas cuts each of those pieces again into ``R`` ``torch.chunk``
pieces, replica ``r`` stepping the ``r``-th. As a DTensor that is ``(Shard(0), Shard(0))`` on the mesh
whose dims are ``(shard, replicate)``: DTensor cuts dim 0 over the first mesh dim, then each piece
over the second, which are exactly these rows. So a slice gradient's ``full_tensor()`` is the whole
gradient, and optimizer state saved from slices loads at any other layout through DCP (and the
other way round). Plain data parallelism (``replicate``: ``(Replicate(),)`` on one dim) slices over
that dim: ``(Shard(0),)`` on the same mesh. Over all ``R x S`` ranks a parameter's rows are
``RowLayout.nested(rows, S, R)``: rank ``(r, s)`` of the mesh is that layout's rank ``s R + r``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..base import MeshInfo
from ._dtensor import DTensorSpec, local_of, make_spec, wrap_local
from ._param import FSDPParam
from ._rows import RowGroup, RowLayout

__all__ = ["accumulate_slice_grad", "is_slice", "slice_mesh", "slice_row_group", "slice_rows", "slice_spec"]


def slice_rows(rows: int, info: MeshInfo) -> tuple[int, int]:
    """``[start, stop)``: the rows of a local shard of ``rows`` rows this replica steps."""
    rank = info.mesh.get_local_rank(info.replicate_mesh_dim)
    return RowLayout.chunked(rows, info.replicate_size).span(rank)


def slice_mesh(info: MeshInfo) -> DeviceMesh:
    """The mesh slices are DTensors on: ``(shard, replicate)``, or the replicate mesh alone.

    The 2-D one reuses the mesh's own shard and replicate process groups (no new group, no collective).
    """
    mesh = info.mesh
    if info.replicate_only:
        return mesh
    assert info.shard_mesh_dim is not None, "not an HSDP mesh"
    assert info.replicate_mesh_dim is not None, "not an HSDP mesh"
    assert info.replicate_group is not None, "an HSDP mesh info without its replicate group"
    ranks = mesh.mesh.permute(info.shard_mesh_dim, info.replicate_mesh_dim).contiguous()
    names = mesh.mesh_dim_names
    dim_names = None if names is None else (names[info.shard_mesh_dim], names[info.replicate_mesh_dim])
    return DeviceMesh.from_group(
        [info.shard_group, info.replicate_group], mesh.device_type, mesh=ranks, mesh_dim_names=dim_names
    )


def slice_row_group(info: MeshInfo) -> RowGroup:
    """All ranks of ``info``'s mesh as one process group, numbered as the slices' rows (``s R + r``).

    Collective over the mesh's ranks (a new process group) unless the mesh has no shard dim, whose
    replicate group already is that group.
    """
    mesh = info.mesh
    replicas = info.replicate_size
    if info.replicate_only:
        group, ranks = info.shard_group, mesh.mesh.reshape(-1).tolist()
    else:
        assert info.shard_mesh_dim is not None, "not an HSDP mesh"
        assert info.replicate_mesh_dim is not None, "not an HSDP mesh"
        ranks = mesh.mesh.permute(info.shard_mesh_dim, info.replicate_mesh_dim).reshape(-1).tolist()
        group = dist.new_group(sorted(ranks), use_local_synchronization=True)
    peers = tuple(dist.get_group_rank(group, rank) for rank in ranks)
    me = peers.index(dist.get_rank(group))
    return RowGroup(group, len(ranks) // replicas, replicas, peers, me)


def slice_spec(
    param: torch.Tensor, mesh: DeviceMesh, dtype: torch.dtype, shape: tuple[int, ...] | None = None
) -> DTensorSpec:
    """The DTensor spec of a slice of ``param`` in ``dtype``, on the slice mesh.

    ``shape``: the global shape when it is not the parameter's (a state tensor of the parameter's rows,
    such as Adafactor's row factor).
    """
    shape = param.shape if shape is None else torch.Size(shape)
    stride = tuple(torch.empty(shape, device="meta").stride())
    return make_spec(mesh, (Shard(0),) * mesh.ndim, shape, stride, dtype)


def is_slice(tensor: object, mesh: DeviceMesh) -> bool:
    """Whether ``tensor`` is a DTensor laid out as replica slices on ``mesh``."""
    return (
        isinstance(tensor, DTensor)
        and tensor.device_mesh == mesh
        and all(p == Shard(0) for p in tensor.placements)
        and len(tensor.placements) == mesh.ndim
    )


def accumulate_slice_grad(
    fsdp_param: FSDPParam, local_grad: torch.Tensor, mesh: DeviceMesh, info: MeshInfo
) -> None:
    """Set, or add in place into, ``fsdp_param``'s gradient as the replica slice ``local_grad``.

    A gradient laid out like the parameter (reduced before the optimizer was sharded, with no
    ``zero_grad`` since) gives its slice to the sum. Then the parameter's post-accumulate-grad hooks
    run, as for a shard gradient.
    """
    param = fsdp_param.sharded_param
    dtype = fsdp_param.local.grad_dtype or fsdp_param.local.dtype
    if local_grad.dtype != dtype:
        local_grad = local_grad.to(dtype)
    grad = param.grad
    if isinstance(grad, DTensor) and is_slice(grad, mesh):
        local_of(grad).add_(local_grad)
    else:
        if isinstance(grad, DTensor):  # laid out like the parameter: its slice of the rows
            start, stop = slice_rows(local_of(grad).shape[0], info)
            local_grad = local_of(grad).narrow(0, start, stop - start) + local_grad
        param.grad = wrap_local(local_grad, slice_spec(param, mesh, dtype))
    hooks = param._post_accumulate_grad_hooks  # noqa: SLF001 - no public accessor
    if hooks:
        for hook in tuple(hooks.values()):
            hook(param)
