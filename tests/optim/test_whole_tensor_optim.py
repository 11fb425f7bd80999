"""Optimizers that need whole matrices (Muon, Adafactor) give the unsharded model's update on shards.

The reference is the unsharded model trained with the same optimizer, each step's gradients averaged
across ranks. Each sharded parameter's update is computed once, on an owner rank, from the whole
gradient, parameter and state: the same operations on the same values, so the numbers are equal bit
for bit (``EXACT``) where nothing else differs. torch 2.13's ``fully_shard`` runs Muon through DTensor
operations (5.6e-3 off after 3 steps at 2 ranks) and raises for Adafactor and for empty shards.
"""

from __future__ import annotations

import copy
import functools
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

import fsdp2
from tests._harness import run_threaded

EXACT = {"rtol": 0, "atol": 0}


class _Net(nn.Module):
    """Matrices of several shapes (one with fewer rows than ranks: an empty shard at 3 and 4 ranks)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [nn.Linear(16, 24, dtype=dtype), nn.Linear(24, 13, dtype=dtype), nn.Linear(13, 16, dtype=dtype)]
        )
        self.head = nn.Linear(16, 2, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _base(dtype: torch.dtype = torch.float32) -> _Net:
    torch.manual_seed(0)  # built once, in the main thread
    return _Net(dtype)


def _batch(rank: int, step: int, micro: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(4, 16, generator=gen).to(dtype)


def _optimizers(model: nn.Module, kind: str) -> list[torch.optim.Optimizer]:
    """The usual split: Muon for the matrices, AdamW for the rest; or Adafactor for everything."""
    if kind == "muon":
        matrices = [p for p in model.parameters() if p.ndim == 2]
        rest = [p for p in model.parameters() if p.ndim != 2]
        return [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-2)]
    return [torch.optim.Adafactor(model.parameters(), lr=1e-2)]


def _train(
    base: nn.Module,
    kind: str,
    sharded: bool,
    data_ranks: int,
    *,
    steps: int = 3,
    micro: int = 1,
    clip: float | None = None,
    mesh_shape: tuple[int, ...] | None = None,
    dtype: torch.dtype = torch.float32,
    first_step: int = 0,
    resume_from: str | None = None,
    save_to: str | None = None,
    schedule: bool = True,
) -> dict[str, Any]:
    model = copy.deepcopy(base)
    shard_rank = dist.get_rank()
    if sharded:
        mesh = None
        if mesh_shape is not None:
            mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
            shard_rank = mesh.get_local_rank("shard")
        for block in model.blocks:
            fsdp2.fully_shard(block, mesh=mesh)
        fsdp2.fully_shard(model, mesh=mesh)
    optims = _optimizers(model, kind)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in optims]
    if not schedule:
        schedulers = []
    if resume_from is not None:  # the model and optimizer state a run of the first steps saved
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optims)}
        dcp.load(state, checkpoint_id=resume_from)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optims, state["optim"])
    batch_ranks = range(data_ranks)  # the ranks with different data (HSDP replicas see the same)
    for step in range(first_step, steps):
        ranks = [shard_rank] if sharded else batch_ranks
        for rank in ranks:
            for m in range(micro):
                model(_batch(rank, step, m, dtype)).float().pow(2).mean().backward()
        if not sharded:
            for param in model.parameters():
                param.grad /= len(batch_ranks)
        if clip is not None:
            (fsdp2.clip_grad_norm_ if sharded else nn.utils.clip_grad_norm_)(model.parameters(), clip)
        for optim in optims:
            optim.step()
        for optim in optims:
            optim.zero_grad()
        for scheduler in schedulers:
            scheduler.step()
    if save_to is not None:
        dcp.save(
            {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optims)},
            checkpoint_id=save_to,
        )
    full = {n: (p.full_tensor() if sharded else p).detach().clone() for n, p in model.named_parameters()}
    return {"params": full}


def _check(kind: str, world: int, **options: Any) -> None:
    """``kind``'s optimizers on ``world`` rank threads against the unsharded model, bit for bit."""
    base = _base(options.get("dtype", torch.float32))
    mesh_shape = options.get("mesh_shape")
    data_ranks = world if mesh_shape is None else mesh_shape[1]
    reference = {k: v for k, v in options.items() if k != "mesh_shape"}
    expected = run_threaded(1, functools.partial(_train, **reference), base, kind, False, data_ranks)[0][
        "params"
    ]
    moved = [n for n, p in expected.items() if not torch.equal(p, base.get_parameter(n).detach())]
    assert len(moved) == len(expected)  # every parameter trained
    for out in run_threaded(world, functools.partial(_train, **options), base, kind, True, data_ranks):
        for name, value in out["params"].items():
            torch.testing.assert_close(value, expected[name], **EXACT, msg=name)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_muon_equals_the_unsharded_model(world: int) -> None:
    _check("muon", world)


@pytest.mark.parametrize("world", [2, 3])
def test_adafactor_equals_the_unsharded_model(world: int) -> None:
    _close("adafactor", world, {"rtol": 1e-5, "atol": 1e-6})  # sums in another order


def test_muon_and_adafactor_with_hsdp() -> None:
    """2 replicas x 2 shards: owners are shard ranks, each replica computes each matrix once; Adafactor
    sums over the shard group only (the replicas hold the same rows)."""
    _check("muon", 4, mesh_shape=(2, 2))
    _close("adafactor", 4, {"rtol": 1e-5, "atol": 1e-6}, mesh_shape=(2, 2))


def _close(kind: str, world: int, tolerance: dict[str, float], **options: Any) -> None:
    base = _base(options.get("dtype", torch.float32))
    mesh_shape = options.get("mesh_shape")
    data_ranks = world if mesh_shape is None else mesh_shape[1]
    reference = {k: v for k, v in options.items() if k != "mesh_shape"}
    expected = run_threaded(1, functools.partial(_train, **reference), base, kind, False, data_ranks)[0]
    expected = expected["params"]
    for out in run_threaded(world, functools.partial(_train, **options), base, kind, True, data_ranks):
        for name, value in out["params"].items():
            torch.testing.assert_close(value, expected[name], **tolerance, msg=name)


def test_clipping_and_accumulation_before_the_step() -> None:
    """Within fp32 rounding: the gradient norm and the micro-batch sums are added in another order."""
    _close("muon", 2, {"rtol": 1e-5, "atol": 1e-6}, micro=2, clip=0.05)
    _close("adafactor", 2, {"rtol": 1e-5, "atol": 1e-6}, micro=2, clip=0.05)


def _grad_dtype_model() -> _Net:
    model = _base(torch.bfloat16)
    for param in model.parameters():
        param.grad_dtype = torch.float32  # bf16 weights, fp32 gradients and so fp32 optimizer state
    return model


def test_bf16_parameters_with_fp32_state() -> None:
    base = _grad_dtype_model()
    train = functools.partial(_train, dtype=torch.bfloat16, steps=2)
    expected = run_threaded(1, train, base, "muon", False, 2)[0]["params"]
    for out in run_threaded(2, train, base, "muon", True, 2):
        for name, value in out["params"].items():
            assert value.dtype == torch.bfloat16
            # the fp32 gradient sums of two ranks are added in another order than autograd's, and the
            # bf16 add of the update rounds some elements of a row shard otherwise: up to 2 bf16 ulps
            torch.testing.assert_close(value, expected[name], rtol=1.6e-2, atol=1e-3, msg=name)


@pytest.mark.parametrize("kind", ["muon", "adafactor"])
def test_a_checkpoint_resumes_on_the_same_and_another_number_of_ranks(kind: str, tmp_path: Any) -> None:
    """DCP saves the state as laid out between steps (sharded like the parameter, or equal on every
    rank); resumed at 2 ranks the run ends where the uninterrupted one does (bit for bit), at 3 ranks
    where the unsharded model loading the same checkpoint does."""
    base = _base()
    train = functools.partial(_train, schedule=False)
    uninterrupted = run_threaded(2, functools.partial(train, steps=3), base, kind, True, 2)[0]["params"]
    path = str(tmp_path / "ckpt")
    run_threaded(2, functools.partial(train, steps=2, save_to=path), base, kind, True, 2)
    resume = functools.partial(train, steps=3, first_step=2, resume_from=path)
    for out in run_threaded(2, resume, base, kind, True, 2):
        for name, value in out["params"].items():
            torch.testing.assert_close(value, uninterrupted[name], **EXACT, msg=name)
    # At 3 ranks the last step averages 3 batches: the reference is the unsharded model loading the
    # same checkpoint and stepping on them.
    expected = run_threaded(1, resume, base, kind, False, 3)[0]["params"]
    tolerance = EXACT if kind == "muon" else {"rtol": 1e-5, "atol": 1e-6}  # Adafactor's sums: reordered
    for out in run_threaded(3, resume, base, kind, True, 3):
        for name, value in out["params"].items():
            torch.testing.assert_close(value, expected[name], **tolerance, msg=name)


def _muon_step_flops(base: nn.Module, sharded: bool) -> int:
    """Matmul FLOPs of one Muon step on this rank (the Newton-Schulz iterations)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = copy.deepcopy(base)
    if sharded:
        for block in model.blocks:
            fsdp2.fully_shard(block)
        fsdp2.fully_shard(model)
    optim = torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02)
    model(_batch(dist.get_rank(), 0)).pow(2).mean().backward()
    with FlopCounterMode(display=False) as counter:
        optim.step()
    return int(counter.get_total_flops())


def test_each_matrix_is_orthogonalised_once_across_the_ranks() -> None:
    base = _base()
    whole = run_threaded(1, _muon_step_flops, base, False)[0]
    per_rank = run_threaded(2, _muon_step_flops, base, True)
    assert sum(per_rank) == whole  # not every rank: the work of the unsharded step, split
    assert max(per_rank) < whole  # shared out (owners balanced by work)


class _SpectralSGD(torch.optim.Optimizer):
    """A whole-matrix update of a user's own: the gradient divided by its largest singular value."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    sigma = torch.linalg.matrix_norm(param.grad, ord=2)
                    param.add_(param.grad / sigma, alpha=-group["lr"])


def _spectral(base: nn.Module, sharded: bool, declare: str) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(base)
    if sharded:
        for block in model.blocks:
            fsdp2.fully_shard(block)
        fsdp2.fully_shard(model)
    optim = _SpectralSGD([p for p in model.parameters() if p.ndim == 2], lr=0.05)
    if declare == "instance":
        fsdp2.whole_tensor_step(optim)
    for step in range(2):
        for rank in [dist.get_rank()] if sharded else range(2):
            model(_batch(rank, step)).pow(2).mean().backward()
        if not sharded:
            for param in model.parameters():
                param.grad /= 2
        optim.step()
        optim.zero_grad()
    return {n: (p.full_tensor() if sharded else p).detach().clone() for n, p in model.named_parameters()}


def test_a_declared_whole_matrix_optimizer_takes_the_owner_path() -> None:
    base = _base()
    expected = run_threaded(1, _spectral, base, False, "")[0]
    for how in ("instance", "class"):
        if how == "class":
            fsdp2.declare_optimizer(_SpectralSGD, "whole_tensor")
        try:
            for out in run_threaded(2, _spectral, base, True, how):
                for name, value in out.items():
                    torch.testing.assert_close(value, expected[name], **EXACT, msg=f"{how}: {name}")
        finally:
            fsdp2.declare_optimizer(_SpectralSGD, "dtensor")


class _Unknown(torch.optim.Optimizer):
    def __init__(self, params: Any) -> None:
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.sub_(param.grad, alpha=0.1)


def _two_steps(base: nn.Module) -> None:
    model = copy.deepcopy(base)
    fsdp2.fully_shard(model)
    optim = _Unknown(model.parameters())
    for step in range(2):
        model(_batch(dist.get_rank(), step)).sum().backward()
        optim.step()
        optim.zero_grad()


def test_an_optimizer_fsdp2_does_not_know_is_named_once() -> None:
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # the rank threads warn in this process
        warnings.simplefilter("always")
        run_threaded(2, _two_steps, _base())
    named = [w for w in caught if "_Unknown steps parameters fully_shard sharded" in str(w.message)]
    assert len(named) == 1  # once per class: not per step, rank or instance
    assert "fsdp2.declare_optimizer(_Unknown, 'elementwise')" in str(named[0].message)


def test_declarations_are_checked() -> None:
    with pytest.raises(TypeError, match="Optimizer subclass"):
        fsdp2.declare_optimizer(object, "elementwise")
    with pytest.raises(ValueError, match="kind must be one of"):
        fsdp2.declare_optimizer(_Unknown, "matrix")
    with pytest.raises(TypeError, match=r"expects a torch\.optim\.Optimizer"):
        fsdp2.whole_tensor_step(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="only supports 2D parameters"):  # torch's own, at construction
        torch.optim.Muon([nn.Parameter(torch.zeros(3))])


def _tensor_parallel_layout() -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    from fsdp2.optim._owner_exchange import shard_group_of

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    weight = distribute_tensor(torch.zeros(8, 8), mesh, (Shard(0), Shard(1)))
    with pytest.raises(ValueError, match=r"laid out as \(Shard\(dim=0\), Shard\(dim=1\)\)"):
        shard_group_of(weight)


def test_a_tensor_parallel_layout_is_refused_with_the_fix() -> None:
    run_threaded(4, _tensor_parallel_layout)


class _Tensors(nn.Module):
    """A matrix, a 3-D weight (factored over its last two dims) and a vector, each of its own group."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(16, 6)
        self.cube = nn.Parameter(torch.randn(6, 4, 5) * 0.2)
        self.scale = nn.Parameter(torch.ones(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(x))  # (batch, 6)
        return torch.einsum("bi,ijk,k->bj", h, self.cube, self.scale)


def _adafactor_run(base: nn.Module, sharded: bool) -> dict[str, Any]:
    model = copy.deepcopy(base)
    if sharded:
        fsdp2.fully_shard(model.mix)
        fsdp2.fully_shard(model)
    optim = torch.optim.Adafactor(model.parameters(), lr=1e-2, weight_decay=0.1, maximize=True)
    counts: list[Any] = []
    for step in range(3):
        for rank in [dist.get_rank()] if sharded else range(2):
            (-model(_batch(rank, step)).pow(2).mean()).backward()
        if not sharded:
            for param in model.parameters():
                param.grad /= 2
        from fsdp2.testing import count_collectives

        with count_collectives() as counted:
            optim.step()
        counts.append(dict(counted))
        optim.zero_grad()
    full = {n: (p.full_tensor() if sharded else p).detach().clone() for n, p in model.named_parameters()}
    return {"params": full, "counts": counts}


def test_adafactor_statistics_come_from_small_all_reduces() -> None:
    """Adafactor's row and column statistics on row shards: per step two all-reduces (the norms, the
    column sums and row-factor sums; then the update norms), no matrix gathered or moved; a 3-D weight,
    weight decay and maximize as torch computes them."""
    torch.manual_seed(0)
    base = _Tensors()
    expected = run_threaded(1, _adafactor_run, base, False)[0]["params"]
    for out in run_threaded(2, _adafactor_run, base, True):
        assert out["counts"] == [{"all_reduce": 2}] * 3
        for name, value in out["params"].items():
            torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)
