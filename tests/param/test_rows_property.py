"""Row layouts and their routes over a simulated world (one process, a list of per-rank tensors).

Every route ``routes(a, b, rank)`` names the rows each rank sends and receives; here the moves are
made in this process (each received piece cut from the sender's local tensor, pieces joined in
order), and the result is compared with ``torch.chunk``'s pieces (or the whole tensor on an owner).
Layouts: rows chunked over W ranks, owned whole by one of them, chunked over W' ranks; any one to any
other and back is the identity, for uneven and empty shards and the rows on dim 0 or dim 1. The
owner choice is compared with the plain least-loaded scan it replaces.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp2.param import Piece, RowLayout, local_box, owners_by_load, routes
from fsdp2.param._layout import chunk_rows

EXAMPLES = 120
worlds = st.integers(min_value=1, max_value=7)


@st.composite
def layouts(draw: st.DrawFn, rows: int) -> RowLayout:
    world = draw(worlds)
    kind = draw(st.sampled_from(["owned", "chunked", "nested"]))
    if kind == "owned":
        return RowLayout.owned(rows, world, draw(st.integers(min_value=0, max_value=world - 1)))
    if kind == "nested":  # HSDP's shards cut again into replica slices
        return RowLayout.nested(rows, draw(st.integers(1, 4)), draw(st.integers(2, 3)))
    return RowLayout.chunked(rows, world)


def _expected(tensor: torch.Tensor, dim: int, layout: RowLayout, rank: int) -> torch.Tensor:
    """``rank``'s rows under ``layout``: its ``torch.chunk`` piece, the whole tensor, or none."""
    if layout.owner is not None:
        return tensor if rank == layout.owner else tensor.narrow(dim, 0, 0)
    if layout.inner > 1:  # torch.chunk's piece of torch.chunk's piece
        chunk, piece = divmod(rank, layout.inner)
        outer = RowLayout.chunked(layout.rows, layout.world // layout.inner)
        part = _expected(tensor, dim, outer, chunk)
        return _expected(part, dim, RowLayout.chunked(part.size(dim), layout.inner), piece)
    pieces = torch.chunk(tensor, layout.world, dim) if tensor.size(dim) else ()
    return pieces[rank] if rank < len(pieces) else tensor.narrow(dim, 0, 0)


def _move(locals_: list[torch.Tensor], dim: int, a: RowLayout, b: RowLayout) -> list[torch.Tensor]:
    """Every rank's rows under ``b``, made of the pieces the routes from ``a`` name."""
    ranks = len(locals_)
    out = []
    for rank in range(ranks):
        pieces = []
        for piece in routes(a, b, rank).receive:
            sent = routes(a, b, piece.peer).send  # the sender names the same piece for this rank
            assert [(p.start, p.stop) for p in sent if p.peer == rank] == [(piece.start, piece.stop)]
            first = a.span(piece.peer)[0]
            pieces.append(locals_[piece.peer].narrow(dim, piece.start - first, piece.rows))
        out.append(torch.cat(pieces, dim) if pieces else locals_[rank].narrow(dim, 0, 0))
    return out


@settings(max_examples=EXAMPLES, deadline=None)
@given(data=st.data(), rows=st.integers(min_value=0, max_value=20), dim=st.sampled_from([0, 1]))
def test_any_layout_to_any_other_and_back_is_the_identity(data: st.DataObject, rows: int, dim: int) -> None:
    a, b = data.draw(layouts(rows)), data.draw(layouts(rows))
    shape = [3, 3]
    shape[dim] = rows
    tensor = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    ranks = max(a.world, b.world)
    start = [_expected(tensor, dim, a, r) for r in range(ranks)]
    for rank in range(ranks):
        low, high = a.span(rank)
        torch.testing.assert_close(tensor.narrow(dim, low, high - low), start[rank], rtol=0, atol=0)
    there = _move(start, dim, a, b)
    for rank in range(ranks):
        torch.testing.assert_close(there[rank], _expected(tensor, dim, b, rank), rtol=0, atol=0)
    back = _move(there, dim, b, a)
    for rank in range(ranks):
        torch.testing.assert_close(back[rank], start[rank], rtol=0, atol=0)


@settings(max_examples=EXAMPLES, deadline=None)
@given(rows=st.integers(min_value=0, max_value=40), world=worlds, other=worlds)
def test_routes_name_only_the_ranks_exchanged_with(rows: int, world: int, other: int) -> None:
    chunked = RowLayout.chunked(rows, world)
    for rank in range(world):
        assert chunked.span(rank)[1] - chunked.span(rank)[0] == chunk_rows(rows, world, rank)[2]
        owned = RowLayout.owned(rows, world, rank)
        to_owner = routes(chunked, owned, rank)
        assert len(to_owner.receive) == sum(1 for r in range(world) if chunked.count(r))
        for peer in range(world):
            if peer != rank:  # a non-owner sends at most one piece and receives none
                assert len(routes(chunked, owned, peer).send) <= 1
                assert not routes(chunked, owned, peer).receive
    wider = RowLayout.chunked(rows, other)
    for rank in range(max(world, other)):
        for piece in routes(chunked, wider, rank).send:
            assert piece.rows > 0
            assert wider.count(piece.peer) > 0


@settings(max_examples=EXAMPLES, deadline=None)
@given(loads=st.lists(st.integers(min_value=0, max_value=50), max_size=12), world=worlds)
def test_owners_by_load_is_the_least_loaded_scan(loads: list[int], world: int) -> None:
    scanned = [0] * world
    expected = [0] * len(loads)
    for i in sorted(range(len(loads)), key=lambda i: (-loads[i], i)):
        expected[i] = min(range(world), key=lambda r: (scanned[r], r))
        scanned[expected[i]] += loads[i]
    assert owners_by_load(loads, world) == expected


class _Mesh:
    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape


class _Placed:
    """What ``local_box`` reads of a DTensor: its shape, mesh shape and placements."""

    def __init__(self, shape: tuple[int, ...], mesh: tuple[int, ...], placements: tuple[object, ...]) -> None:
        self.shape, self.device_mesh, self.placements = shape, _Mesh(mesh), placements

    def dim(self) -> int:
        return len(self.shape)


@settings(max_examples=EXAMPLES, deadline=None)
@given(rows=st.integers(min_value=0, max_value=9), outer=worlds, inner=worlds, dim=st.sampled_from([0, 1]))
def test_a_box_of_two_mesh_dims_is_chunked_twice(rows: int, outer: int, inner: int, dim: int) -> None:
    from torch.distributed.tensor import Replicate, Shard

    shape = [4, 4]
    shape[dim] = rows
    tensor = torch.arange(math.prod(shape)).view(shape)
    twice = _Placed(tuple(shape), (outer, inner), (Shard(dim), Shard(dim)))
    once = _Placed(tuple(shape), (outer, inner), (Replicate(), Shard(dim)))
    for i in range(outer):
        for j in range(inner):
            box = local_box(twice, (i, j))  # type: ignore[arg-type]
            assert box is not None
            block = _expected(tensor, dim, RowLayout.chunked(rows, outer), i)
            piece = _expected(block, dim, RowLayout.chunked(block.size(dim), inner), j)
            torch.testing.assert_close(tensor[box], piece, rtol=0, atol=0)
            box = local_box(once, (i, j))  # type: ignore[arg-type]
            assert box is not None
            torch.testing.assert_close(tensor[box], _expected(tensor, dim, RowLayout.chunked(rows, inner), j))


def test_routes_at_4096_ranks_name_only_their_peers() -> None:
    """Far more ranks than a test can run: a rank's routes list the ranks it exchanges rows with."""
    world, rows = 4096, 10_000
    chunked, owned = RowLayout.chunked(rows, world), RowLayout.owned(rows, world, 17)
    assert routes(chunked, owned, 3).send == (Piece(17, 9, 12),)
    assert routes(chunked, owned, 3).receive == ()
    gathered = routes(chunked, owned, 17).receive
    assert len(gathered) == -(-rows // 3)  # every rank holding rows: 3 each (the last ones none)
    assert routes(owned, chunked, 4000).receive == ()  # rows run out before rank 4000
    wider = RowLayout.chunked(rows, 5000)
    assert [p.peer for p in routes(chunked, wider, 1000).send] == [1500, 1501]
    assert owners_by_load([5] * 3 + [1], world) == [0, 1, 2, 3]
