"""HSDP on a (replicate=2, shard=2) mesh, threads as ranks (docs/hsdp.md).

Parameters are ``(Replicate(), Shard(0))`` DTensors whose local rows follow the shard rank only.
Gradients average over all four ranks: the reference is an unsharded copy whose gradients are
all-reduced (AVG) over the whole world. ``set_requires_all_reduce(False)`` keeps reduce-scattering
but defers the replicate all-reduce: the sharded gradient stays ``None`` until a micro-step with
the all-reduce on, whose result equals the micro-batch sum averaged over all ranks. A
differential test compares with torch's ``fully_shard`` on the same mesh.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp2.testing import record_collectives
from tests._harness import count_collectives, run_threaded
from tests._impls import Impl, get_impl, torch_impl
from tests._training import EXACT, TIGHT, average_grads, forward_backward, seeded, step_all, train_in_lockstep
from tests.models import MLP, ModelArgs, Transformer, make_input, make_tokens

WORLD = 4
MESH_SHAPE = (2, 2)


def hsdp_mesh() -> DeviceMesh:
    return init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=("replicate", "shard"))


@dataclass(frozen=True)
class Spec:
    build: Callable[[], nn.Module]
    blocks: Callable[[nn.Module], list[nn.Module]]
    inputs: Callable[[int, int], torch.Tensor]  # (rank, call index) -> input


MLP_DIM = 13
TF_ARGS = ModelArgs(n_layers=2)
MLP_SPEC = Spec(
    build=lambda: MLP(MLP_DIM),
    blocks=lambda m: [m.in_proj, m.out_proj],
    inputs=lambda rank, i: make_input((3, MLP_DIM), rank, seed=i),
)
TF_SPEC = Spec(
    build=lambda: Transformer(TF_ARGS),
    blocks=lambda m: list(m.layers),
    inputs=lambda rank, i: make_tokens(TF_ARGS, 100 * i + rank),
)
SPECS = [pytest.param(MLP_SPEC, id="mlp"), pytest.param(TF_SPEC, id="transformer")]


def _shard(impl: Impl, spec: Spec, model: nn.Module, mesh: DeviceMesh, raf: bool | None = None) -> None:
    for block in spec.blocks(model):
        impl.fully_shard(block, mesh=mesh, reshard_after_forward=raf)
    impl.fully_shard(model, mesh=mesh, reshard_after_forward=raf)


def _assert_parity(ref: nn.Module, model: nn.Module, *, grads: bool, tol: dict[str, float]) -> None:
    for (name, ref_param), (sharded_name, param) in zip(
        ref.named_parameters(), model.named_parameters(), strict=True
    ):
        assert name == sharded_name
        torch.testing.assert_close(param.full_tensor(), ref_param, **tol, msg=lambda m, n=name: f"{n}: {m}")
        if grads:
            assert isinstance(param.grad, DTensor), name
            torch.testing.assert_close(
                param.grad.full_tensor(), ref_param.grad, **tol, msg=lambda m, n=name: f"{n} grad: {m}"
            )


# ---------------------------------------------------------------------------------------------
# Placements
# ---------------------------------------------------------------------------------------------


def _placements() -> None:
    mesh = hsdp_mesh()
    fsdp2 = get_impl("fsdp2")
    model = seeded(MLP_SPEC.build)
    originals = {n: p.detach().clone() for n, p in model.named_parameters()}
    _shard(fsdp2, MLP_SPEC, model, mesh)
    shard_rank = mesh.get_local_rank("shard")
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        assert param.device_mesh is mesh
        assert tuple(param.placements) == (Replicate(), Shard(0)), name
        # The local rows depend on the shard coordinate only: replicas hold identical shards.
        want = torch.chunk(originals[name], MESH_SHAPE[1], dim=0)[shard_rank]
        torch.testing.assert_close(param.to_local(), want, **EXACT)
        torch.testing.assert_close(param.full_tensor(), originals[name], **EXACT)


def test_hsdp_placements() -> None:
    run_threaded(WORLD, _placements)


# ---------------------------------------------------------------------------------------------
# Training parity with the unsharded reference (gradients averaged over all 4 ranks)
# ---------------------------------------------------------------------------------------------


def _train(spec: Spec, raf: bool | None, steps: int) -> list[float]:
    mesh = hsdp_mesh()
    model = seeded(spec.build)
    ref = copy.deepcopy(model)
    _shard(get_impl("fsdp2"), spec, model, mesh, raf)
    return train_in_lockstep(model, ref, spec.inputs, steps, partial(_assert_parity, tol=TIGHT))


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("raf", [None, False], ids=["raf_None", "raf_False"])
@pytest.mark.parametrize("spec", SPECS)
def test_hsdp_parity_with_unsharded_reference(spec: Spec, raf: bool | None) -> None:
    losses = run_threaded(WORLD, _train, spec, raf, 3)
    assert len({tuple(r) for r in losses}) == WORLD  # every rank saw its own data


def _differential(spec: Spec, steps: int) -> None:
    rank = dist.get_rank()
    mesh = hsdp_mesh()
    ours = seeded(spec.build)
    theirs = copy.deepcopy(ours)
    _shard(get_impl("fsdp2"), spec, ours, mesh)
    _shard(torch_impl(), spec, theirs, mesh)
    our_optim = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    their_optim = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    for step in range(steps):
        x = spec.inputs(rank, step)
        our_loss, their_loss = forward_backward(x, ours, theirs)
        torch.testing.assert_close(our_loss, their_loss, **TIGHT)
        for (name, ours_p), theirs_p in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            assert tuple(ours_p.grad.placements) == tuple(theirs_p.grad.placements), name
            torch.testing.assert_close(ours_p.grad.to_local(), theirs_p.grad.to_local(), **TIGHT)
        step_all(our_optim, their_optim)
    for (name, ours_p), theirs_p in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(
            ours_p.to_local(), theirs_p.to_local(), **TIGHT, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("spec", SPECS)
def test_hsdp_differential_against_torch(spec: Spec) -> None:
    run_threaded(WORLD, _differential, spec, 3)


# ---------------------------------------------------------------------------------------------
# set_requires_all_reduce(False): reduce-scatter only, partial sums kept until the last micro-step
# ---------------------------------------------------------------------------------------------

MICRO_STEPS = 3


def _deferred_all_reduce(impl_name: str, spec: Spec, steps: int) -> list[list[tuple[int, int]]]:
    rank = dist.get_rank()
    impl = get_impl(impl_name)
    mesh = hsdp_mesh()
    model = seeded(spec.build)
    ref = copy.deepcopy(model)
    _shard(impl, spec, model, mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    counts: list[tuple[int, int]] = []
    for step in range(steps):
        for micro in range(MICRO_STEPS):
            last = micro == MICRO_STEPS - 1
            model.set_requires_all_reduce(last)
            x = spec.inputs(rank, 10 * step + micro)
            with count_collectives() as counted:
                model(x).sum().backward()
            counts.append((counted["reduce_scatter"], counted["all_reduce"]))
            ref(x).sum().backward()
            if not last:
                for name, param in model.named_parameters():
                    assert param.grad is None, f"{name}: sharded grad assigned before the all-reduce"
        average_grads(ref)
        if step == 0:
            _assert_parity(ref, model, grads=True, tol=TIGHT)
        step_all(optim, ref_optim)
    _assert_parity(ref, model, grads=False, tol=TIGHT)
    return counts


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("impl_name", ["fsdp2", "torch"])
@pytest.mark.parametrize("spec", SPECS)
def test_requires_all_reduce_false_accumulates_partial_grads(spec: Spec, impl_name: str) -> None:
    model = spec.build()
    blocks = spec.blocks(model)
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    root_has_params = any(id(p) not in in_blocks for p in model.parameters())
    n_groups = len(blocks) + int(root_has_params)
    all_counts = run_threaded(WORLD, _deferred_all_reduce, impl_name, spec, 2)
    # Every micro-step reduce-scatters each group; only the last one all-reduces across replicas.
    want = ([(n_groups, 0)] * (MICRO_STEPS - 1) + [(n_groups, n_groups)]) * 2
    for rank, counts in enumerate(all_counts):
        assert counts == want, f"rank {rank}"


def _no_sync_hsdp() -> None:
    rank = dist.get_rank()
    mesh = hsdp_mesh()
    model = seeded(MLP_SPEC.build)
    ref = copy.deepcopy(model)
    _shard(get_impl("fsdp2"), MLP_SPEC, model, mesh)
    for micro in range(MICRO_STEPS):
        last = micro == MICRO_STEPS - 1
        model.set_requires_gradient_sync(last)
        x = MLP_SPEC.inputs(rank, micro)
        with record_collectives(model) as counted:
            model(x).sum().backward()
        ref(x).sum().backward()
        if not last:
            # No reduce-scatter and no all-reduce at all while gradient sync is off.
            assert counted["reduce_scatter"] == counted["all_reduce"] == 0, counted
            assert all(p.grad is None for p in model.parameters())
    average_grads(ref)
    _assert_parity(ref, model, grads=True, tol=TIGHT)


def test_requires_gradient_sync_false_skips_both_collectives() -> None:
    run_threaded(WORLD, _no_sync_hsdp)
