"""Worlds of thread ranks run one after another in one process do not share DTensor's plans.

torch's DTensor caches redistribution and sharding plans process-wide, keyed by meshes that compare
equal across threads with the same identifier; a new world's threads reuse the identifiers of an
earlier world's, so without ``fsdp2.testing`` clearing those caches a rank got another rank's plan:
with uneven shards, a collective of mismatched sizes or wrong values (seen with optimizer state
sliced across replicas, gathered in the second to fourth of several worlds). Here six worlds in turn
each gather a ``[7, 10]`` tensor sharded twice on dim 0 over a 2 x 2 mesh (rows 2, 2, 2, 1), the mesh
in rank order or transposed, and every rank must get the whole tensor back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from tests._harness import run_threaded

WHOLE = torch.arange(70.0).reshape(7, 10)


def _gather(order: list[int]) -> bool:
    mesh = DeviceMesh("cpu", torch.tensor(order).reshape(2, 2), mesh_dim_names=("a", "b"))
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    piece = WHOLE.tensor_split(2)[coordinate[0]].tensor_split(2)[coordinate[1]]
    sharded = DTensor.from_local(piece, mesh, [Shard(0), Shard(0)], shape=WHOLE.shape, stride=WHOLE.stride())
    return torch.equal(sharded.full_tensor(), WHOLE)


def test_worlds_in_turn_gather_uneven_shards_right() -> None:
    orders = [[0, 1, 2, 3], [0, 2, 1, 3]] * 3
    for order in orders:
        assert run_threaded(4, _gather, order) == [True] * 4, order
    assert not dist.is_initialized()
