"""A parameter's ``grad_dtype`` is honoured: bf16 weights with fp32 gradients, as on the unsharded model.

The reference is the unsharded model with the same ``grad_dtype``: autograd accumulates each
backward's gradient into an fp32 ``.grad``; the sharded model's gradients are averaged across ranks
in that dtype (unless the policy's ``reduce_dtype`` says otherwise) and kept in it. torch 2.13's
``fully_shard`` drops a ``grad_dtype`` set before it (the gradients come out bf16) and raises at the
first backward for one set on the sharded parameters (docs/precision.md).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp2
from tests._harness import run_threaded


def _model() -> nn.Sequential:
    torch.manual_seed(0)  # built once, in the main thread
    return nn.Sequential(nn.Linear(12, 10), nn.Tanh(), nn.Linear(10, 5)).bfloat16()


def _batch(rank: int, micro: int) -> torch.Tensor:
    return torch.randn(4, 12, generator=torch.Generator().manual_seed(10 * rank + micro)).bfloat16()


def _reference(base: nn.Module, world: int, micro_batches: int) -> list[torch.Tensor]:
    """fp32 ``.grad`` of the unsharded model: per rank, its micro-batches accumulated; then averaged."""
    per_rank = []
    for rank in range(world):
        model = copy.deepcopy(base)
        for param in model.parameters():
            param.grad_dtype = torch.float32
        for micro in range(micro_batches):
            model(_batch(rank, micro)).float().pow(2).sum().backward()
        per_rank.append([p.grad for p in model.parameters()])
    return [torch.stack(grads).sum(0) / world for grads in zip(*per_rank, strict=True)]


def _sharded(base: nn.Module, micro_batches: int, when: str, reduce_dtype: torch.dtype | None) -> list:
    model = copy.deepcopy(base)
    if when == "before":
        for param in model.parameters():
            param.grad_dtype = torch.float32
    policy = fsdp2.MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    fsdp2.fully_shard(model[0], mp_policy=policy)
    fsdp2.fully_shard(model, mp_policy=policy)
    if when == "after":  # on the sharded parameters, before the first forward
        for param in model.parameters():
            param.grad_dtype = torch.float32
    for micro in range(micro_batches):
        model(_batch(dist.get_rank(), micro)).float().pow(2).sum().backward()
    for param in model.parameters():
        assert param.dtype == torch.bfloat16
        assert param.grad.dtype == torch.float32
    return [p.grad.full_tensor() for p in model.parameters()]


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_grad_dtype_gradients_match_the_unsharded_model(micro_batches: int, when: str) -> None:
    base = _model()
    expected = _reference(base, 2, micro_batches)
    for grads in run_threaded(2, _sharded, base, micro_batches, when, None):
        for grad, ref in zip(grads, expected, strict=True):
            assert grad.dtype == torch.float32
            if micro_batches == 1:
                torch.testing.assert_close(grad, ref, rtol=0, atol=0)  # one fp32 sum, one division
            else:  # the same fp32 terms, added in another order
                torch.testing.assert_close(grad, ref, rtol=1e-6, atol=1e-7)


def test_the_policy_reduce_dtype_wins_for_the_reduction_and_the_gradient_stays_in_grad_dtype() -> None:
    base = _model()
    expected = _reference(base, 2, 1)
    bf16 = run_threaded(2, _sharded, base, 1, "before", torch.bfloat16)
    for grads in bf16:
        for grad, ref in zip(grads, expected, strict=True):
            # reduced in bf16, then kept in fp32: the fp32 reference rounded to bf16 once or twice
            torch.testing.assert_close(grad, ref, rtol=1.6e-2, atol=1e-5)
    assert any(not torch.equal(g, r) for g, r in zip(bf16[0], expected, strict=True)), "not reduced in bf16"


def _train_sgd(base: nn.Module, steps: int, sharded: bool, world: int) -> list[torch.Tensor]:
    """``steps`` SGD steps (momentum: state kept across steps) of bf16 weights with fp32 gradients."""
    model = copy.deepcopy(base)
    for param in model.parameters():
        param.grad_dtype = torch.float32
    if sharded:
        fsdp2.fully_shard(model[0])
        fsdp2.fully_shard(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        ranks = [dist.get_rank()] if sharded else range(world)
        for rank in ranks:
            model(_batch(rank, step)).float().pow(2).sum().backward()
        if not sharded:
            for param in model.parameters():
                param.grad /= world
        optim.step()
        optim.zero_grad()
    return [p.full_tensor() if sharded else p.detach() for p in model.parameters()]


def test_grad_dtype_with_local_shard_optimizer_steps() -> None:
    """From the second step on, SGD runs on the local shards (the default ``FSDP2_LOCAL_STEP``): the
    fp32 gradient is given to the bf16 local tensor, whose own ``grad_dtype`` must allow it."""
    base = _model()
    expected = _train_sgd(base, 3, sharded=False, world=2)
    for params in run_threaded(2, _train_sgd, base, 3, True, 2):
        for param, ref in zip(params, expected, strict=True):
            assert param.dtype == torch.bfloat16
            torch.testing.assert_close(param, ref, rtol=0, atol=0)
