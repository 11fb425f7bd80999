"""``DataParallelMeshDims`` against torch's ``fully_shard`` in 4 real gloo processes.

torch 2.13's path for full SPMD meshes does not run on the threaded test backend, so the
differential check runs here: the same model and inputs through both implementations give the same
sharded placements and the same gradients for every parameter whose gradient autograd leaves
``Partial`` on the data-parallel dim, and both match the unsharded reference there. For the bias whose
gradient autograd already sums over the data-parallel dim (``Replicate``), torch's is the reference's
times the data-parallel size while fsdp2's equals the reference (see docs/differences.md).
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp2
from tests._harness import run_multiprocess
from tests.shared.dp_mesh import FeedForward, distribute_on

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def _grads(impl: str) -> dict[str, tuple[str, torch.Tensor, torch.Tensor]]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    ref = FeedForward()
    model = copy.deepcopy(ref)
    distribute_on(model, mesh, 1)
    if impl == "fsdp2":
        fsdp2.fully_shard(model, mesh=mesh, dp_mesh_dims=fsdp2.DataParallelMeshDims(shard="dp"))
    else:
        from torch.distributed.fsdp import DataParallelMeshDims, fully_shard

        fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    dp = mesh.get_local_rank("dp")
    local = torch.randn(4, 8, generator=torch.Generator().manual_seed(dp))
    model(DTensor.from_local(local, mesh, (Shard(0), Replicate()))).sum().backward()
    ref(local).sum().backward()
    for p in ref.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    out = {}
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        out[name] = (str(p.placements), p.grad.full_tensor(), q.grad)
    return out


def _compare() -> None:
    theirs = _grads("torch")  # first: run second in a process, torch's mesh-identity check refuses it
    ours = _grads("fsdp2")
    for name, (placements, grad, ref_grad) in ours.items():
        torch_placements, torch_grad, _ = theirs[name]
        assert placements == torch_placements, (name, placements, torch_placements)
        torch.testing.assert_close(grad, ref_grad, msg=lambda m, n=name: f"fsdp2 {n}: {m}")
        if name == "down.bias":  # autograd gave Replicate on dp: torch averages a sum
            torch.testing.assert_close(torch_grad, 2 * ref_grad, msg=lambda m: f"torch down.bias: {m}")
        else:
            torch.testing.assert_close(torch_grad, grad, msg=lambda m, n=name: f"torch vs fsdp2 {n}: {m}")
    gc.collect()


def test_dp_mesh_dims_placements_and_grads_match_torch() -> None:
    run_multiprocess(4, _compare)
