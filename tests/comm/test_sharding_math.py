"""Dim-0 sharding math and the flat buffer layouts of the collectives (torch 2.13's ``fully_shard``'s).

No process group: the functions under test are pure.
"""

from __future__ import annotations

import pytest
import torch

from fsdp2.comm import _collectives
from fsdp2.comm._collectives import (
    AllGatherResult,
    all_gather_copy_in,
    foreach_all_gather_copy_out,
    reduce_scatter_copy_in,
    same_order_tail,
    view_out_shards,
)
from fsdp2.param._param import chunk_rows

# rows, world size -> local rows per rank (torch.chunk semantics: trailing ranks may be empty)
CHUNK_TABLE = [
    pytest.param(5, 2, (3, 2), id="5-over-2"),
    pytest.param(6, 4, (2, 2, 2, 0), id="6-over-4"),
    pytest.param(1, 2, (1, 0), id="1-over-2"),
    pytest.param(0, 3, (0, 0, 0), id="0-rows"),
    pytest.param(7, 1, (7,), id="7-over-1"),
    pytest.param(8, 4, (2, 2, 2, 2), id="8-over-4"),
    pytest.param(17, 128, (1,) * 17 + (0,) * 111, id="17-over-128"),
    pytest.param(10, 4, (3, 3, 3, 1), id="10-over-4"),
    pytest.param(9, 6, (2, 2, 2, 2, 1, 0), id="9-over-6"),
]


@pytest.mark.parametrize(("rows", "world_size", "expected"), CHUNK_TABLE)
def test_chunk_rows_table(rows: int, world_size: int, expected: tuple[int, ...]) -> None:
    results = [chunk_rows(rows, world_size, rank) for rank in range(world_size)]
    assert tuple(local for _, _, local in results) == expected
    padded = expected[0]
    assert all(p == padded for p, _, _ in results), "every rank pads to the size of chunk 0"
    starts = [start for _, start, _ in results]
    assert starts == [min(rank * padded, rows) for rank in range(world_size)]
    tensor = torch.arange(rows, dtype=torch.float32)
    chunks = torch.chunk(tensor, world_size) if rows else ()
    for rank, (_, start, local) in enumerate(results):
        expected_rows = chunks[rank] if rank < len(chunks) else tensor[:0]
        torch.testing.assert_close(tensor[start : start + local], expected_rows, rtol=0, atol=0)


def test_chunk_rows_weight_with_fewer_rows_than_ranks() -> None:
    # As torch.chunk splits it (and torch 2.13's fully_shard): a (1, 2) weight over 2 ranks gives
    # shards (1, 2) and (0, 2).
    assert [chunk_rows(1, 2, rank)[2] for rank in range(2)] == [1, 0]
    assert chunk_rows(1, 2, 1)[0] == 1, "the empty rank still pads to one row"


def test_all_gather_buffer_layout() -> None:
    # [rank 0: p0 | p1][rank 1: p0 | p1] with each block holding that rank's padded shard.
    world_size = 2
    p0 = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0, 0.0])]  # 5 rows, padded to 3
    p1 = [torch.tensor([10.0]), torch.tensor([11.0])]
    blocks = []
    for rank in range(world_size):
        output, local, split_sizes = all_gather_copy_in([p0[rank], p1[rank]], world_size, rank, torch.float32)
        assert split_sizes == [3, 1]
        assert output.numel() == 8
        torch.testing.assert_close(
            output[4 * rank : 4 * rank + 4], torch.cat([p0[rank], p1[rank]]), rtol=0, atol=0
        )
        blocks.append(local)
    gathered = torch.cat(blocks)
    torch.testing.assert_close(gathered, torch.tensor([1.0, 2, 3, 10, 4, 5, 0, 11]), rtol=0, atol=0)
    outputs = [torch.empty(6), torch.empty(2)]
    foreach_all_gather_copy_out(AllGatherResult(gathered, [3, 1], world_size, None, None), outputs)
    torch.testing.assert_close(outputs[0], torch.tensor([1.0, 2, 3, 4, 5, 0]), rtol=0, atol=0)
    torch.testing.assert_close(outputs[1], torch.tensor([10.0, 11]), rtol=0, atol=0)


def test_all_gather_copy_in_casts() -> None:
    inputs = [torch.tensor([1.0, 1.0 / 3.0], dtype=torch.float32)]
    output, local, _ = all_gather_copy_in(inputs, 3, 2, torch.bfloat16)
    assert output.dtype == local.dtype == torch.bfloat16
    torch.testing.assert_close(local, inputs[0].to(torch.bfloat16), rtol=0, atol=0)


def test_reduce_scatter_buffer_layout() -> None:
    # torch 2.13's reduce-scatter input layout (verified against torch): (5, 3) and (4,) over W=2.
    # Row 0 is rows 0-2 of the weight then b[0:2]; row 1 is rows 3-4, a zero row of padding, then
    # b[2:4].
    weight = torch.arange(15, dtype=torch.float32).view(5, 3)
    bias = torch.arange(100, 104, dtype=torch.float32)
    buffer = reduce_scatter_copy_in([weight, bias], 2, torch.float32).view(2, -1)
    expected_row0 = torch.cat([weight[0:3].reshape(-1), bias[0:2]])
    expected_row1 = torch.cat([weight[3:5].reshape(-1), torch.zeros(3), bias[2:4]])
    torch.testing.assert_close(buffer[0], expected_row0, rtol=0, atol=0)
    torch.testing.assert_close(buffer[1], expected_row1, rtol=0, atol=0)


def test_reduce_scatter_copy_in_casts_to_reduce_dtype() -> None:
    grad = torch.tensor([[1.0], [1.0 / 3.0], [2.0]])
    buffer = reduce_scatter_copy_in([grad], 2, torch.float16)
    assert buffer.dtype == torch.float16
    torch.testing.assert_close(buffer, torch.tensor([1.0, 1.0 / 3.0, 2.0, 0.0]).half(), rtol=0, atol=0)


def test_view_out_shards_skips_padding() -> None:
    # Rank 1 of (5, 3) and (4,) over W=2: 2 real rows (6 elements) of a 9-element padded shard.
    output = torch.arange(11, dtype=torch.float32)
    sizes = [torch.Size((2, 3)), torch.Size((2,))]
    views = view_out_shards(output, [9, 2], sizes)
    torch.testing.assert_close(views[0], torch.arange(6, dtype=torch.float32).view(2, 3), rtol=0, atol=0)
    torch.testing.assert_close(views[1], torch.tensor([9.0, 10.0]), rtol=0, atol=0)
    assert all(v.untyped_storage().data_ptr() == output.untyped_storage().data_ptr() for v in views)


def test_view_out_shards_empty_rank() -> None:
    # Rank 1 of a (1, 4) parameter over W=2 owns no rows: an empty (0, 4) view.
    views = view_out_shards(torch.arange(4, dtype=torch.float32), [4], [torch.Size((0, 4))])
    assert views[0].shape == (0, 4)


def _ring_chunk(world: int, row: int, rank: int, column: int, element_size: int) -> int:
    """The ring chunk holding ``(rank, column)`` of a ``(world, row)`` gloo buffer, element by element."""
    segments = _collectives._ring_segments(world, row, element_size)
    chunk = segments // world * -(-world * row // segments)
    return (rank * row + column) // chunk


@pytest.mark.parametrize("segment_bytes", [1 << 20, 64])  # 64: many segments per chunk, small rows
def test_same_order_tail_keeps_every_gradient_in_its_chunk(
    monkeypatch: pytest.MonkeyPatch, segment_bytes: int
) -> None:
    """[Note: Ring summation order]: with ``same_order_tail``'s columns every gradient element of every
    row stays in the chunk it has without a tail (torch's order), at most a segment's worth of zeros
    added; only rows narrower than the misalignment (odd and under ``W - 2``) have none."""
    monkeypatch.setattr(_collectives, "_RING_SEGMENT_BYTES", segment_bytes)
    for world in range(3, 9):
        for width in range(1, 120):
            for usage in (1, 2, 5):
                tail = same_order_tail(world, width, usage, 4)
                same = all(
                    _ring_chunk(world, width, j, c, 4) == _ring_chunk(world, width + tail, j, c, 4)
                    for j in range(world)
                    for c in range(width)
                )
                assert same or (width % 2 == 1 and width < world - 2 and tail == usage), (world, width)
                assert usage <= tail <= usage + segment_bytes // 4
    assert same_order_tail(2, 7, 3, 4) == 3  # two ranks: a + b == b + a, nothing to keep
