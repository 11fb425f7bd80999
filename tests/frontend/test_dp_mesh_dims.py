"""``DataParallelMeshDims``: parameters already DTensors on a full SPMD mesh (dp, tp) or (rep, shard, tp).

The feed-forward block's weights are distributed on the whole mesh (``Replicate()`` on the
data-parallel dims, column-/row-wise on ``tp``) and the input is a DTensor sharded over the batch on
the data-parallel dims. The reference is the plain model fed each data-parallel rank's batch with
gradients averaged over ranks. Every parameter matches it, the replicated bias included: torch 2.13
scales such gradients by the data-parallel size (shown in
``tests/frontend/test_dp_mesh_dims_gloo.py``, which also compares placements with torch).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import fsdp2
from tests._harness import run_threaded
from tests._training import TIGHT, seeded
from tests.shared.dp_mesh import DIM, FeedForward, distribute_on


def _mesh(shape: str) -> tuple[DeviceMesh, fsdp2.DataParallelMeshDims, int, int]:
    if shape == "2d":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        return mesh, fsdp2.DataParallelMeshDims(shard="dp"), 1, mesh.get_local_rank("dp")
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("rep", "shard", "tp"))
    dims = fsdp2.DataParallelMeshDims(shard="shard", replicate="rep")
    return mesh, dims, 2, mesh.get_local_rank("rep") * 2 + mesh.get_local_rank("shard")


def _train(shape: str) -> None:
    mesh, dims, n_dp, dp_index = _mesh(shape)
    ref = seeded(FeedForward)
    model = copy.deepcopy(ref)
    distribute_on(model, mesh, n_dp)
    fsdp2.fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    shard_index = n_dp - 1
    assert model.up.weight.placements[shard_index] == fsdp2.param._dtensor.strided_shard(0, 2)
    assert model.down.weight.placements[shard_index] == Shard(0)
    if n_dp == 2:
        assert model.up.weight.placements[0] == Replicate()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    batch_placements = (Shard(0),) * n_dp + (Replicate(),)
    for step in range(3):
        local = torch.randn(4, DIM, generator=torch.Generator().manual_seed(10 * dp_index + step))
        x = DTensor.from_local(local, mesh, batch_placements)
        loss = model(x).sum()
        loss.backward()
        ref_loss = ref(local).sum()
        ref_loss.backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        losses = [torch.zeros(()) for _ in range(dist.get_world_size())]
        dist.all_gather(losses, ref_loss.detach())
        # The DTensor loss sums every data-parallel rank's batch (tp ranks hold copies).
        torch.testing.assert_close(loss.full_tensor(), torch.stack(losses).sum() / 2, **TIGHT)
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(
                p.grad.full_tensor(), q.grad, **TIGHT, msg=lambda m, n=name: f"{n}: {m}"
            )
        for o in (optim, ref_optim):
            o.step()
            o.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q, **TIGHT, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(("shape", "world_size"), [("2d", 4), ("3d", 8)])
def test_dp_mesh_dims_trains_like_the_reference(shape: str, world_size: int) -> None:
    run_threaded(world_size, _train, shape)


def _errors() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"needs shard, replicate or both"):
        fsdp2.DataParallelMeshDims()
    plain = seeded(FeedForward)
    with pytest.raises(
        ValueError, match=r"must be a DTensor on fully_shard's mesh.*Linear\.weight is a plain tensor"
    ):
        fsdp2.fully_shard(plain, mesh=mesh, dp_mesh_dims=fsdp2.DataParallelMeshDims(shard="dp"))
    with pytest.raises(ValueError, match=r"names 'data', which is not a dim of the mesh"):
        fsdp2.fully_shard(plain, mesh=mesh, dp_mesh_dims=fsdp2.DataParallelMeshDims(shard="data"))
    model = seeded(FeedForward)
    distribute_on(model, mesh, 1)
    with pytest.raises(NotImplementedError, match=r"reshard_after_forward=2 \(an int\)"):
        fsdp2.fully_shard(
            model, mesh=mesh, dp_mesh_dims=fsdp2.DataParallelMeshDims(shard="dp"), reshard_after_forward=2
        )
    sharded_on_dp = seeded(FeedForward)
    distribute_on(sharded_on_dp, mesh, 1)
    sharded_on_dp.up.weight = nn.Parameter(
        distribute_tensor(torch.zeros(4 * DIM, DIM), mesh, (Shard(0), Shard(0)))
    )
    with pytest.raises(ValueError, match=r"must be Replicate\(\) on the data-parallel dim dp"):
        fsdp2.fully_shard(sharded_on_dp, mesh=mesh, dp_mesh_dims=fsdp2.DataParallelMeshDims(shard="dp"))
    other = fsdp2.FSDPMeshInfo(init_device_mesh("cpu", (4,)), shard_mesh_dim=0)
    with pytest.raises(ValueError, match=r"weight: with dp_mesh_dims, shard_placement_fn returned a Shard"):
        fsdp2.fully_shard(
            model,
            mesh=mesh,
            dp_mesh_dims=fsdp2.DataParallelMeshDims(shard="dp"),
            shard_placement_fn=lambda p: fsdp2.ShardPlacementResult(Shard(0), other),
        )
    assert not isinstance(model, fsdp2.FSDPModule)  # nothing changed by the refused calls
    fsdp2.fully_shard(model, mesh=mesh, dp_mesh_dims=fsdp2.DataParallelMeshDims(shard="dp"))


def test_dp_mesh_dims_errors() -> None:
    run_threaded(4, _errors)
