"""Sharding and collective layouts over a simulated world (one process, a list of per-rank tensors).

Every rank's tensors are computed in this process; the collectives are replaced by their definition
(concatenate the per-rank blocks for an all-gather, sum row ``j`` of every rank's buffer for rank
``j``'s reduce-scatter output). What runs for real is fsdp2's sharding math and its copy-in,
copy-out and view-out functions.

DTensor as an oracle: ``distribute_tensor`` needs a process group, so it is not used here. The
sharding rule is checked instead against DTensor's own pure helpers, ``Shard._split_tensor`` and
``Shard.local_shard_size_and_offset``, which are what ``distribute_tensor`` uses to cut a tensor.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Shard

from fsdp2.comm._collectives import (
    AllGatherResult,
    ReduceOp,
    all_gather_copy_in,
    divide_factors,
    foreach_all_gather_copy_out,
    reduce_scatter_copy_in,
    view_out_shards,
)
from fsdp2.param._param import chunk_rows
from tests.strategies import (
    SimulatedGroup,
    float_dtypes,
    gather_dtypes,
    param_shapes,
    simulated_groups,
    world_sizes,
)

EXAMPLES = 60


def _padded_local_shard(tensor: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """This rank's rows of ``tensor``, flattened, zero-padded to the size of chunk 0 (as FSDPParam does)."""
    padded_rows, start, rows = chunk_rows(tensor.size(0), world_size, rank)
    row_numel = math.prod(tensor.shape[1:])
    shard = torch.zeros(padded_rows * row_numel, dtype=tensor.dtype)
    shard[: rows * row_numel].copy_(tensor.reshape(-1)[start * row_numel : (start + rows) * row_numel])
    return shard


def _chunk_or_empty(tensor: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    chunks = torch.chunk(tensor, world_size) if tensor.size(0) else ()
    return chunks[rank] if rank < len(chunks) else tensor[:0]


# ---- (i) chunk_rows and padding ------------------------------------------------------------------


@settings(max_examples=EXAMPLES * 2, deadline=None)
@given(shape=param_shapes(), world_size=world_sizes)
def test_local_rows_follow_torch_chunk(shape: torch.Size, world_size: int) -> None:
    tensor = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    chunk0_numel = _chunk_or_empty(tensor, world_size, 0).numel()
    for rank in range(world_size):
        padded_rows, start, rows = chunk_rows(shape[0], world_size, rank)
        expected = _chunk_or_empty(tensor, world_size, rank)
        torch.testing.assert_close(tensor[start : start + rows], expected, rtol=0, atol=0)
        shard = _padded_local_shard(tensor, world_size, rank)
        assert shard.numel() == padded_rows * math.prod(shape[1:]) == chunk0_numel
        torch.testing.assert_close(shard[: expected.numel()], expected.reshape(-1), rtol=0, atol=0)
        torch.testing.assert_close(shard[expected.numel() :], torch.zeros(shard.numel() - expected.numel()))


@settings(max_examples=EXAMPLES * 2, deadline=None)
@given(shape=param_shapes(), world_size=world_sizes)
def test_sharding_agrees_with_dtensor_shard0(shape: torch.Size, world_size: int) -> None:
    tensor = torch.arange(math.prod(shape), dtype=torch.float64).view(shape)
    padded_shards, pad_sizes = Shard(0)._split_tensor(tensor, world_size, with_padding=True)
    for rank in range(world_size):
        padded_rows, start, rows = chunk_rows(shape[0], world_size, rank)
        assert Shard.local_shard_size_and_offset(shape[0], world_size, rank) == (rows, start)
        assert padded_shards[rank].size(0) == padded_rows
        assert pad_sizes[rank] == padded_rows - rows
        torch.testing.assert_close(
            _padded_local_shard(tensor, world_size, rank), padded_shards[rank].reshape(-1), rtol=0, atol=0
        )


# ---- (ii) shard -> all-gather copy-in -> copy-out round trip ---------------------------------------


def _simulated_all_gather(shards_per_rank: list[list[torch.Tensor]], dtype: torch.dtype) -> AllGatherResult:
    """Copy-in on every simulated rank, then concatenate the rank blocks as the collective would."""
    world_size = len(shards_per_rank)
    blocks = []
    split_sizes: list[int] | None = None
    for rank, inputs in enumerate(shards_per_rank):
        output, local, splits = all_gather_copy_in(inputs, world_size, rank, dtype)
        assert output.numel() == world_size * local.numel()
        assert local.numel() == 0 or local.data_ptr() == output[rank * local.numel() :].data_ptr()
        expected_block = torch.cat([t.to(dtype) for t in inputs])
        torch.testing.assert_close(local, expected_block, rtol=0, atol=0)
        assert split_sizes is None or splits == split_sizes
        split_sizes = splits
        blocks.append(local.clone())
    assert split_sizes is not None
    return AllGatherResult(torch.cat(blocks), split_sizes, world_size, None, None)


@settings(max_examples=EXAMPLES, deadline=None)
@given(group=simulated_groups(dtypes=gather_dtypes), cast_to=st.one_of(st.none(), float_dtypes))
def test_all_gather_round_trips(group: SimulatedGroup, cast_to: torch.dtype | None) -> None:
    originals = group.originals()
    world = group.world_size
    # Mixed precision casts floating parameters in the copy-in; integer parameters travel as they are.
    dtype = cast_to if cast_to is not None and group.dtype.is_floating_point else group.dtype
    shards = [[_padded_local_shard(t, world, rank) for t in originals] for rank in range(world)]
    result = _simulated_all_gather(shards, dtype)
    outputs = [torch.full((world * s[0].numel(),), 7, dtype=dtype) for s in zip(*shards, strict=True)]
    foreach_all_gather_copy_out(result, outputs)
    for orig, output, per_rank in zip(originals, outputs, zip(*shards, strict=True), strict=True):
        torch.testing.assert_close(output[: orig.numel()], orig.reshape(-1).to(dtype), rtol=0, atol=0)
        # Row r of the (W, padded) output is rank r's padded shard: padding only trails each block.
        torch.testing.assert_close(output.view(world, -1), torch.stack(per_rank).to(dtype), rtol=0, atol=0)


# ---- (iii) reduce-scatter copy-in -> reduce -> view-out ------------------------------------------


def _simulated_reduce_scatter(buffers: list[torch.Tensor], rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s reduce-scatter output with fsdp2's op and divide factors (summed in ``dtype``)."""
    world_size = len(buffers)
    factors = divide_factors(world_size, dtype)
    rows = [b.view(world_size, -1)[rank] for b in buffers]
    if factors.predivide is not None:
        rows = [row / factors.predivide for row in rows]
    total = rows[0].clone()
    for row in rows[1:]:
        total += row  # in the reduce dtype, one rank at a time, as a ring or the threaded backend does
    if factors.op == ReduceOp.AVG:
        total /= world_size
    else:
        assert factors.op == ReduceOp.SUM
    if factors.postdivide is not None:
        total /= factors.postdivide
    return total


@settings(max_examples=EXAMPLES, deadline=None)
@given(group=simulated_groups(allow_empty=False))
def test_reduce_scatter_views_out_mean_chunks(group: SimulatedGroup) -> None:
    world, dtype = group.world_size, group.dtype
    per_rank_grads = [group.rank_grads(rank) for rank in range(world)]
    buffers = [reduce_scatter_copy_in(grads, world, dtype) for grads in per_rank_grads]
    # The integer-valued grads make every partial sum exact, so fp64 gives the exact mean.
    mean_grads = [
        (torch.stack([g[i] for g in per_rank_grads]).double().sum(0) / world).to(dtype)
        for i in range(len(group.shapes))
    ]
    padded_numels = [chunk_rows(s[0], world, 0)[0] * math.prod(s[1:]) for s in group.shapes]
    assert all(b.numel() == world * sum(padded_numels) for b in buffers)
    for rank in range(world):
        output = _simulated_reduce_scatter(buffers, rank, dtype)
        local_sizes = [torch.Size((chunk_rows(s[0], world, rank)[2], *s[1:])) for s in group.shapes]
        views = view_out_shards(output, padded_numels, local_sizes)
        for mean, view in zip(mean_grads, views, strict=True):
            torch.testing.assert_close(view, _chunk_or_empty(mean, world, rank))


@settings(max_examples=EXAMPLES, deadline=None)
@given(group=simulated_groups(allow_empty=False))
def test_reduce_scatter_copy_in_rows_are_padded_chunks(group: SimulatedGroup) -> None:
    world, dtype = group.world_size, group.dtype
    grads = group.rank_grads(0)
    buffer = reduce_scatter_copy_in([g.float() for g in grads], world, dtype).view(world, -1)
    for rank in range(world):
        expected = torch.cat([_padded_local_shard(g, world, rank) for g in grads])
        torch.testing.assert_close(buffer[rank], expected, rtol=0, atol=0)
