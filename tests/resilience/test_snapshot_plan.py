"""The pure parts of a memory-snapshot restore: the buddy ring, the choice of snapshot (made on one
thread per simulated rank, its all-reduces among the threads; a lost node's files read one by each
rank of its buddy node; and why there is none, damaged copies named apart from lost ones), the
resharding of every leaf from W old ranks onto W' new ones (against ``torch.chunk`` of the whole
tensor), also between HSDP and replicated layouts (rows cut on the shard dim only, replicas holding
the same piece), the snapshot file's check of its own bytes, a failed write that leaves nothing, and
the folders of one job. The restore itself runs in tests/resilience/test_snapshots_gloo.py.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fsdp2.resilience._format as file_format
import fsdp2.resilience._store as node_store
from fsdp2.param._layout import chunk_rows
from fsdp2.resilience._choice import Choice, Reduce, choose
from fsdp2.resilience._format import Leaf, LeafRef, RankSnapshot, decode, encode_header, fill
from fsdp2.resilience._reshard import Reshard
from fsdp2.resilience._ring import Ring, key_hash
from fsdp2.resilience._store import Listed, NodeStore
from tests.shared.snapshot_runs import received_from


def test_ring_sends_each_node_to_the_next_and_one_node_to_none() -> None:
    ring = Ring.of(["a", "a", "b", "b", "c"])
    assert ring.buddy == (2, 3, 4, 4, 0)
    assert ring.kept_for(4) == [2, 3]
    assert ring.kept_for(1) == []
    assert [ring.is_leader(r) for r in range(5)] == [True, False, True, False, True]
    assert Ring.of(["a", "a"]).buddy == (None, None)


def _listed(step: int, world: int, ranks: list[int]) -> list[Listed]:
    return [Listed(step, rank, world, 7, 100) for rank in ranks]


class _Threads:
    """All-reduces among ``world`` threads, each one rank: every rank puts its tensor down, all reduce."""

    def __init__(self, world: int) -> None:
        self.slots: list[Any] = [None] * world
        self.barrier = threading.Barrier(world, timeout=30)

    def reducer(self, rank: int) -> Reduce:
        def reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            stacked = torch.stack(self.slots)
            result = stacked.amax(0) if op == "max" else stacked.amin(0)
            self.barrier.wait()  # every rank has read the slots
            return tensor.copy_(result)

        return reduce


def _choose(
    listings: list[list[Listed]],
    dropped: Mapping[int, set[tuple[int, int]]] | None = None,
    damaged: Mapping[tuple[int, int], list[str]] | None = None,
    per_node: int = 1,
) -> Choice | str:
    """``choose`` on every new rank ``j`` of ``len(listings)`` (threads), ``listings[j]`` its node's files.

    Every rank's answer is the same; the readers come back as a tuple.
    """
    world, threads = len(listings), _Threads(len(listings))

    def run(rank: int) -> Any:
        place = (rank, world, per_node)
        mine = (dropped or {}).get(rank, set())
        choice = choose(listings[rank], mine, damaged or {}, place, threads.reducer(rank))
        return choice if isinstance(choice, str) else replace(choice, holder=tuple(choice.holder.tolist()))

    with ThreadPoolExecutor(world) as pool:
        answers = list(pool.map(run, range(world)))
    assert all(answer == answers[0] for answer in answers), answers
    return answers[0]


def test_choose_takes_the_newest_step_whole_somewhere_and_reads_own_copies_first() -> None:
    # new ranks 0 and 1 on one node kept old ranks 0, 1 (own) and 2, 3 (buddy copies); the newer step 4
    # lacks old rank 3
    listings = [_listed(2, 4, [0, 1, 2, 3]) + _listed(4, 4, [0, 1, 2]), _listed(2, 4, [0, 1, 2, 3])]
    choice = _choose(listings, per_node=2)
    assert not isinstance(choice, str)
    assert (choice.step, choice.old_world, choice.holder) == (2, 4, (0, 1, 0, 1))
    assert _choose(listings, {0: {(2, 3)}, 1: {(2, 3)}}, per_node=2) == (
        "the newest snapshot, step 4 of 4 ranks, survives nowhere for rank(s) 3 (their node and their "
        "buddy's node are gone, or the snapshot was cut short)"
    )


def test_a_lost_nodes_files_are_read_one_by_each_rank_of_its_buddy_node() -> None:
    """4 nodes of 8, node 1 lost: 24 new ranks, old node k's files on node k and on node k + 1."""
    ring = Ring.of([f"n{node}" for node in (0, 2, 3) for _ in range(8)])  # the new job's nodes
    old_node = [0, 2, 3]
    listings = []
    for rank in range(24):
        node = old_node[ring.node(rank)]
        kept = [*range(8 * node, 8 * node + 8), *range(8 * ((node - 1) % 4), 8 * ((node - 1) % 4) + 8)]
        listings.append(_listed(6, 32, kept))
    choice = _choose(listings, per_node=8)
    assert not isinstance(choice, str)
    # old 0-7 and 16-23 by their own numbers; old 8-15 from node 2's copies by new ranks 8-15 (their
    # own numbers too); old 24-31 from node 0's copies, old 24 + i by new rank i (priority 24 + i
    # against 40 + i on node 3)
    assert choice.holder == (*range(24), *range(8))
    # ranks 16-23 found their copies of old 16-23 damaged: node 2's files, old 16 + i by new rank 8 + i
    dropped = {rank: {(6, old) for old in range(16, 24)} for rank in range(16, 24)}
    again = _choose(listings, dropped, per_node=8)
    assert not isinstance(again, str)
    assert again.holder == (*range(16), *range(8, 16), *range(8))


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
    holder = torch.arange(old_world) % new_world
    plan = Reshard(tuple(leaves), old_world, new_world, holder)
    sent = {
        me: plan.outgoing(me, {old: snapshots[old] for old in plan.held_by(me)}) for me in range(new_world)
    }
    for me in range(new_world):
        tree, values = plan.incoming(me, received_from(sent, me))
        assert tree["rank"] == me % old_world
        for tensor, leaf, value in zip(full, leaves, values, strict=True):
            expected = tensor if leaf.dim is None else tensor.narrow(leaf.dim, *_span(leaf, new_world, me))
            assert value.dtype == expected.dtype, leaf.name
            assert torch.equal(value, expected), leaf.name
        assert fill(tree["model"], values)["w0"] is values[0]


def _cut(tensor: torch.Tensor, dim: int, shards: int, rank: int) -> torch.Tensor:
    _, start, count = chunk_rows(tensor.shape[dim], shards, rank % shards)
    return tensor.narrow(dim, start, count)


@settings(max_examples=40, deadline=None)
@given(
    old=st.tuples(st.integers(1, 3), st.integers(1, 3)),  # (replicas, shards)
    new=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    size=st.integers(0, 7),
    dim=st.integers(0, 1),
    seed=st.integers(0, 2**16),
)
def test_hsdp_and_replicated_leaves_reshard_on_their_shard_dim_onto_every_replica(
    old: tuple[int, int], new: tuple[int, int], size: int, dim: int, seed: int
) -> None:
    old_world, new_world = old[0] * old[1], new[0] * new[1]
    whole = torch.randn(size, 3, generator=torch.Generator().manual_seed(seed)).movedim(0, dim)
    leaf = Leaf(("model", "w0"), whole.dtype, tuple(whole.shape), dim, old[1])
    leaves = [leaf, Leaf(("optim", "step"), torch.float32, (), None)]
    snapshots = {}
    for rank in range(old_world):
        snapshot = _snapshot([whole, torch.tensor(2.0)], [replace(leaf, shards=None), leaves[1]], 1, 0)
        local = _cut(whole, dim, old[1], rank).contiguous().view(-1).view(torch.uint8)
        payload = snapshot.payload.clone()
        payload[: local.numel()] = local  # this rank's piece where the whole tensor was
        snapshots[rank] = RankSnapshot(3, old_world, rank, leaves, snapshot.offsets, snapshot.tree, payload)
        assert torch.equal(snapshots[rank].local(0), _cut(whole, dim, old[1], rank))
    holder = (torch.arange(old_world) * 7) % new_world
    plan = Reshard(tuple(leaves), old_world, new_world, holder, (new[1], None))
    sent = {me: plan.outgoing(me, {r: snapshots[r] for r in plan.held_by(me)}) for me in range(new_world)}
    for me in range(new_world):
        _, values = plan.incoming(me, received_from(sent, me))
        assert torch.equal(values[0], _cut(whole, dim, new[1], me)), (me, old, new)
        assert torch.equal(values[1], torch.tensor(2.0))


def test_a_damaged_snapshot_file_is_refused_and_a_whole_one_reads_back(tmp_path: Path) -> None:
    leaves = [Leaf(("model", "w"), torch.float32, (4, 2), 0)]
    snapshot = _snapshot([torch.arange(8.0).view(4, 2)], leaves, 2, 1)
    store = NodeStore(tmp_path, "train", "job")
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


def test_choose_names_damaged_copies_and_does_not_blame_lost_nodes_for_them() -> None:
    listings = [_listed(4, 2, [0]), _listed(4, 2, [0])]  # old rank 1: both copies damaged
    damaged = {(4, 1): [f"n{node}/step-4/rank-1.snap: CRC-32 mismatch" for node in (0, 1)]}
    assert _choose(listings, damaged=damaged) == (
        "the newest snapshot, step 4 of 2 ranks, has only damaged copies of rank(s) 1 "
        "(n0/step-4/rank-1.snap: CRC-32 mismatch; n1/step-4/rank-1.snap: CRC-32 mismatch)"
    )
    # a lost rank and a damaged one, each said as it is
    three = [_listed(4, 3, [0]), []]
    assert _choose(three, damaged=damaged) == (
        "the newest snapshot, step 4 of 3 ranks, survives nowhere for rank(s) 2 (their node and their "
        "buddy's node are gone, or the snapshot was cut short), and has only damaged copies of rank(s) 1 "
        "(n0/step-4/rank-1.snap: CRC-32 mismatch; n1/step-4/rank-1.snap: CRC-32 mismatch)"
    )
    # nothing readable at all, but files that were snapshots: lost, not absent
    every = {(4, r): [f"n0/step-4/rank-{r}.snap: not a snapshot"] for r in range(3)}
    assert _choose([[], []], damaged=every) == (
        "every snapshot file found is damaged: n0/step-4/rank-0.snap: not a snapshot; "
        "n0/step-4/rank-1.snap: not a snapshot; and 1 more"
    )


def test_a_file_whose_header_cannot_be_read_is_listed_as_damaged(tmp_path: Path) -> None:
    leaves = [Leaf(("model", "w"), torch.float32, (4, 2), 0)]
    snapshot = _snapshot([torch.arange(8.0).view(4, 2)], leaves, 2, 1)
    store = NodeStore(tmp_path, "train", "j")
    store.write(3, 1, [encode_header(snapshot), memoryview(snapshot.payload.numpy())])
    store.file(3, 1).write_bytes(b"garbage")
    why = f"{store.file(3, 1)} is not an fsdp2 snapshot file"
    assert store.listing() == ([], [node_store.Damaged(3, 1, why)])


def test_a_write_that_fails_part_way_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = open

    class Full:
        def __init__(self, path: Path) -> None:
            self.handle = real_open(path, "wb")

        def __enter__(self) -> Full:
            return self

        def __exit__(self, *exc: object) -> None:
            self.handle.close()

        def write(self, data: bytes) -> int:
            self.handle.write(data[:3])
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(file_format, "open", lambda path, mode: Full(path), raising=False)
    store = NodeStore(tmp_path, "train", "j")
    with pytest.raises(OSError, match="No space left"):
        store.write(2, 0, [b"header", b"payload"])
    assert [p.name for p in store.file(2, 0).parent.iterdir()] == []


def test_each_job_has_a_folder_of_its_own_and_discard_removes_the_empty_ones(tmp_path: Path) -> None:
    names = {node_store.job_folder(job) for job in ["a", "b", "a/b", "a_b", "a:b", "x" * 200, "x" * 201]}
    assert len(names) == 7
    assert "job-a" in names
    assert all("/" not in name for name in names)
    root = tmp_path / "fsdp2-snapshots-1000"
    first, second = (NodeStore(root, "train", job, owns_root=True) for job in ("a", "b"))
    first.write(1, 0, [b"x"])
    second.write(1, 0, [b"y"])
    assert first.directory == root / "train" / "job-a"
    assert first.others() == [second.directory]
    first.clear()
    assert second.file(1, 0).read_bytes() == b"y"  # the other job's snapshot stays, and its folders
    second.clear()
    assert list(tmp_path.iterdir()) == []  # the default root, emptied, goes too
    mine = NodeStore(tmp_path / "mine", "train", "a")  # the user's directory stays
    mine.write(1, 0, [b"x"])
    mine.clear()
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]
    assert not any((tmp_path / "mine").iterdir())


def test_a_ranks_ring_entries_come_from_three_nodes_at_16384_ranks() -> None:
    """At 16,384 ranks (2,048 nodes of 8) a rank's buddy, copies kept and leadership read 3 nodes' members."""
    keys = [f"host{rank // 8}:/dev/shm/s" for rank in range(16384)]
    ring = Ring.of(keys)
    rank = 8 * 700 + 3
    assert ring.buddy_of(rank) == 8 * 701 + 3
    assert ring.kept_for(rank) == [8 * 699 + 3]
    assert not ring.is_leader(rank)
    assert ring.members.cache_info().currsize == 3  # its own node, the next and the previous
    assert ring.buddy_of(16383) == 7
    assert ring.kept_for(0) == [16376]


def _reference_nodes(keys: list[str]) -> tuple[int, ...]:
    """Each rank's node, nodes numbered by their lowest rank: the plain Python way, for comparison."""
    number: dict[str, int] = {}
    return tuple(number.setdefault(key, len(number)) for key in keys)


@given(st.lists(st.sampled_from("abcdef"), min_size=1, max_size=40))
@settings(max_examples=60, deadline=None)
def test_the_ring_from_key_hashes_numbers_nodes_by_their_lowest_rank(keys: list[str]) -> None:
    hashes = torch.tensor([key_hash(key) for key in keys], dtype=torch.int64)
    ring = Ring.of_hashes(hashes)
    assert ring.node_of == _reference_nodes(keys)
    assert ring.nodes == len(set(keys))


def test_building_the_ring_runs_no_python_per_rank() -> None:
    """The same lines of the ring's code at 64 and at 16,384 ranks (counted, not timed)."""
    import sys

    import fsdp2.resilience._ring as ring_module

    def lines(world: int) -> int:
        hashes = torch.tensor([key_hash(f"host{rank // 8}") for rank in range(world)], dtype=torch.int64)
        count = [0]

        def local(frame: object, event: str, arg: object) -> object:
            count[0] += event == "line"
            return local

        def trace(frame: object, event: str, arg: object) -> object:
            return local if frame.f_code.co_filename == ring_module.__file__ else None  # type: ignore[attr-defined]

        sys.settrace(trace)
        try:
            ring = Ring.of_hashes(hashes)
            ring.buddy_of(1), ring.kept_for(1), ring.is_leader(1)
        finally:
            sys.settrace(None)
        return count[0]

    assert lines(16384) == lines(64)  # (at 8 ranks, one node: no buddy, fewer lines)
