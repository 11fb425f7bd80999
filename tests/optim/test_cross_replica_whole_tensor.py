"""Muon, StackedMuon and Adafactor with their state sharded across HSDP's replicas.

HSDP on a (replicate=2, shard=2) mesh, threads as ranks. Three copies of one model train on the same
inputs: plain HSDP, HSDP with the optimizers sharded across replicas
(``fsdp2.shard_optimizer_across_replicas(model, [muon, adamw])``), and the unsharded model. The
replicas of a shard rank see the same batch, so the reference sums the two shard ranks' gradients
as HSDP does (bit for bit). Muon's matrices are orthogonalised whole on one owner among all four
ranks (the update's slices travel there and back): plain HSDP's numbers and the reference's, bit for
bit. Adafactor sums its statistics over the four ranks' slices instead of the two shards: within
fp32 rounding. Each rank keeps half of plain HSDP's momentum and of Adafactor's row statistics.
Also: checkpoints to and from plain HSDP, ``replicate`` alone (4 replicas), and the refusals.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import fsdp2
from tests._harness import run_threaded
from tests._training import EXACT
from tests.shared.replica import state_bytes, whole

WORLD = 4
CLOSE = {"rtol": 1e-5, "atol": 1e-6}  # Adafactor: its sums over 4 slices, not 2 shards


class _Net(nn.Module):
    """Matrices of uneven rows (13 and 2: short and empty slices) and a stack of 3 expert matrices."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 24), nn.Linear(24, 13), nn.Linear(13, 16)])
        self.experts = nn.Parameter(torch.randn(3, 16, 16) * 0.25)
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        x = torch.tanh(torch.einsum("bi,eio->bo", x, self.experts))
        return self.head(x)


def _base() -> _Net:
    torch.manual_seed(0)  # built once, in the main thread
    return _Net()


def _batch(shard_rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * shard_rank + step)
    return torch.randn(4, 16, generator=gen)


def _optimizers(model: nn.Module, kind: str) -> list[torch.optim.Optimizer]:
    if kind == "adafactor":
        return [torch.optim.Adafactor(model.parameters(), lr=1e-2, weight_decay=0.1)]
    muon_cls, ndims = (torch.optim.Muon, (2,)) if kind == "muon" else (fsdp2.StackedMuon, (2, 3))
    matrices = [p for p in model.parameters() if p.ndim in ndims]
    rest = [p for p in model.parameters() if p.ndim not in ndims]
    muon = muon_cls(matrices, lr=0.02, weight_decay=0.1, nesterov=True)
    return [muon, torch.optim.AdamW(rest, lr=1e-2)]


def _sharded(base: nn.Module, mesh: Any) -> nn.Module:
    model = copy.deepcopy(base)
    for block in model.blocks:
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    return model


def _train(base: nn.Module, kind: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    shard_rank = mesh.get_local_rank("shard")
    plain, across, ref = _sharded(base, mesh), _sharded(base, mesh), copy.deepcopy(base)
    optims = [_optimizers(m, kind) for m in (plain, across, ref)]
    tol = CLOSE if kind == "adafactor" else EXACT
    assert fsdp2.shard_optimizer_across_replicas(across, optims[1]) is optims[1]
    for step in range(3):
        losses = []
        for model in (plain, across):
            loss = model(_batch(shard_rank, step)).pow(2).mean()
            loss.backward()
            losses.append(loss)
        torch.testing.assert_close(losses[1], losses[0], **tol)
        for data_rank in range(2):  # the reference: both shard ranks' batches, averaged as HSDP does
            ref(_batch(data_rank, step)).pow(2).mean().backward()
        for param in ref.parameters():
            param.grad /= 2
        if step == 0:
            for param in across.parameters():  # each rank's gradient is its slice
                assert all(p == Shard(0) for p in param.grad.placements)
        for group in optims:
            for optim in group:
                optim.step()
                optim.zero_grad()
    trios = zip(plain.named_parameters(), across.parameters(), ref.parameters(), strict=True)
    for (name, p_plain), p_across, p_ref in trios:
        torch.testing.assert_close(p_across.to_local(), p_plain.to_local(), **tol, msg=name)
        torch.testing.assert_close(whole(p_across), p_ref, **tol, msg=name)
        for key, value in sorted(optims[1][0].state.get(p_across, {}).items()):
            if isinstance(value, DTensor):  # slices whose full tensors are plain HSDP's state
                expected = optims[0][0].state[p_plain][key]
                torch.testing.assert_close(whole(value), whole(expected), **tol, msg=f"{name}.{key}")
                torch.testing.assert_close(whole(value), optims[2][0].state[p_ref][key], **tol)
    fsdp2.check_replicas(across)  # the parameters agree across replicas after the all-gather
    return {"bytes": [sum(state_bytes(o) for o in group) for group in optims[:2]]}


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("kind", ["muon", "stacked_muon", "adafactor"])
def test_whole_tensor_optimizers_across_replicas_equal_plain_hsdp_and_the_unsharded_model(kind: str) -> None:
    results = run_threaded(WORLD, _train, _base(), kind)
    plain = sum(r["bytes"][0] for r in results)
    across = sum(r["bytes"][1] for r in results)
    if kind == "adafactor":  # the column statistics stay whole on every rank; the rest halves
        assert across < plain, (plain, across)
    else:
        assert across * 2 == plain, (plain, across)


def _over_replicate(base: nn.Module, kind: str) -> None:
    """``replicate`` alone (4 replicas, no shard dim): each rank steps a quarter of each parameter."""
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("replicate",))
    models = []
    for _ in range(2):
        model = copy.deepcopy(base)
        for block in model.blocks:
            fsdp2.replicate(block, mesh=mesh)
        fsdp2.replicate(model, mesh=mesh)
        models.append(model)
    optims = [_optimizers(m, kind) for m in models]
    fsdp2.shard_optimizer_across_replicas(models[1], optims[1])
    tol = CLOSE if kind == "adafactor" else EXACT
    for step in range(3):
        for model in models:
            model(_batch(dist.get_rank(), step)).pow(2).mean().backward()
        for group in optims:
            for optim in group:
                optim.step()
                optim.zero_grad()
    for (name, p_plain), p_across in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(p_across.to_local(), p_plain.to_local(), **tol, msg=name)
    fsdp2.check_replicas(models[1])


@pytest.mark.slow  # multi-rank and costly: the whole suite runs it, the quick loop leaves it
@pytest.mark.parametrize("kind", ["stacked_muon", "adafactor"])
def test_over_replicate_alone(kind: str) -> None:
    run_threaded(WORLD, _over_replicate, _base(), kind)


# ---------------------------------------------------------------------------------------------
# DCP: plain HSDP's checkpoint resumes across replicas, and the other way round
# ---------------------------------------------------------------------------------------------


def _full_state(model: nn.Module, optims: list[torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in model.named_parameters():  # the same order on every rank (collectives)
        out[name] = whole(param)
        for optim in optims:
            for key, value in sorted(optim.state.get(param, {}).items()):
                if isinstance(value, torch.Tensor):
                    out[f"{name}.{key}"] = whole(value) if isinstance(value, DTensor) else value.clone()
    return out


def _resume(base: nn.Module, kind: str, across: bool, load: str | None, save: str | None, steps: int) -> Any:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _sharded(base, mesh)
    optims = _optimizers(model, kind)
    if across:
        fsdp2.shard_optimizer_across_replicas(model, optims)
    if load is not None:
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optims)}
        dcp.load(state, checkpoint_id=load)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optims, state["optim"])
    loaded = _full_state(model, optims)
    for step in range(steps):
        model(_batch(mesh.get_local_rank("shard"), 10 + step)).pow(2).mean().backward()
        for optim in optims:
            optim.step()
            optim.zero_grad()
    if save is not None:
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optims)}
        dcp.save(state, checkpoint_id=save)
    return loaded, _full_state(model, optims)


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: dict[str, float]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, **tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow  # multi-rank and costly: the whole suite runs it, the quick loop leaves it
@pytest.mark.parametrize("kind", ["stacked_muon", "adafactor"])
def test_checkpoints_to_and_from_plain_hsdp(kind: str, tmp_path: Any) -> None:
    base, tol = _base(), CLOSE if kind == "adafactor" else EXACT
    plain_ckpt, across_ckpt = str(tmp_path / "plain"), str(tmp_path / "across")
    saved = run_threaded(WORLD, _resume, base, kind, False, None, plain_ckpt, 2)[0][1]
    loaded, stepped = run_threaded(WORLD, _resume, base, kind, True, plain_ckpt, across_ckpt, 1)[0]
    _assert_same(loaded, saved, EXACT)  # plain HSDP's state, cut into slices
    plain_stepped = run_threaded(WORLD, _resume, base, kind, False, plain_ckpt, None, 1)[0][1]
    _assert_same(stepped, plain_stepped, tol)  # ... steps as plain HSDP does
    loaded_plain, _ = run_threaded(WORLD, _resume, base, kind, False, across_ckpt, None, 0)[0]
    _assert_same(loaded_plain, stepped, EXACT)  # the slices' checkpoint loads into plain HSDP


def _refused() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _sharded(_base(), mesh)
    muon, _ = _optimizers(model, "muon")
    rprop = torch.optim.Rprop([p for p in model.parameters() if p.ndim != 2])
    with pytest.raises(ValueError, match="Rprop is neither an elementwise optimizer"):
        fsdp2.shard_optimizer_across_replicas(model, [muon, rprop])
    with pytest.raises(ValueError, match="none of these optimizers steps"):
        fsdp2.shard_optimizer_across_replicas(model, muon)
    model(_batch(0, 0)).sum().backward()  # nothing changed: plain HSDP's gradients
    for param in model.parameters():
        assert param.grad.placements == param.placements


def test_other_whole_tensor_optimizers_and_partial_lists_are_refused() -> None:
    run_threaded(WORLD, _refused)
