"""Snapshots of optimizer state sharded across replicas restore exactly, at the same world and on fewer.

4 gloo ranks as 2 simulated nodes train an HSDP model (mesh (replicate 2, shard 2), rows 5 and 3: the
shards' replica slices uneven, some empty) with AdamW under ``fsdp2.shard_optimizer_across_replicas``
4 steps, with a snapshot of step 2: every rank holds its own slice of each state tensor. A restart on
the same 4 ranks (sliced again) restores step 2: parameters and optimizer state equal step 2's whole
tensors bit for bit, and 2 more steps equal the uninterrupted run's steps 3 and 4 bit for bit (the
restored state, cut as the parameter, is cut into slices by the next step). With the second node
lost, the 2 survivors restore the same step as plain HSDP (replicate 2, shard 1), equal to step 2's
whole tensors bit for bit; the unit test checks the row arithmetic for every layout in between.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from fsdp2.param import RowLayout
from fsdp2.resilience._format import Leaf, LeafRef, RankSnapshot, local_shape, position, rank_at, rows_of
from fsdp2.resilience._reshard import Reshard
from tests._harness import run_multiprocess
from tests.shared.snapshot_runs import received_from, train_step, whole
from tests.shared.snapshot_runs import snapshots as make_snapshots


def _model(layout: tuple[int, int], sliced: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import fsdp2

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    mesh = init_device_mesh("cpu", layout, mesh_dim_names=("replicate", "shard"))
    for layer in (model[0], model[2]):
        fsdp2.fully_shard(layer, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    if sliced:
        optim = fsdp2.shard_optimizer_across_replicas(model, optim)
    return model, optim


def _first_run(root: str) -> None:
    model, optim = _model((2, 2), sliced=True)
    snapshots = make_snapshots(root, model, optim, "slices")
    states = []
    for step in (1, 2, 3, 4):
        train_step(model, optim, step)
        if step == 2:
            sliced = [v for state in optim.state.values() for v in state.values() if isinstance(v, DTensor)]
            assert sliced
            assert all(v.placements[0] == v.placements[1] for v in sliced)
            snapshots.save(step)
            snapshots.wait()
        if step in (2, 4):
            states.append(whole(model, optim))
    snapshots.close()
    if dist.get_rank() == 0:
        torch.save(states, f"{root}/states.pt")


def _restart(root: str, layout: tuple[int, int], sliced: bool, tag: str) -> None:
    model, optim = _model(layout, sliced)
    train_step(model, optim, 9)  # a state to be overwritten
    snapshots = make_snapshots(root, model, optim, "slices")
    restored = snapshots.restore()
    states = [restored.step, whole(model, optim)]
    if dist.get_world_size() == 4:  # the same layout: training resumes as if never stopped
        for step in (3, 4):
            train_step(model, optim, step)
        states.append(whole(model, optim))
    snapshots.close()
    if dist.get_rank() == 0:
        torch.save(states, f"{root}/{tag}.pt")


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        assert torch.equal(got[name], value), name


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sliced_optimizer_snapshots_restore_bit_for_bit_sliced_and_as_plain_hsdp(tmp_path: Path) -> None:
    root = str(tmp_path)
    run_multiprocess(4, _first_run, root)
    step2, step4 = torch.load(tmp_path / "states.pt")
    run_multiprocess(4, _restart, root, (2, 2), True, "same")
    step, restored, resumed = torch.load(tmp_path / "same.pt")
    assert step == 2
    _assert_equal(restored, step2)
    _assert_equal(resumed, step4)
    for path in (tmp_path / "node1").rglob("*"):  # the second node is lost
        if path.is_file():
            path.unlink()
    run_multiprocess(2, _restart, root, (2, 1), False, "survivors")
    step, restored = torch.load(tmp_path / "survivors.pt")
    assert step == 2
    _assert_equal(restored, step2)


@pytest.mark.parametrize("rows", [0, 1, 5, 7, 12])
@pytest.mark.parametrize(("shards", "replicas"), [(2, 2), (1, 4), (3, 2), (2, 3)])
def test_slice_leaf_rows_are_dtensor_s_nested_chunks(rows: int, shards: int, replicas: int) -> None:
    """Each rank's piece is DTensor's (Shard(0), Shard(0)) block on the (shard, replicate) mesh."""
    world = shards * replicas
    leaf = Leaf(("optim",), torch.float32, (rows, 2), 0, shards, replicas)
    layout = rows_of(leaf, world)
    assert layout == RowLayout.nested(rows, shards, replicas)
    for rank in range(world):
        shard, replica = rank % shards, rank // shards  # (replicate, shard) mesh: rank r * S + s
        low, high = RowLayout.chunked(rows, shards).span(shard)
        start, stop = RowLayout.chunked(high - low, replicas).span(replica)
        assert layout.span(position(leaf, world, rank)) == (low + start, low + stop)
        assert rank_at(leaf, world, position(leaf, world, rank)) == rank
        assert local_shape(leaf, world, rank) == (stop - start, 2)


def _sliced_snapshot(whole: torch.Tensor, leaf: Leaf, world: int, rank: int) -> RankSnapshot:
    """Old rank ``rank``'s snapshot of a sliced leaf (its own rows) and a whole-held step count."""
    assert leaf.dim is not None
    start, stop = rows_of(leaf, world).span(position(leaf, world, rank))
    local = whole.narrow(leaf.dim, start, stop - start).contiguous().view(-1).view(torch.uint8)
    step = torch.tensor(2.0).view(1).view(torch.uint8)
    offset = local.numel() + (-local.numel() % 64)
    payload = torch.cat([local, torch.zeros(offset - local.numel(), dtype=torch.uint8), step])
    leaves = [leaf, Leaf(("optim", "step"), torch.float32, (), None)]
    tree = {"optim": [LeafRef(0), LeafRef(1)], "rank": rank}
    return RankSnapshot(2, world, rank, leaves, [0, offset], tree, payload)


@pytest.mark.parametrize("old", [(2, 2), (3, 1), (2, 3), (1, 2)])  # (replicas, shards)
@pytest.mark.parametrize("new", [(2, 2), (1, 2), (2, 1), (3, 1), (1, 3)])
@pytest.mark.parametrize("rows", [0, 1, 5, 7])
def test_sliced_leaves_reshard_onto_every_new_replica_as_torch_chunks_piece(
    old: tuple[int, int], new: tuple[int, int], rows: int
) -> None:
    old_world, new_world = old[0] * old[1], new[0] * new[1]
    whole = torch.arange(rows * 3, dtype=torch.float32).view(3, rows) if rows else torch.empty(3, 0)
    leaf = Leaf(("optim", "w"), whole.dtype, tuple(whole.shape), 1, old[1], old[0])
    snapshots = {rank: _sliced_snapshot(whole, leaf, old_world, rank) for rank in range(old_world)}
    holder = (torch.arange(old_world) * 5) % new_world  # readers scrambled
    plan = Reshard((leaf, snapshots[0].leaves[1]), old_world, new_world, holder, (new[1], None))
    sent = {me: plan.outgoing(me, {r: snapshots[r] for r in plan.held_by(me)}) for me in range(new_world)}
    for me in range(new_world):
        tree, values = plan.incoming(me, received_from(sent, me))
        want = torch.chunk(whole, new[1], dim=1) if rows else ()
        piece = me % new[1]
        expected = want[piece] if piece < len(want) else whole.narrow(1, 0, 0)
        assert torch.equal(values[0], expected), (me, old, new)
        assert torch.equal(values[1], torch.tensor(2.0))
        assert tree["rank"] == me % old_world
