"""Optimizer state sharded across HSDP's replicas: ``fsdp2.shard_optimizer_across_replicas``.

HSDP on a (replicate=2, shard=2) mesh, threads as ranks. Three copies of one model train on the same
inputs: plain HSDP, HSDP with the optimizer sharded across replicas, and the unsharded model with
gradients averaged over the four ranks. The sharded-across-replicas run must give plain HSDP's losses
and parameters bit for bit (the same reductions: two replicas sum in one order only) and the
reference's within fp32 rounding; keep half of HSDP's optimizer state per rank; send as many bytes
(the reduce-scatter across replicas plus the all-gather after the step equal HSDP's all-reduce); and
take clipping, gradient accumulation and DCP checkpoints to and from plain HSDP (also at another
world size).
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
from fsdp2.testing import record_collectives
from tests._harness import run_threaded
from tests._training import EXACT, TIGHT, average_grads, seeded
from tests.models import MLP, make_input
from tests.shared.replica import state_bytes as _state_bytes
from tests.shared.replica import whole as _whole

WORLD = 4
DIM = 8  # every shard's rows divide by the replicas: HSDP's bytes exactly
UNEVEN = 5  # rows that do not divide: empty and short slices


def _mesh(shape: tuple[int, ...] = (2, 2)) -> Any:
    if len(shape) == 1:
        return init_device_mesh("cpu", shape, mesh_dim_names=("shard",))
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _sharded(base: nn.Module, mesh: Any) -> nn.Module:
    model = copy.deepcopy(base)
    fsdp2.fully_shard(model.in_proj, mesh=mesh)
    fsdp2.fully_shard(model.out_proj, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    return model


def _adamw(model: nn.Module, across: bool) -> torch.optim.Optimizer:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return fsdp2.shard_optimizer_across_replicas(model, optim) if across else optim


def _input(rank: int, step: int, dim: int) -> torch.Tensor:
    return make_input((3, dim), rank, seed=step)


# ---------------------------------------------------------------------------------------------
# AdamW: plain HSDP's numbers bit for bit, the reference's, half the state, the same bytes
# ---------------------------------------------------------------------------------------------


def _adamw_three_steps(dim: int) -> dict[str, Any]:
    rank = dist.get_rank()
    mesh = _mesh()
    base = seeded(lambda: MLP(dim))
    ref = copy.deepcopy(base)
    plain, across = _sharded(base, mesh), _sharded(base, mesh)
    optims = [_adamw(plain, False), _adamw(across, True)]
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    sent = []
    for step in range(3):
        x = _input(rank, step, dim)
        logs = []
        losses = []
        for model, optim in zip((plain, across), optims, strict=True):
            with record_collectives(model) as log:
                loss = model(x).sum()
                loss.backward()
                if step == 0 and model is across:
                    for param in model.parameters():  # each rank's gradient is its slice
                        assert all(p == Shard(0) for p in param.grad.placements)
                        assert param.grad.to_local().shape[0] <= -(-param.to_local().shape[0] // 2)
                optim.step()
            optim.zero_grad()
            logs.append(log)
            losses.append(loss)
        ref(x).sum().backward()
        average_grads(ref)
        ref_optim.step()
        ref_optim.zero_grad()
        torch.testing.assert_close(losses[1], losses[0], **EXACT)
        sent.append([log.sent_bytes() for log in logs] + [log["all_reduce"] for log in logs])
    for p_plain, p_across, p_ref in zip(
        plain.parameters(), across.parameters(), ref.parameters(), strict=True
    ):
        torch.testing.assert_close(p_across.to_local(), p_plain.to_local(), **EXACT)
        torch.testing.assert_close(_whole(p_across), p_ref, **TIGHT)
    twin = copy.deepcopy(across)  # the option is the optimizer's: a copy reduces as plain HSDP
    twin(_input(rank, 3, dim)).sum().backward()
    for param in twin.parameters():
        assert param.grad.placements == param.placements
    return {"bytes": [_state_bytes(o) for o in optims], "sent": sent}


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("dim", [DIM, UNEVEN], ids=["even", "uneven"])
def test_adamw_equals_plain_hsdp_and_the_unsharded_model(dim: int) -> None:
    results = run_threaded(WORLD, _adamw_three_steps, dim)
    for rank, result in enumerate(results):
        plain_bytes, across_bytes = result["bytes"]
        if dim == DIM:
            assert across_bytes * 2 == plain_bytes, (rank, result["bytes"])
            for plain_sent, across_sent, plain_ar, across_ar in result["sent"]:
                assert (plain_ar, across_ar) == (2, 0)  # one all-reduce per group (two), none across replicas
                assert across_sent == plain_sent, (rank, result["sent"])
    total = [sum(r["bytes"][i] for r in results) for i in range(2)]
    assert total[1] * 2 == total[0], total  # the replicas' state is cut in two, uneven or not


# ---------------------------------------------------------------------------------------------
# Clipping and gradient accumulation
# ---------------------------------------------------------------------------------------------

MICRO = 2


def _accumulate_and_clip(deferred: bool) -> None:
    rank = dist.get_rank()
    mesh = _mesh()
    base = seeded(lambda: MLP(UNEVEN))
    ref = copy.deepcopy(base)
    plain, across = _sharded(base, mesh), _sharded(base, mesh)
    optims = [_adamw(plain, False), _adamw(across, True)]
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        for micro in range(MICRO):
            x = _input(rank, 10 * step + micro, UNEVEN)
            for model in (plain, across):
                if deferred:  # the replicas' reduction waits for the last micro-batch
                    model.set_requires_all_reduce(micro == MICRO - 1)
                model(x).sum().backward()
            ref(x).sum().backward()
        average_grads(ref)
        for p_plain, p_across in zip(plain.parameters(), across.parameters(), strict=True):
            # the micro-batches' sum: the same additions on slices as on shards (then the clipping
            # coefficients differ in the last bit, and so do the parameters)
            tol = EXACT if step == 0 else TIGHT
            torch.testing.assert_close(_whole(p_across.grad), _whole(p_plain.grad), **tol)
        norms = [fsdp2.clip_grad_norm_(m.parameters(), max_norm=1.0) for m in (plain, across)]
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=1.0)
        assert norms[0].item() > 1.0  # it clips
        torch.testing.assert_close(norms[1], norms[0], **TIGHT)  # the norm sums R x S pieces, not S
        torch.testing.assert_close(norms[1], ref_norm, **TIGHT)
        for optim in (*optims, ref_optim):
            optim.step()
            optim.zero_grad()
    for p_plain, p_across, p_ref in zip(
        plain.parameters(), across.parameters(), ref.parameters(), strict=True
    ):
        torch.testing.assert_close(p_across.to_local(), p_plain.to_local(), **TIGHT)
        torch.testing.assert_close(_whole(p_across), p_ref, **TIGHT)


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("deferred", [False, True], ids=["each_backward", "requires_all_reduce_false"])
def test_clipping_and_accumulation(deferred: bool) -> None:
    run_threaded(WORLD, _accumulate_and_clip, deferred)


# ---------------------------------------------------------------------------------------------
# DCP: to and from plain HSDP, and at another world size
# ---------------------------------------------------------------------------------------------


def _full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters and optimizer state as whole tensors, by name (every rank)."""
    out = {}
    for name, param in model.named_parameters():  # the same order on every rank (collectives)
        out[name] = _whole(param)
        values = optim.state.get(param, {})
        for key in sorted(values):
            if isinstance(values[key], DTensor):
                out[f"{name}.{key}"] = _whole(values[key])
    return out


def _checkpoint(shape: tuple[int, ...], across: bool, load: str | None, save: str | None, steps: int) -> Any:
    rank = dist.get_rank()
    model = _sharded(seeded(lambda: MLP(UNEVEN)), _mesh(shape))
    optim = _adamw(model, across)
    if load is not None:
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
        dcp.load(state, checkpoint_id=load)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optim, state["optim"])
    loaded = _full_state(model, optim)
    for step in range(steps):
        model(_input(rank, step, UNEVEN)).sum().backward()
        optim.step()
        optim.zero_grad()
    if save is not None:
        dcp.save(
            {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)},
            checkpoint_id=save,
        )
    return loaded, _full_state(model, optim)


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, **EXACT, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow  # multi-rank and costly: the whole suite runs it, the quick loop leaves it
def test_checkpoints_to_and_from_plain_hsdp_and_another_world_size(tmp_path: Any) -> None:
    plain_ckpt, across_ckpt = str(tmp_path / "plain"), str(tmp_path / "across")
    # plain HSDP trains two steps and saves; with the optimizer across replicas it resumes
    saved = run_threaded(WORLD, _checkpoint, (2, 2), False, None, plain_ckpt, 2)[0][1]
    loaded, _ = run_threaded(WORLD, _checkpoint, (2, 2), True, plain_ckpt, across_ckpt, 1)[0]
    _assert_same(loaded, saved)
    # ... and its step equals plain HSDP's from the same checkpoint
    plain_next = run_threaded(WORLD, _checkpoint, (2, 2), False, plain_ckpt, None, 1)[0][1]
    across_next = run_threaded(WORLD, _checkpoint, (2, 2), True, plain_ckpt, None, 1)[0][1]
    _assert_same(across_next, plain_next)
    # what it saved loads into plain FSDP on 2 ranks, and into itself
    again_ckpt = str(tmp_path / "across_again")
    across_saved = run_threaded(WORLD, _checkpoint, (2, 2), True, plain_ckpt, again_ckpt, 1)[0][1]
    _assert_same(across_saved, across_next)
    loaded_at_two, _ = run_threaded(2, _checkpoint, (2,), False, again_ckpt, None, 0)[0]
    _assert_same(loaded_at_two, across_saved)
    loaded_again, _ = run_threaded(WORLD, _checkpoint, (2, 2), True, again_ckpt, None, 0)[0]
    _assert_same(loaded_again, across_saved)


# ---------------------------------------------------------------------------------------------
# replicate alone: ZeRO-1/2 over plain data parallelism; check_replicas
# ---------------------------------------------------------------------------------------------


def _replicated(base: nn.Module, mesh: Any) -> nn.Module:
    model = copy.deepcopy(base)
    fsdp2.replicate(model.in_proj, mesh=mesh)
    fsdp2.replicate(model.out_proj, mesh=mesh)
    fsdp2.replicate(model, mesh=mesh)
    return model


def _zero_over_data_parallel() -> list[int]:
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("replicate",))
    base = seeded(lambda: MLP(UNEVEN))
    ref = copy.deepcopy(base)
    plain, across = _replicated(base, mesh), _replicated(base, mesh)
    optims = [_adamw(plain, False), _adamw(across, True)]
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        x = _input(rank, step, UNEVEN)
        losses = [model(x).sum() for model in (plain, across)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[1], losses[0], **EXACT)
        ref(x).sum().backward()
        average_grads(ref)
        for optim in (*optims, ref_optim):
            optim.step()
            optim.zero_grad()
        fsdp2.check_replicas(across)  # the parameters agree; the optimizer slices differ by design
    trios = zip(plain.parameters(), across.parameters(), ref.parameters(), strict=True)
    for p_plain, p_across, p_ref in trios:
        torch.testing.assert_close(p_across.to_local(), p_plain.to_local(), **EXACT)
        torch.testing.assert_close(p_across.to_local(), p_ref, **TIGHT)
    with torch.no_grad():
        next(across.parameters()).to_local()[0, 0] += float(rank == 1)  # a real drift is still found
    with pytest.raises(RuntimeError, match="differ"):
        fsdp2.check_replicas(across)
    return [_state_bytes(o) for o in optims]


def test_replicate_alone_shards_the_optimizer_over_data_parallel_ranks() -> None:
    results = run_threaded(WORLD, _zero_over_data_parallel)
    plain = sum(r[0] for r in results)
    across = sum(r[1] for r in results)
    assert across * WORLD == plain, (plain, across)  # each rank a quarter of the state, uneven rows too


# ---------------------------------------------------------------------------------------------
# Mixed precision
# ---------------------------------------------------------------------------------------------


def _mixed_precision() -> None:
    rank = dist.get_rank()
    mesh = _mesh()
    policy = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    base = seeded(lambda: MLP(UNEVEN))
    models = []
    for _ in range(2):
        model = copy.deepcopy(base)
        for module in (model.in_proj, model.out_proj, model):
            fsdp2.fully_shard(module, mesh=mesh, mp_policy=policy)
        models.append(model)
    optims = [_adamw(models[0], False), _adamw(models[1], True)]
    for step in range(3):
        x = _input(rank, step, UNEVEN)
        losses = [model(x).float().sum() for model in models]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[1], losses[0], **EXACT)
        for optim in optims:
            optim.step()
            optim.zero_grad()
    for p_plain, p_across in zip(*(m.parameters() for m in models), strict=True):
        assert p_across.dtype == torch.float32
        torch.testing.assert_close(p_across.to_local(), p_plain.to_local(), **EXACT)


def test_mixed_precision_equals_plain_hsdp() -> None:
    run_threaded(WORLD, _mixed_precision)


# ---------------------------------------------------------------------------------------------
# Refused, with the fix, before anything changes
# ---------------------------------------------------------------------------------------------


def _refusals() -> None:
    rank = dist.get_rank()
    base = seeded(lambda: MLP(DIM))
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        fsdp2.shard_optimizer_across_replicas(base, object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="no fully_shard module"):
        fsdp2.shard_optimizer_across_replicas(base, torch.optim.AdamW(base.parameters()))
    fsdp_only = _sharded(base, _mesh((WORLD,)))
    with pytest.raises(ValueError, match="no replicate dim"):
        fsdp2.shard_optimizer_across_replicas(fsdp_only, torch.optim.AdamW(fsdp_only.parameters()))
    model = _sharded(base, _mesh())
    matrices = [p for p in model.parameters() if p.ndim == 2]
    with pytest.raises(ValueError, match="neither an elementwise optimizer"):
        fsdp2.shard_optimizer_across_replicas(model, torch.optim.Rprop(model.parameters()))
    weights_only = torch.optim.AdamW(matrices, lr=1e-2)
    with pytest.raises(ValueError, match="none of these optimizers steps"):
        fsdp2.shard_optimizer_across_replicas(model, weights_only)
    with pytest.raises(ValueError, match="pass the model that holds them"):
        fsdp2.shard_optimizer_across_replicas(model.in_proj, torch.optim.AdamW(model.parameters()))
    # nothing changed: the gradients are still all-reduced into shards laid out like the parameters
    model(_input(rank, 0, DIM)).sum().backward()
    for param in model.parameters():
        assert param.grad.placements == param.placements
    before = [_whole(p.grad) for p in model.parameters()]
    optim = fsdp2.shard_optimizer_across_replicas(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="without a closure"):
        optim.step(lambda: None)
    # a gradient reduced before the call (no zero_grad since) gives its slice to the sum
    x = _input(rank, 1, DIM)
    model(x).sum().backward()
    ref = copy.deepcopy(base)
    ref(x).sum().backward()
    average_grads(ref)
    for param, ref_param, old in zip(model.parameters(), ref.parameters(), before, strict=True):
        assert all(p == Shard(0) for p in param.grad.placements)
        torch.testing.assert_close(_whole(param.grad), old + ref_param.grad, **TIGHT)
    optim.zero_grad()
    for module in (model.in_proj, model.out_proj):  # after the call: refused at the reduction
        module.set_all_reduce_hook(lambda output: None)
    with pytest.raises(RuntimeError, match="all-reduce hook"):
        model(_input(rank, 2, DIM)).sum().backward()


def test_refusals_name_the_problem_and_change_nothing() -> None:
    run_threaded(WORLD, _refusals)
