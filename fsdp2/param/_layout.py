"""The sizes of one parameter's sharding: ``torch.chunk``-style pieces, padding, this rank's piece.

Owns: ``chunk_rows`` and ``padded_shard_numel`` (the arithmetic every rank and every tool agrees on)
and ``ShardLayout``, the fixed sizes of one parameter on its shard mesh, by which its local shard
(``_shard``) and its unsharded form (``_unsharded``) are laid out. Pure arithmetic: no tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["ShardLayout", "chunk_rows", "padded_shard_numel"]


def padded_shard_numel(size: torch.Size, shard_dim: int, world_size: int) -> int:
    """Elements of every rank's local shard of a tensor of ``size``.

    Dim-0 chunks are padded to chunk 0's rows; ``shard_dim > 0`` (evenly divisible) is an exact piece.
    """
    if shard_dim != 0:
        return math.prod(size) // world_size
    rows = size[0]
    row_numel = math.prod(size[1:])
    return chunk_rows(rows, world_size, 0)[0] * row_numel


def chunk_rows(rows: int, world_size: int, rank: int) -> tuple[int, int, int]:
    """``(padded_rows, start_row, local_rows)`` of ``rank``'s ``torch.chunk`` piece of ``rows`` rows."""
    padded = math.ceil(rows / world_size) if rows else 0
    start = min(rank * padded, rows)
    return padded, start, min(start + padded, rows) - start


@dataclass(frozen=True)
class ShardLayout:
    """How one parameter's tensor is cut across ``world`` ranks, seen from rank ``rank``.

    The tensor is the one FSDP shards: the original parameter, or its TP-local tensor under tensor
    parallelism. Every field is fixed at ``fully_shard`` (conversions change dtypes, never sizes).

    Fields:
    - ``orig_size`` / ``orig_stride`` / ``orig_numel``: that tensor's shape, stride and element count.
    - ``shard_dim``: the dim sharded (0: ``torch.chunk`` pieces padded to chunk 0; ``d > 0``: exact,
      evenly divisible pieces).
    - ``world`` / ``rank``: the shard mesh dim's size and this rank's coordinate on it.
    - ``row_numel``: elements per dim-0 row.
    - ``start_row``: this rank's first row (``shard_dim == 0``; 0 otherwise).
    - ``padded_shard_numel``: elements of every rank's padded local shard (all-gather input size).
    - ``local_shard_size`` / ``local_numel``: this rank's unpadded piece.
    """

    orig_size: torch.Size
    orig_stride: tuple[int, ...]
    orig_numel: int
    shard_dim: int
    world: int
    rank: int
    row_numel: int
    start_row: int
    padded_shard_numel: int
    local_shard_size: torch.Size
    local_numel: int

    @classmethod
    def of(cls, tensor: torch.Tensor, shard_dim: int, world: int, rank: int) -> ShardLayout:
        """The layout of ``tensor`` sharded on ``shard_dim`` (validated by ``fully_shard``)."""
        size = tensor.size()
        numel = tensor.numel()
        rows = size[0]
        row_numel = numel // rows if rows else math.prod(size[1:])
        start = 0
        if shard_dim == 0:
            _, start, local_rows = chunk_rows(rows, world, rank)
            local_size = torch.Size((local_rows, *size[1:]))
        else:  # even sharding on a later dim: no padding
            sizes = list(size)
            sizes[shard_dim] //= world
            local_size = torch.Size(sizes)
        return cls(
            orig_size=size,
            orig_stride=tensor.stride(),
            orig_numel=numel,
            shard_dim=shard_dim,
            world=world,
            rank=rank,
            row_numel=row_numel,
            start_row=start,
            padded_shard_numel=padded_shard_numel(size, shard_dim, world),
            local_shard_size=local_size,
            local_numel=local_size.numel(),
        )

    @property
    def unsharded_numel(self) -> int:
        """Elements of the all-gather output: ``world`` padded shards, rank blocks in order."""
        return self.world * self.padded_shard_numel

    @property
    def unevenly_sharded(self) -> bool:
        """Some rank's dim-0 shard is shorter than the padded shard (dim-0 sharding only)."""
        return self.shard_dim == 0 and self.orig_size[0] % self.world != 0

    @property
    def smallest_shard_numel(self) -> int:
        """The fewest real (unpadded) elements any rank's shard holds (the last rank's, on dim 0)."""
        if self.shard_dim != 0:
            return self.local_numel
        return chunk_rows(self.orig_size[0], self.world, self.world - 1)[2] * self.row_numel
