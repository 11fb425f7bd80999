"""Row layouts: where the rows of a tensor live across ranks, and the routes between two layouts.

Owns: ``RowLayout`` (rows over W ranks as ``torch.chunk`` cuts them, or cut twice: into ``W / I``
chunks, each cut again into ``I``; or all rows on one owner rank), ``RowGroup`` (a process group
whose ranks hold rows as such a layout says, numbered in row order), ``routes`` (which rows each
rank sends to and receives from which rank, going from one layout to another), ``owners_by_load``
(an owner per item: the heaviest first, each to the least loaded rank), ``row_shard`` (the mesh dim
sharding a DTensor's rows, when that is its only sharding) and ``local_box`` (this rank's block of a
DTensor in the global tensor). Pure arithmetic on sizes and placements: no tensors move here (the
exchange is ``comm._exchange``'s). Does not own: the padded shard sizes of the engine
(``_layout``), what travels or how it is packed.

[Note: Routes cost what they move]
A layout is four integers, never a list of W entries: rank ``r``'s rows are ``[r c, (r + 1) c)``
clipped to the row count (``c = ceil(rows / W)``), so the ranks of another layout that a span meets
are one ``range`` found by two divisions. A layout cut twice (HSDP's shards cut again into replica
slices, ``param._replica_slices``) numbers its ``W`` ranks in row order (``s I + i``: the ``i``-th
piece of chunk ``s``); the ranks a span meets are still one ``range``, some of them holding no rows
(a short chunk's empty pieces), which ``routes`` leaves out. ``routes(a, b, rank)`` so lists only
the ranks this rank really exchanges rows with: one piece for a chunk going to its owner, W pieces
only on the owner that gathers W chunks. Routes are cached per ``(a, b, rank)``; layouts used every
step cost nothing after the first. Owners come off a heap of at most ``min(items, W)`` ranks (a rank
past the item count is never the least loaded one with the lowest number).
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from torch.distributed.tensor import DTensor, Replicate, Shard

T = TypeVar("T")

__all__ = ["Piece", "Routes", "RowGroup", "RowLayout", "local_box", "owners_by_load", "routes", "row_shard"]


@dataclass(frozen=True)
class RowLayout:
    """``rows`` rows over ``world`` ranks: ``torch.chunk``'s pieces, or all of them on rank ``owner``.

    ``inner > 1``: cut twice, into ``world / inner`` chunks, each chunk into ``inner`` pieces; rank
    ``s * inner + i`` holds the ``i``-th piece of chunk ``s``.
    """

    rows: int
    world: int
    owner: int | None = None
    inner: int = 1

    @classmethod
    def chunked(cls, rows: int, world: int) -> RowLayout:
        return cls(rows, world)

    @classmethod
    def owned(cls, rows: int, world: int, owner: int) -> RowLayout:
        return cls(rows, world, owner)

    @classmethod
    def nested(cls, rows: int, outer: int, inner: int) -> RowLayout:
        """``torch.chunk``'s ``outer`` pieces, each cut into ``inner`` (``outer * inner`` ranks)."""
        return cls(rows, outer * inner, None, inner)

    @property
    def step(self) -> int:
        """Rows of every chunk but the last ones (``ceil(rows / world)``; 0 for no rows; cut once)."""
        return -(-self.rows // self.world)

    def span(self, rank: int) -> tuple[int, int]:
        """``[start, stop)``: the rows ``rank`` holds."""
        if self.owner is not None:
            return (0, self.rows) if rank == self.owner else (0, 0)
        if self.inner > 1:
            chunk, piece = divmod(rank, self.inner)
            low, high = RowLayout(self.rows, self.world // self.inner).span(chunk)
            start, stop = RowLayout(high - low, self.inner).span(piece)
            return low + start, low + stop
        start = min(rank * self.step, self.rows)
        return start, min(start + self.step, self.rows)

    def count(self, rank: int) -> int:
        """How many rows ``rank`` holds."""
        start, stop = self.span(rank)
        return stop - start

    def holders(self, start: int, stop: int) -> range:
        """The ranks holding some of rows ``[start, stop)``, in row order (none for an empty range)."""
        if start >= stop:
            return range(0)
        if self.owner is not None:
            return range(self.owner, self.owner + 1)
        if self.inner > 1:
            return range(self._holder(start), self._holder(stop - 1) + 1)
        return range(start // self.step, (stop - 1) // self.step + 1)

    def _holder(self, row: int) -> int:
        """The rank holding ``row`` of a layout cut twice."""
        outer = RowLayout(self.rows, self.world // self.inner)
        chunk = row // outer.step
        low, high = outer.span(chunk)
        return chunk * self.inner + (row - low) // RowLayout(high - low, self.inner).step


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` (global numbering) exchanged with rank ``peer``."""

    peer: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Routes:
    """One rank's part of going from one layout to another: what it sends, what it receives.

    Both in ascending peer order (which is row order); a rank exchanges with itself like any other.
    """

    send: tuple[Piece, ...]
    receive: tuple[Piece, ...]


@functools.lru_cache(maxsize=65536)
def routes(a: RowLayout, b: RowLayout, rank: int) -> Routes:
    """The pieces ``rank`` sends (its rows under ``a``) and receives (its rows under ``b``).

    ``a`` and ``b`` cover the same rows; their world sizes may differ (W ranks to W' ranks), the ranks
    being numbered alike in both. Cost: the number of pieces (see [Note: Routes cost what they move]).
    """
    if a.rows != b.rows:
        raise ValueError(f"routes: layouts of {a.rows} and {b.rows} rows do not cover the same rows")
    return Routes(_pieces(a.span(rank), b), _pieces(b.span(rank), a))


def _pieces(span: tuple[int, int], other: RowLayout) -> tuple[Piece, ...]:
    start, stop = span
    out = []
    for peer in other.holders(start, stop):
        low, high = other.span(peer)
        if min(stop, high) > max(start, low):  # a rank of a short chunk may hold no rows
            out.append(Piece(peer, max(start, low), min(stop, high)))
    return tuple(out)


@dataclass(frozen=True)
class RowGroup:
    """A process group whose ranks hold rows as ``RowLayout.nested(rows, outer, inner)`` says.

    ``peers[p]``: the group rank of layout rank ``p`` (row order need not be the group's rank order);
    ``position``: this rank's layout rank. One shard group is ``outer`` its size, ``inner`` 1.
    """

    group: Any  # a torch.distributed ProcessGroup
    outer: int
    inner: int
    peers: tuple[int, ...]
    position: int

    def __hash__(self) -> int:  # not the W peers: a dict keyed by rings must not hash W integers
        return hash((self.outer, self.inner, self.position, len(self.peers)))

    def layout(self, rows: int) -> RowLayout:
        return RowLayout.nested(rows, self.outer, self.inner)

    def by_rank(self, per_position: Sequence[T]) -> list[T]:
        """``per_position`` (indexed by layout rank) reordered by group rank."""
        out = list(per_position)
        for position, value in enumerate(per_position):
            out[self.peers[position]] = value
        return out


def owners_by_load(loads: Sequence[int], world: int) -> list[int]:
    """An owner rank per item: the largest load first (ties: lower index) to the least loaded rank.

    Ties between ranks go to the lowest rank. Cached per ``(loads, world)``.
    """
    return list(_owners(tuple(loads), world))


@functools.lru_cache(maxsize=1024)
def _owners(loads: tuple[int, ...], world: int) -> tuple[int, ...]:
    heap = [(0, rank) for rank in range(min(len(loads), world))]  # already a heap: sorted
    owners = [0] * len(loads)
    for i in sorted(range(len(loads)), key=lambda i: (-loads[i], i)):
        load, rank = heap[0]
        owners[i] = rank
        heapq.heapreplace(heap, (load + loads[i], rank))
    return tuple(owners)


def row_shard(tensor: DTensor, dim: int = 0) -> int | None:
    """The mesh dim that shards ``tensor``'s ``dim`` when it is the only sharding, else ``None``.

    ``Shard(dim)`` on exactly one mesh dim and ``Replicate`` on every other (FSDP, HSDP's shard dim);
    ``_StridedShard`` (tensor parallelism under FSDP), ``Partial`` and other dims give ``None``.
    """
    placements = tensor.placements
    shards = [i for i, p in enumerate(placements) if type(p) is Shard]
    if len(shards) != 1 or placements[shards[0]] != Shard(dim):
        return None
    others = (p for i, p in enumerate(placements) if i != shards[0])
    return shards[0] if all(type(p) is Replicate for p in others) else None


def local_box(tensor: DTensor, coordinate: Sequence[int] | None = None) -> tuple[slice, ...] | None:
    """The slices of the global tensor this rank's local tensor holds (``None``: not Shard/Replicate).

    ``torch.chunk``'s split on each sharded mesh dim, as DTensor's (a dim sharded on two mesh dims is
    split twice, outer mesh dim first). ``coordinate``: the mesh coordinate to place (default: this
    rank's; call it then only on a rank of the tensor's mesh).
    """
    mesh, placements = tensor.device_mesh, tensor.placements
    if not all(type(p) in (Shard, Replicate) for p in placements):
        return None
    if coordinate is None:
        coordinate = mesh.get_coordinate()
    assert coordinate is not None, "local_box on a rank outside the mesh"
    starts, lengths = [0] * tensor.dim(), list(tensor.shape)
    for size, index, placement in zip(mesh.shape, coordinate, placements, strict=True):
        if isinstance(placement, Shard):
            start, stop = RowLayout.chunked(lengths[placement.dim], size).span(index)
            starts[placement.dim] += start
            lengths[placement.dim] = stop - start
    return tuple(slice(s, s + n) for s, n in zip(starts, lengths, strict=True))
