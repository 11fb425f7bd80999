"""Forward passes under ``torch.func`` transforms (``jvp``, ``vjp``, ``functional_call``, and ``vmap`` of
the first two as ``jacfwd``/``jacrev``), threads as ranks.

The model is two ``fully_shard``-ed Linears under a ``fully_shard``-ed root, built on the meta device
and materialized with ``to_empty``; its very first forward runs inside the transform, so lazy init,
the first all-gather and the first copy-out do too. Outputs (primal and tangent for ``jvp``, primal
and input cotangent for ``vjp``) are compared with the unsharded model's under the same transform:
the fp32 model, or for bf16 mixed precision a bf16 copy of it fed bf16 inputs (what
``cast_forward_inputs`` does), with bf16 tolerances. The check repeats after an ordinary training
step, and both implementations, fsdp2 and torch's ``fully_shard``, run every case (torch's own
failures are marked ``xfail``).

Forward-mode AD has one process-wide dual level, which ``torch.func.jvp`` opens and closes in
whichever thread runs at nesting depth 1: threads as ranks would race on it (one rank closing the
level the other still computes in). ``_shared_dual_level`` opens it once, around the whole run.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist
from torch import nn
from torch._functorch import eager_transforms
from torch.distributed.tensor import DTensor, distribute_tensor

from tests._harness import run_threaded
from tests._impls import IMPL_NAMES, Impl, get_impl
from tests._training import average_grads, mp_policy, seeded, step_all
from tests.models import make_input

BF16, FP32 = torch.bfloat16, torch.float32
IN, HIDDEN, OUT = 8, 13, 5  # 13 and 5 rows: uneven over 2 ranks, so shards are padded
BATCH = 3
WORLD_SIZE = 2

Transform = Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]


@contextlib.contextmanager
def _shared_dual_level() -> Iterator[None]:
    """Keep one forward-AD dual level open for every thread; ``jvp`` then never opens or closes it.

    ``jvp`` opens the level only when torch's module-global nesting count is 1; starting that count
    far above 1 keeps the threads' unsynchronized increments and decrements from ever reaching it.
    """
    with fwAD.dual_level(), mock.patch.object(eager_transforms, "JVP_NESTING", 1000):
        yield


def _two_linears() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


class _CastInput(nn.Module):
    """What ``cast_forward_inputs`` does, for the unsharded reference: cast, then run ``module``."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.module(x.to(self.dtype))
        return out


def _build(impl: Impl, mixed: bool, raf: bool) -> tuple[nn.Module, nn.Module]:
    """``(reference, model)``: an fp32 model, and a meta-built sharded copy filled with its values.

    No forward runs on the sharded model here: its first one is the test's.
    """
    ref = seeded(_two_linears)
    with torch.device("meta"):
        model = _two_linears()
    policy: dict[str, Any] = {"reshard_after_forward": raf}
    if mixed:
        policy["mp_policy"] = mp_policy(impl, param_dtype=BF16, reduce_dtype=FP32, cast_forward_inputs=True)
    impl.fully_shard(model[0], **policy)
    impl.fully_shard(model[2], **policy)
    impl.fully_shard(model, **policy)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param, ref_param in zip(model.parameters(), ref.parameters(), strict=True):
            assert isinstance(param, DTensor)
            param.copy_(distribute_tensor(ref_param.detach(), param.device_mesh, param.placements))
    return ref, model


def _compute_copy(ref: nn.Module, mixed: bool) -> nn.Module:
    """The module the sharded model's forward matches: ``ref`` itself, or its bf16 copy on bf16 inputs."""
    return _CastInput(copy.deepcopy(ref).to(BF16), BF16) if mixed else ref


def _jvp(module: nn.Module, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out, tangent = torch.func.jvp(module, (x,), (t,))
    return out, tangent


def _vjp(module: nn.Module, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out, vjp_fn = torch.func.vjp(module, x)
    cotangent = make_input(tuple(out.shape), dist.get_rank(), seed=7).to(out.dtype)
    (x_grad,) = vjp_fn(cotangent)
    return out, x_grad


def _functional_jvp(module: nn.Module, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``jvp`` of ``functional_call`` with the module's own parameters and buffers."""
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    out, tangent = torch.func.jvp(lambda inp: torch.func.functional_call(module, state, (inp,)), (x,), (t,))
    return out, tangent


def _jacrev(module: nn.Module, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor]:
    """``vjp`` under ``vmap`` (one backward per output element)."""
    return (torch.func.jacrev(module)(x),)


def _jacfwd(module: nn.Module, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor]:
    """``jvp`` under ``vmap`` (one tangent per input element)."""
    return (torch.func.jacfwd(module)(x),)


def _assert_same(got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], what: str) -> None:
    # assert_close picks tolerances by dtype: bf16's (rtol 1.6e-2) for mixed-precision outputs.
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g.dtype == e.dtype, (what, i, g.dtype, e.dtype)
        torch.testing.assert_close(g, e, msg=lambda m, i=i: f"{what}, output {i}: {m}")


def _reference_grads(ref: nn.Module, compute: nn.Module, mixed: bool) -> None:
    """Move ``compute``'s gradients (bf16 copy) onto the fp32 ``ref`` and average them over ranks."""
    if mixed:
        for param, low in zip(ref.parameters(), compute.parameters(), strict=True):
            param.grad = low.grad.to(FP32) if low.grad is not None else None
    average_grads(ref)


def _transform_then_train(name: str, transform: Transform, mixed: bool, raf: bool) -> None:
    impl = get_impl(name)
    ref, model = _build(impl, mixed, raf)
    # Built before any forward: with reshard_after_forward=False, parameters() lists the unsharded
    # parameters between a forward and its backward.
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    rank = dist.get_rank()
    x, t = make_input((BATCH, IN), rank, seed=0), make_input((BATCH, IN), rank, seed=1)
    expected = transform(_compute_copy(ref, mixed), x, t)
    _assert_same(transform(model, x, t), expected, "first forward")
    if transform is not _jacrev:  # a Jacobian with respect to the fp32 input is fp32
        assert expected[0].dtype == (BF16 if mixed else FP32)
    # An ordinary training step on both: forward, backward, gradient average (reference), SGD step.
    x_step = make_input((BATCH, IN), rank, seed=2)
    model(x_step).sum().backward()
    compute = _compute_copy(ref, mixed)
    compute(x_step).sum().backward()
    _reference_grads(ref, compute, mixed)
    step_all(optim, ref_optim)
    for param, ref_param in zip(model.parameters(), ref.parameters(), strict=True):
        assert isinstance(param, DTensor)
        torch.testing.assert_close(param.full_tensor(), ref_param)
    _assert_same(transform(model, x, t), transform(_compute_copy(ref, mixed), x, t), "after a step")


_FUNCTIONAL_RAF_FALSE = (
    "torch's fully_shard: with reshard_after_forward=False, functional_call's restore re-registers the "
    "sharded DTensors while the group stays unsharded, so the next forward mixes Tensor and DTensor"
)


def _cases() -> Iterator[Any]:
    transforms = {
        "jvp": _jvp,
        "vjp": _vjp,
        "functional_call": _functional_jvp,
        "jacrev": _jacrev,
        "jacfwd": _jacfwd,
    }
    for name in IMPL_NAMES:
        for transform_id, transform in transforms.items():
            for raf in (True, False):
                marks = []
                if name == "torch" and transform_id == "functional_call" and not raf:
                    reason = _FUNCTIONAL_RAF_FALSE
                    marks.append(pytest.mark.xfail(strict=True, reason=reason))
                raf_id = "raf" if raf else "no_raf"
                yield pytest.param(name, transform, raf, id=f"{name}-{transform_id}-{raf_id}", marks=marks)


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("name", "transform", "raf"), list(_cases()))
def test_first_forward_under_transform_then_training(
    name: str, transform: Transform, raf: bool, mixed: bool
) -> None:
    with _shared_dual_level():
        run_threaded(WORLD_SIZE, _transform_then_train, name, transform, mixed, raf)


# ---------------------------------------------------------------------------------------------
# Backward through jvp outputs: the outer autograd graph (a loss on the tangent, with or without the
# primal), which no tensor hook sees because the outputs report requires_grad=False in the transform
# ---------------------------------------------------------------------------------------------


def _backward_through_jvp(name: str, mixed: bool, raf: bool, with_primal: bool) -> None:
    impl = get_impl(name)
    ref, model = _build(impl, mixed, raf)
    compute = _compute_copy(ref, mixed)
    rank = dist.get_rank()
    x, t = make_input((BATCH, IN), rank, seed=0), make_input((BATCH, IN), rank, seed=1)
    for module in (model, compute):
        out, tangent = torch.func.jvp(module, (x,), (t,))
        # Inside the transform these outputs report requires_grad=False; outside, both require grad.
        assert out.requires_grad
        assert tangent.requires_grad
        loss = tangent.float().pow(2).sum()
        (loss + out.sum() if with_primal else loss).backward()
    _reference_grads(ref, compute, mixed)
    for (fqn, param), ref_param in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert isinstance(param, DTensor), fqn
        if ref_param.grad is None:  # e.g. the last bias, for a loss on the tangent only
            assert param.grad is None, fqn
            continue
        assert isinstance(param.grad, DTensor), fqn
        torch.testing.assert_close(
            param.grad.full_tensor(),
            ref_param.grad,
            **({"rtol": 1.6e-2, "atol": 1e-5} if mixed else {}),
            msg=lambda m, n=fqn: f"{n}: {m}",
        )


@pytest.mark.parametrize("with_primal", [True, False], ids=["primal_and_tangent", "tangent_only"])
@pytest.mark.parametrize("raf", [True, False], ids=["raf", "no_raf"])
@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
def test_backward_through_jvp_outputs(impl: Impl, mixed: bool, raf: bool, with_primal: bool) -> None:
    with _shared_dual_level():
        run_threaded(WORLD_SIZE, _backward_through_jvp, impl.name, mixed, raf, with_primal)
