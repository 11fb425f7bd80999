"""``clip_grad_norm_`` over gradients on two meshes: the dense mesh and the experts' ``(efsdp, ep)`` mesh.

Model (``tests/shared/ep_layout.py``): 2 mixture-of-experts blocks on 4 thread ranks, routers and the
root's layers sharded over the dense mesh (4 ranks), stacked experts placed on ``ep`` 2 and sharded
over ``efsdp`` 2: the gradients are DTensors on the ``dp`` mesh and on the ``(efsdp, ep)`` mesh. With 2
experts each ``ep`` rank holds one, and one ``efsdp`` rank of each pair holds no row of it (an empty
shard).

- ``fsdp2.clip_grad_norm_`` (2-norm and inf-norm): the total norm equals the unsharded reference's
  (gradients averaged over the 4 ranks' batches), the clipped gradients equal the reference's, and
  an SGD step (sensitive to the gradient scale) gives the reference's parameters.
- ``torch.nn.utils.clip_grad_norm_`` on the same gradients, whether ``fsdp2`` or torch's
  ``fully_shard`` made them, raises torch 2.13's ``RuntimeError`` (one ``stack`` over norms on two
  meshes, pytorch#180346; docs/differences.md).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fsdp2
from tests._harness import run_threaded
from tests.shared import ep_layout

WORLD, EP, MAX_NORM = 4, 2, 0.1


def _clip(experts: int, norm_type: float) -> dict[str, int]:
    mesh, dense = ep_layout.meshes(EP)
    model = ep_layout.shard(ep_layout.build(experts), mesh, dense)
    ref = ep_layout.build(experts)
    ep_layout.loss_of(model(ep_layout.batch(dist.get_rank(), 0))).backward()
    ep_layout.reference_backward(ref, WORLD, 0)
    meshes = {p.grad.device_mesh.mesh_dim_names for p in model.parameters() if p.grad is not None}
    assert meshes == {("dp",), ("efsdp", "ep")}
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM, norm_type=norm_type)
    total = fsdp2.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type=norm_type)
    assert type(total) is torch.Tensor
    torch.testing.assert_close(total, want)
    assert want > MAX_NORM  # the gradients were scaled down
    grads = ep_layout.full_grads(model)
    for name, grad in ep_layout.full_grads(ref).items():
        torch.testing.assert_close(grads[name], grad, msg=lambda m, n=name: f"{n}: {m}")
    for module in (model, ref):
        torch.optim.SGD(module.parameters(), lr=1.0).step()
    params = ep_layout.full_params(model)
    for name, param in ep_layout.full_params(ref).items():
        torch.testing.assert_close(params[name], param, msg=lambda m, n=name: f"{n}: {m}")
    return {
        "empty_expert_shards": sum(
            p.to_local().numel() == 0 for name, p in model.named_parameters() if ".experts." in name
        )
    }


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=["2-norm", "inf-norm"])
@pytest.mark.parametrize("experts", [4, 2], ids=["rows-everywhere", "empty-shard"])
def test_fsdp2_clip_over_dense_and_expert_meshes_matches_reference(experts: int, norm_type: float) -> None:
    results = run_threaded(WORLD, _clip, experts, norm_type)
    # With 2 experts, one efsdp rank of each pair holds no row of either block's w1 and w2.
    assert sorted(r["empty_expert_shards"] for r in results) == ([0] * 4 if experts == 4 else [0, 0, 4, 4])


def _torch_clip(impl: str) -> None:
    mesh, dense = ep_layout.meshes(EP)
    model = ep_layout.shard(ep_layout.build(4), mesh, dense, impl)
    ep_layout.loss_of(model(ep_layout.batch(dist.get_rank(), 0))).backward()
    before = ep_layout.full_grads(model)
    with pytest.raises(RuntimeError, match="must have the same mesh"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    for name, grad in ep_layout.full_grads(model).items():  # it raised before scaling anything
        assert torch.equal(grad, before[name]), name


@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
def test_torch_clip_fails_on_gradients_over_two_meshes(impl: str) -> None:
    run_threaded(WORLD, _torch_clip, impl)
