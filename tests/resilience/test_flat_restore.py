"""A restore's Python work does not grow with the world size (counted in lines, not timed).

Rank 1 of 64 and of 16,384 simulated ranks (torch's fake process group, ``tests/shared/simulated``)
restores a snapshot of as many old ranks, 8 ranks a node, of three ``Linear(64, 64)`` layers (FSDP):
``reshard_newest`` from its node's listing (its own file and its copy of the previous node's rank 1)
through the choice, the read and the exchange. The fake group's all-reduces return this rank's own
values and its exchanges move nothing, so the rest of the world is emulated: each old rank's lowest
bid is its own new rank's (every other rank lists its own file), this rank exchanges with itself alone
(what it receives is what it sends) and the leaf table's broadcast brings the table its own file has.
A Python pass over the old or the new ranks (the listings' object all-gather, a send or a priority per
rank) would add at least 16,320 lines at 16,384 ranks; the bound allowed is 20.
"""

from __future__ import annotations

import pytest

from tests.shared.simulated import fsdp2_lines

_RESTORE = """
_table = {}

def _emulate():
    import torch, torch.distributed as dist
    if getattr(dist, "_restore_emulated", False):
        return
    plain_reduce = dist.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        work = plain_reduce(tensor, op=op, group=group, async_op=async_op)
        world = dist.get_world_size(group)
        if op == dist.ReduceOp.MIN and tensor.numel() == world:  # the readers: every old rank its own
            torch.minimum(tensor, torch.arange(world), out=tensor)
        return work

    def all_to_all_single(output, tensor, *args, **kwargs):
        output.copy_(tensor)  # this rank sends to itself alone

    def broadcast_object_list(objects, src=None, group=None, device=None, group_src=None):
        objects[0] = _table[dist.get_world_size(group)]

    dist.all_reduce, dist.all_to_all_single = all_reduce, all_to_all_single
    dist.broadcast_object_list = broadcast_object_list
    dist._restore_emulated = True


def setup(world):
    import tempfile
    import torch, torch.distributed as dist, torch.nn as nn
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    import fsdp2
    from fsdp2.resilience._format import capture, encode_header, host_bytes
    from fsdp2.resilience._restore import reshard_newest
    from fsdp2.resilience._store import NodeStore

    _emulate()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(3)])
    for layer in model:
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
    tree = {"model": get_model_state_dict(model), "optim": {}, "state": {}}
    store = NodeStore(tempfile.mkdtemp(), "train", "j")
    for rank in ((1 - 8) % world, 1):  # the copy it keeps, then its own
        snapshot = capture(tree, 5, world, rank)
        store.write(5, rank, [encode_header(snapshot), host_bytes(snapshot.payload)])
    _table[world] = snapshot.leaves
    mine = [value.to_local() for value in tree["model"].values()]

    def run():
        done = reshard_newest(store, *store.listing(), dist.group.WORLD, model, 8)
        assert done.choice.step == 5 and done.choice.old_world == world, done
        assert done.choice.read_by(1) == [1]
        assert all(torch.equal(a, b) for a, b in zip(done.values, mine, strict=True))

    return run
"""


@pytest.mark.slow  # a fresh interpreter: about 20 s
def test_a_restore_runs_no_more_lines_at_16384_ranks_than_at_64() -> None:
    lines = fsdp2_lines(_RESTORE, (64, 16384))
    assert lines[64] > 300  # the restore ran fsdp2's code: the choice, the read, the exchange
    assert abs(lines[16384] - lines[64]) <= 20, lines
