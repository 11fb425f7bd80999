"""The pure parts of a memory-snapshot restore: the buddy ring, the choice of snapshot, the resharding
of every leaf from W old ranks onto W' new ones (against ``torch.chunk`` of the whole tensor), and the
snapshot file's check of its own bytes. The restore itself runs in tests/multiprocess/test_snapshots_gloo.py.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp2.param._layout import chunk_rows
from fsdp2.resilience._format import Leaf, LeafRef, RankSnapshot, decode, encode_header, fill
from fsdp2.resilience._reshard import Reshard
from fsdp2.resilience._restore import choose
from fsdp2.resilience._ring import Ring
from fsdp2.resilience._store import Listed, NodeStore


def test_ring_sends_each_node_to_the_next_and_one_node_to_none() -> None:
    ring = Ring.of(["a", "a", "b", "b", "c"])
    assert ring.buddy == (2, 3, 4, 4, 0)
    assert ring.kept_for(4) == [2, 3]
    assert ring.kept_for(1) == []
    assert [ring.is_leader(r) for r in range(5)] == [True, False, True, False, True]
    assert Ring.of(["a", "a"]).buddy == (None, None)


def _listed(step: int, world: int, ranks: list[int]) -> list[Listed]:
    return [Listed(step, rank, world, 7, 100) for rank in ranks]


def test_choose_takes_the_newest_step_whole_somewhere_and_reads_own_copies_first() -> None:
    # new rank 0 kept old ranks 0, 1 (own) and 2, 3 (buddy copies); the newer step 4 lacks old rank 3
    listings = [_listed(2, 4, [0, 1, 2, 3]) + _listed(4, 4, [0, 1, 2]), _listed(2, 4, [0, 1, 2, 3])]
    choice = choose(listings, set())
    assert not isinstance(choice, str)
    assert (choice.step, choice.old_world, choice.holder) == (2, 4, (0, 1, 0, 1))
    assert choose(listings, {(0, 2, 3), (1, 2, 3)}) == (
        "the newest snapshot, step 4 of 4 ranks, survives nowhere for rank(s) 3 (their node and their "
        "buddy's node are gone, or the snapshot was cut short)"
    )


def _snapshot(full: list[torch.Tensor], leaves: list[Leaf], world: int, rank: int) -> RankSnapshot:
    locals_ = [
        tensor if leaf.dim is None else tensor.narrow(leaf.dim, *_span(leaf, world, rank))
        for tensor, leaf in zip(full, leaves, strict=True)
    ]
    offsets, payload = [], []
    for tensor in locals_:
        offsets.append(sum(p.numel() for p in payload))
        raw = tensor.contiguous().view(-1).view(torch.uint8)
        payload += [raw, torch.zeros(-raw.numel() % 64, dtype=torch.uint8)]
    tree = {"model": {f"w{i}": LeafRef(i) for i in range(len(leaves))}, "rank": rank}
    return RankSnapshot(3, world, rank, leaves, offsets, tree, torch.cat(payload))


def _span(leaf: Leaf, world: int, rank: int) -> tuple[int, int]:
    assert leaf.dim is not None
    _, start, count = chunk_rows(leaf.shape[leaf.dim], world, rank)
    return start, count


@settings(max_examples=40, deadline=None)
@given(
    old_world=st.integers(1, 5),
    new_world=st.integers(1, 5),
    sizes=st.lists(st.integers(0, 9), min_size=1, max_size=3),
    dim=st.integers(0, 1),
    seed=st.integers(0, 2**16),
)
def test_every_new_rank_gets_torch_chunks_piece_of_every_leaf(
    old_world: int, new_world: int, sizes: list[int], dim: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.int64]
    full = [torch.randn(n, 3, generator=gen).to(dtypes[i % 3]).movedim(0, dim) for i, n in enumerate(sizes)]
    leaves = [Leaf(("model", f"w{i}"), t.dtype, tuple(t.shape), dim) for i, t in enumerate(full)]
    full.append(torch.tensor(5.0))  # a step count: whole on every rank
    leaves.append(Leaf(("optim", "step"), torch.float32, (), None))
    snapshots = {old: _snapshot(full, leaves, old_world, old) for old in range(old_world)}
    holder = tuple(old % new_world for old in range(old_world))
    plan = Reshard(tuple(leaves), old_world, new_world, holder)
    sent = {
        me: plan.outgoing(me, {old: snapshots[old] for old in plan.held_by(me)}) for me in range(new_world)
    }
    for me in range(new_world):
        tree, values = plan.incoming(me, [sent[sender][me] for sender in range(new_world)])
        assert tree["rank"] == me % old_world
        for tensor, leaf, value in zip(full, leaves, values, strict=True):
            expected = tensor if leaf.dim is None else tensor.narrow(leaf.dim, *_span(leaf, new_world, me))
            assert value.dtype == expected.dtype, leaf.name
            assert torch.equal(value, expected), leaf.name
        assert fill(tree["model"], values)["w0"] is values[0]


def test_a_damaged_snapshot_file_is_refused_and_a_whole_one_reads_back(tmp_path: Path) -> None:
    leaves = [Leaf(("model", "w"), torch.float32, (4, 2), 0)]
    snapshot = _snapshot([torch.arange(8.0).view(4, 2)], leaves, 2, 1)
    store = NodeStore(tmp_path, "job")
    store.write(3, 1, [encode_header(snapshot), memoryview(snapshot.payload.numpy())])
    assert torch.equal(store.read(3, 1).local(0), torch.tensor([[4.0, 5.0], [6.0, 7.0]]))
    assert store.listing() == ([Listed(3, 1, 2, store.listing()[0][0].fingerprint, 64)], [])
    data = bytearray(store.file(3, 1).read_bytes())
    data[-60] ^= 1
    store.file(3, 1).write_bytes(bytes(data))
    with pytest.raises(ValueError, match="CRC-32 mismatch"):
        store.read(3, 1)
    with pytest.raises(ValueError, match=r"cut short|not unpickle|payload bytes"):
        decode(bytes(data[:-10]), "cut")
    assert pickle.loads(pickle.dumps(leaves[0])) == leaves[0]
