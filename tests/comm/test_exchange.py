"""The exchange floor on threaded ranks: ``comm.exchange``, ``pack``/``take`` and ``raise_everywhere``.

Tensors of several dtypes and sizes (empty ones too) reach their peers bit for bit; the counts travel
only when the receiver does not know them; known counts are checked with one all-reduce, and a rank
whose sizes are wrong makes every rank raise before the all-to-all; scratch buffers are reused; a
problem on one rank is raised on all of them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdp2.comm import Packed, Scratch, exchange, nbytes_of, raise_everywhere
from fsdp2.testing import count_collectives
from tests._harness import run_threaded

_DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float64)


def _tensor(sender: int, receiver: int, k: int) -> torch.Tensor:
    """The ``k``-th tensor ``sender`` sends ``receiver``: its size and dtype vary with all three."""
    numel = (sender * 3 + receiver * 5 + k) % 7  # 0 at times: empty pieces
    dtype = _DTYPES[(sender + receiver + k) % len(_DTYPES)]
    values = torch.arange(numel, dtype=torch.float64) + 100 * sender + 10 * receiver + k
    return values.to(dtype)


def _round_trip(known: bool, check: bool) -> dict[str, Any]:
    me, world = dist.get_rank(), dist.get_world_size()
    sends = [[_tensor(me, peer, k) for k in range(3)] for peer in range(world)]
    expect = None
    if known:
        expect = [
            sum(nbytes_of(t.shape, t.dtype) for t in (_tensor(s, me, k) for k in range(3)))
            for s in range(world)
        ]
    scratch = Scratch(torch.device("cpu"))
    with count_collectives() as counted:
        received = exchange(sends, None, expect=expect, scratch=scratch, check=check)
    for sender in range(world):
        for k in range(3):
            want = _tensor(sender, me, k)
            got = received.take(sender, want.shape, want.dtype)
            assert torch.equal(got, want), (sender, k)
    first = received.buffer.data_ptr()
    again = exchange([[t[:1] for t in ts] for ts in sends], None, scratch=scratch)
    return {"counts": dict(counted), "reused": again.buffer.data_ptr() == first}


@pytest.mark.parametrize(
    ("known", "check", "counts"),
    [
        (False, True, {"all_to_all": 2}),  # the counts, then the bytes
        (True, True, {"all_to_all": 1, "all_reduce": 1}),  # the bytes, one check
        (True, False, {"all_to_all": 1}),
    ],
)
def test_exchange_moves_every_piece_and_counts_only_unknown_sizes(
    known: bool, check: bool, counts: dict[str, int]
) -> None:
    for out in run_threaded(3, _round_trip, known, check):
        assert out["counts"] == counts
        assert out["reused"]


def _sparse_round() -> list[bool]:
    """Ranks send to their next rank only, named in mappings; the same bytes as the full lists."""
    me, world = dist.get_rank(), dist.get_world_size()
    peer, source = (me + 1) % world, (me - 1) % world
    mine = [_tensor(me, peer, k) for k in range(3)]
    theirs = [_tensor(source, me, k) for k in range(3)]
    expect = {source: sum(nbytes_of(t.shape, t.dtype) for t in theirs)}
    sparse = exchange({peer: mine}, None, expect=expect, mismatch="disagree")
    full = exchange([mine if r == peer else [] for r in range(world)], None)
    same = [torch.equal(sparse.buffer, full.buffer), torch.equal(sparse.part(source), full.parts[source])]
    same += [torch.equal(sparse.take(source, t.shape, t.dtype), t) for t in theirs]
    same += [sparse.part(r).numel() == 0 for r in range(world) if r != source]
    return same


def test_sends_and_sizes_may_name_only_the_peers_bytes_go_to() -> None:
    for same in run_threaded(3, _sparse_round):
        assert all(same), same


def _matrix(dtype: torch.dtype, width: int) -> torch.Tensor:
    return (torch.arange(6 * width, dtype=torch.float64) * 1.25 - 7).to(dtype).view(6, width)


def _gathered_rows() -> list[bool]:
    """Each rank's two rows of a matrix to rank 0, taken there at once by ``take_rows``."""
    me, world = dist.get_rank(), dist.get_world_size()
    fp32, bf16 = _matrix(torch.float32, 4), _matrix(torch.bfloat16, 3)  # bf16 rows of 6 bytes: padded
    mine32, mine16 = fp32[2 * me : 2 * me + 2], bf16[2 * me : 2 * me + 2]
    size32, size16 = nbytes_of((2, 4), torch.float32), nbytes_of((2, 3), torch.bfloat16)
    alone = exchange({0: [mine32]}, None, expect={r: size32 for r in range(world)} if me == 0 else {})
    mixed = exchange(
        {0: [mine32, mine16]}, None, expect={r: size32 + size16 for r in range(world)} if me == 0 else {}
    )
    if me:
        return [True]
    ranks = list(range(world))
    joined = alone.take_rows(ranks, [2] * world, 4, torch.float32)  # back to back: one view
    shares = joined.untyped_storage().data_ptr() == alone.buffer.untyped_storage().data_ptr()
    reversed_ = mixed.take_rows(ranks[::-1], [2] * world, 4, torch.float32)  # not back to back: a copy
    padded_ = mixed.take_rows(ranks, [2] * world, 3, torch.bfloat16)  # padded pieces: a copy
    want_reversed = torch.cat([fp32[2 * r : 2 * r + 2] for r in ranks[::-1]])
    empty = mixed.take_rows([], [], 4, torch.float32)
    return [
        shares,
        torch.equal(joined, fp32),
        torch.equal(reversed_, want_reversed),
        reversed_.untyped_storage().data_ptr() != mixed.buffer.untyped_storage().data_ptr(),
        torch.equal(padded_, bf16),
        empty.shape == (0, 4),
    ]


def test_take_rows_joins_pieces_back_to_back_as_one_view() -> None:
    for same in run_threaded(3, _gathered_rows):
        assert all(same), same


def _scattered_rows() -> bool:
    """Rank 0's matrix, two rows to each rank, sent as its bytes as they are (``Packed``)."""
    me, world = dist.get_rank(), dist.get_world_size()
    whole = _matrix(torch.float32, 4)
    sends: Any = {}
    if me == 0:
        sends = Packed(whole.view(-1).view(torch.uint8), {r: 32 for r in range(world)})
    received = exchange(sends, None, expect={0: 32})
    return torch.equal(received.take(0, (2, 4), torch.float32), whole[2 * me : 2 * me + 2])


def test_packed_sends_reach_each_rank() -> None:
    assert all(run_threaded(3, _scattered_rows))


@pytest.mark.parametrize(
    ("nbytes", "sizes", "match"),
    [
        (24, {0: 12, 1: 12}, "multiples of 8 bytes"),
        (32, {1: 16, 0: 16}, "ascending rank order"),
        (32, {0: 16, 1: 8}, "adding up to 24"),
    ],
)
def test_packed_sends_that_do_not_add_up_raise_before_anything_travels(
    nbytes: int, sizes: dict[int, int], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        exchange(Packed(torch.zeros(nbytes, dtype=torch.uint8), sizes), None)


def _wrong_size() -> None:
    me, world = dist.get_rank(), dist.get_world_size()
    sends = [[torch.ones(4)] for _ in range(world)]
    expect = [16] * world
    if me == 2:
        sends[0] = [torch.ones(5)]  # rank 0 expects 16 bytes from rank 2
    with pytest.raises(RuntimeError, match="disagree on what to move"):
        exchange(sends, None, expect=expect, mismatch="disagree on what to move")


def test_a_wrong_size_raises_on_every_rank() -> None:
    run_threaded(4, _wrong_size)


def _problems(kind: str, flag_first: bool = False) -> tuple[str, dict[str, int]]:
    me = dist.get_rank()
    problem = {"none": "", "one": "bad" if me == 1 else "", "two": f"bad {me}" if me in (0, 2) else ""}[kind]
    device = torch.device("cpu") if flag_first else None
    with count_collectives() as counted:
        try:
            raise_everywhere(problem, None, lambda text: ValueError(f"what: {text}"), device=device)
        except ValueError as error:
            return str(error), dict(counted)
    return "", dict(counted)


def test_raise_everywhere_raises_one_problem_on_every_rank() -> None:
    assert [text for text, _ in run_threaded(3, _problems, "none")] == ["", "", ""]
    assert [text for text, _ in run_threaded(3, _problems, "one")] == ["what: bad"] * 3
    named = "what: rank 0: bad 0 rank 2: bad 2"
    assert [text for text, _ in run_threaded(3, _problems, "two")] == [named] * 3
    assert [text for text, _ in run_threaded(1, _problems, "one")] == [""]


def test_raise_everywhere_with_a_device_gathers_messages_only_on_a_problem() -> None:
    for text, counts in run_threaded(3, _problems, "none", True):
        assert (text, counts) == ("", {"all_reduce": 1})
    for text, counts in run_threaded(3, _problems, "one", True):
        assert text == "what: bad"
        assert counts["all_reduce"] == 1
