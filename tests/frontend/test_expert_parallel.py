"""Experts placed on an ``ep`` mesh by the user, sharded by ``fully_shard`` over their own mesh.

As torchtitan does it: the stacked expert weights (``[E, F, D]``, like its ``GroupedExperts``) are
DTensors ``Shard(0)`` on ``mesh["ep"]`` of a ``(efsdp, ep)`` mesh; ``shard_placement_fn`` returns a
``ShardPlacementResult`` whose mesh info is over ``mesh["efsdp"]`` for them and over the dense
data-parallel mesh (all 4 ranks) for the rest. Each rank routes its own tokens; the experts of one
``ep`` rank compute on the tokens of every ``ep`` rank (gathered over ``ep``, their outputs summed
back), so ``ep`` ranks are data-parallel ranks of the dense parameters.

Checked on 4 thread ranks (efsdp 2 x ep 2; and HSDP: rep 2 x efsdp 1 x ep 2 for the experts, rep 2 x
dp 2 for the rest), with Shard(0) and Shard(1) of the local expert stack and with a stack of one local
expert over 2 efsdp ranks (an empty shard on one of them):
- default division: losses, gradients and parameters over 3 AdamW steps equal the single-process
  reference on the global batch (gradients averaged over all ranks); torch's ``fully_shard`` gives
  the same dense gradients and expert gradients ``ep`` times as large;
- torchtitan's settings (division off, loss summed over tokens and divided by the global token
  count): fsdp2's gradients equal torch's and the reference's (no double scaling);
- the placements (torch's), each block's two groups (the experts' collectives over efsdp, their
  average over ep too) and the mesh-info classes.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import fsdp2
from tests._harness import assert_sharded_parity, run_threaded
from tests._impls import get_impl
from tests._training import fill_deterministic_
from tests.shared.ep_layout import DIM, HIDDEN, TOKENS, MoE

EP = 2


class Net(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(MoE(experts) for _ in range(2))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(100 * step + rank))


def _loss(out: torch.Tensor, titan: bool) -> torch.Tensor:
    # torchtitan: summed over tokens, divided by the global token count; else this rank's mean.
    world = dist.get_world_size()
    return out.pow(2).sum() / (TOKENS * DIM * world) if titan else out.pow(2).mean()


def _place_experts(model: Net, mesh: DeviceMesh) -> None:
    """What torchtitan's ``ExpertParallel`` does to the weights: ``Shard(0)`` on ``ep``."""
    for layer in model.layers:
        experts = layer.experts
        for name, param in list(experts.named_parameters()):
            dt = distribute_tensor(param.detach(), mesh["ep"], [Shard(0)])
            setattr(experts, name, nn.Parameter(dt))
        layer.ep_group = mesh["ep"].get_group()


def _info(mesh: DeviceMesh) -> Any:
    return fsdp2.HSDPMeshInfo(mesh) if mesh.ndim == 2 else fsdp2.FSDPMeshInfo(mesh)


def _shard(impl_name: str, model: Net, expert_mesh: DeviceMesh, dense: DeviceMesh, placement: Shard) -> None:
    impl = get_impl(impl_name)
    if impl_name == "fsdp2":
        efsdp_info: Any = _info(expert_mesh)
        dense_info: Any = _info(dense)
        result: Any = fsdp2.ShardPlacementResult
    else:  # torch's private objects, as torchtitan builds them
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
        from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

        efsdp_info, dense_info, result = (
            _get_mesh_info(expert_mesh),
            _get_mesh_info(dense),
            ShardPlacementResult,
        )
    for layer in model.layers:
        experts = set(layer.experts.parameters())

        def place(param: nn.Parameter, experts: set[nn.Parameter] = experts) -> Any:
            if param in experts:
                return result(placement=placement, mesh_info=efsdp_info)
            return result(placement=Shard(0), mesh_info=dense_info)

        impl.fully_shard(layer, mesh=dense, shard_placement_fn=place)
    impl.fully_shard(model, mesh=dense)


def _meshes(hsdp: bool) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
    """The sparse mesh (its ``ep`` dim places the experts), the experts' data-parallel mesh, the dense mesh.

    ``hsdp``: as torchtitan with ``dp_replicate`` 2: sparse (rep 2, efsdp 1, ep 2), the experts over
    (rep, efsdp), the dense parameters over (rep 2, dp 2).
    """
    world = dist.get_world_size()
    if hsdp:
        mesh = init_device_mesh("cpu", (2, 1, EP), mesh_dim_names=("rep", "efsdp", "ep"))
        dense = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "dp"))
        return mesh, mesh["rep", "efsdp"], dense
    mesh = init_device_mesh("cpu", (world // EP, EP), mesh_dim_names=("efsdp", "ep"))
    return mesh, mesh["efsdp"], init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))


def _run(experts: int, placement: Shard, titan: bool, hsdp: bool = False) -> dict[str, Any]:
    mesh, expert_mesh, dense = _meshes(hsdp)
    ref = fill_deterministic_(Net(experts), scale=0.5)
    models = {}
    for impl_name in ("fsdp2", "torch"):
        model = copy.deepcopy(ref)
        _place_experts(model, mesh)
        _shard(impl_name, model, expert_mesh, dense, placement)
        if titan:  # torchtitan's disable_fsdp_gradient_division (gloo and threads lack PREMUL_SUM)
            for module in model.modules():
                if isinstance(module, get_impl(impl_name).FSDPModule):
                    module.set_gradient_divide_factor(1.0)
                    if impl_name == "torch":
                        module.set_force_sum_reduction_for_comms(True)
        models[impl_name] = model
    ours, theirs = models["fsdp2"], models["torch"]
    w1, torch_w1 = ours.layers[0].experts.w1, theirs.layers[0].experts.w1
    out: dict[str, Any] = {
        "placements": (tuple(w1.device_mesh.mesh_dim_names or ()), tuple(map(str, w1.placements))),
        "torch_placements": (
            tuple(torch_w1.device_mesh.mesh_dim_names or ()),
            tuple(map(str, torch_w1.placements)),
        ),
        "local_shape": tuple(w1.to_local().shape),
        "torch_local_shape": tuple(torch_w1.to_local().shape),
        # (shard ranks, replicate ranks, outer data-parallel ranks) of each group of a block
        "groups": sorted(
            (g.mesh_info.shard_size, g.mesh_info.replicate_size, g.mesh_info.outer_data_parallel)
            for g in ours.layers[0]._get_fsdp_state().groups
        ),
    }
    rank = dist.get_rank()
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    optim = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    torch_optim = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    for step in range(3):
        losses = [_loss(m(_batch(rank, step)), titan) for m in (ours, theirs, ref)]
        for loss in losses:
            loss.backward()
        # The reference's gradient: of the mean (or the token-normalised sum) over every rank's batch.
        for param in ref.parameters():
            assert param.grad is not None
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM if titan else dist.ReduceOp.AVG)
        if step == 0 or titan:  # with default division torch's steps follow its larger expert gradients
            torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
        torch.testing.assert_close(losses[0], losses[2])
        if step == 0:
            assert_sharded_parity(ref, ours, grads=True)
            out["ratios"] = _torch_over_ours(ours, theirs)
        for optimizer in (optim, ref_optim, torch_optim):
            optimizer.step()
            optimizer.zero_grad()
    assert_sharded_parity(ref, ours)
    return out


def _torch_over_ours(ours: nn.Module, theirs: nn.Module) -> dict[str, float]:
    """For each parameter: torch's gradient over fsdp2's (one number when they are proportional)."""
    ratios = {}
    for (name, mine), (_, other) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert isinstance(mine.grad, DTensor)
        assert isinstance(other.grad, DTensor)
        a, b = mine.grad.full_tensor(), other.grad.full_tensor()
        ratio = (b.norm() / a.norm()).item()
        torch.testing.assert_close(b, a * ratio, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
        ratios[name] = ratio
    return ratios


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize(
    ("experts", "placement"),
    [(4, Shard(0)), (4, Shard(1)), (2, Shard(0))],  # the last: one local expert over 2 efsdp ranks
    ids=["shard0", "shard1", "empty-shard"],
)
@pytest.mark.parametrize("titan", [False, True], ids=["default-division", "torchtitan-division-off"])
def test_experts_on_ep_mesh_train_like_the_reference(experts: int, placement: Shard, titan: bool) -> None:
    results = run_threaded(4, _run, experts, placement, titan)
    local_experts = experts // EP
    for result in results:  # torch's layout: one DTensor over (efsdp, ep), FSDP's shard on efsdp
        assert result["placements"] == result["torch_placements"]
        assert result["local_shape"] == result["torch_local_shape"]
    assert results[0]["placements"][0] == ("efsdp", "ep")
    assert results[0]["groups"] == [(2, 1, EP), (4, 1, 1)]  # experts: over efsdp, averaged over ep too
    if placement.dim == 0:  # FSDP's rows of each ep rank's stack (a strided shard of the global dim 0)
        rows = [r["local_shape"][0] for r in results]
        assert sorted(rows) == sorted([-(-local_experts // 2), local_experts // 2] * 2)
    else:
        assert results[0]["placements"][1] == ("S(1)", "S(0)")
        assert results[0]["local_shape"] == (local_experts, HIDDEN // 2, DIM)
    for result in results:
        for name, ratio in result["ratios"].items():
            # torch divides the expert gradients by efsdp only; with division off both are sums.
            expected = EP if "experts" in name and not titan else 1.0
            assert ratio == pytest.approx(expected, rel=1e-5), (name, ratio)


@pytest.mark.slow  # multi-rank and costly: the whole suite runs it, the quick loop leaves it
@pytest.mark.parametrize("titan", [False, True], ids=["default-division", "torchtitan-division-off"])
def test_experts_on_ep_mesh_with_hsdp_train_like_the_reference(titan: bool) -> None:
    """Dense parameters HSDP over (rep 2, dp 2), experts over (rep 2, efsdp 1) and ep 2."""
    results = run_threaded(4, _run, 4, Shard(0), titan, True)
    for result in results:
        assert result["placements"] == result["torch_placements"]
        assert result["placements"][0] == ("rep", "efsdp", "ep")
        assert result["groups"] == [(1, 2, EP), (2, 2, 1)]
        assert result["local_shape"] == (2, HIDDEN, DIM)
        for name, ratio in result["ratios"].items():
            expected = EP if "experts" in name and not titan else 1.0
            assert ratio == pytest.approx(expected, rel=1e-5), (name, ratio)


def test_experts_on_ep_mesh_with_one_efsdp_rank_train_like_the_reference() -> None:
    """World 2 = efsdp 1 x ep 2: nothing to gather or scatter for the experts, only the ep average."""
    results = run_threaded(2, _run, 4, Shard(0), False)
    for result in results:
        assert result["placements"] == result["torch_placements"]
        assert result["groups"] == [(1, 1, EP), (2, 1, 1)]
        for name, ratio in result["ratios"].items():
            assert ratio == pytest.approx(EP if "experts" in name else 1.0, rel=1e-5), (name, ratio)


def _mesh_info_classes() -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_common
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ours, ours_hsdp = fsdp2.FSDPMeshInfo(mesh["shard"]), fsdp2.HSDPMeshInfo(mesh)
    theirs, theirs_hsdp = _get_mesh_info(mesh["shard"]), _get_mesh_info(mesh)
    assert isinstance(ours, fsdp2.FSDPMeshInfo)
    assert not isinstance(ours, fsdp2.HSDPMeshInfo)
    assert isinstance(ours_hsdp, fsdp2.FSDPMeshInfo)
    assert isinstance(ours_hsdp, fsdp2.HSDPMeshInfo)
    assert isinstance(theirs, fsdp2.FSDPMeshInfo)
    assert not isinstance(theirs, fsdp2.HSDPMeshInfo)
    assert isinstance(theirs_hsdp, fsdp2.FSDPMeshInfo)
    assert isinstance(theirs_hsdp, fsdp2.HSDPMeshInfo)
    assert isinstance(theirs_hsdp, _fsdp_common.FSDPMeshInfo)  # as in torch
    assert not isinstance(mesh, fsdp2.FSDPMeshInfo)
    assert not isinstance(object(), fsdp2.HSDPMeshInfo)
    assert (ours.shard_size, ours.replicate_group, ours_hsdp.shard_size, ours_hsdp.replicate_size) == (
        2,
        None,
        2,
        2,
    )
    with pytest.raises(ValueError, match=r"HSDPMeshInfo needs two different dims"):
        fsdp2.HSDPMeshInfo(mesh, shard_mesh_dim=0, replicate_mesh_dim=0)


def test_mesh_info_classes_recognise_fsdp2_and_torch_objects() -> None:
    run_threaded(4, _mesh_info_classes)


def _errors() -> None:
    mesh = init_device_mesh("cpu", (2, EP), mesh_dim_names=("efsdp", "ep"))
    other = init_device_mesh("cpu", (2, EP), mesh_dim_names=("a", "b"))  # another root mesh
    dense = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    model = fill_deterministic_(Net(4), scale=0.5)
    _place_experts(model, mesh)
    layer = model.layers[0]
    before = {name: p for name, p in layer.named_parameters()}
    info = fsdp2.FSDPMeshInfo(other["a"])
    experts = set(layer.experts.parameters())
    with pytest.raises(ValueError, match=r"not a slice of the same root mesh as its data-parallel mesh"):
        fsdp2.fully_shard(
            layer,
            mesh=dense,
            shard_placement_fn=lambda p: fsdp2.ShardPlacementResult(Shard(0), info) if p in experts else None,
        )
    assert not isinstance(layer, fsdp2.FSDPModule)  # nothing changed
    assert all(p is before[name] for name, p in layer.named_parameters())


def test_expert_mesh_errors() -> None:
    run_threaded(4, _errors)
