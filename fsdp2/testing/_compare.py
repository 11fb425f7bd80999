"""Checking a sharded model against its unsharded self: ``assert_matches_unsharded``.

Owns: building the model twice from one seed (every rank identical), training the sharded copy and
a plain reference in lockstep, averaging the reference's gradients over ranks (what data parallelism
computes), and the comparisons of losses, gradients and parameters. Does not own: sharding (the
user's function does it) or starting ranks (``run_ranks`` or ``torchrun``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def assert_matches_unsharded(
    build_model: Callable[[], nn.Module],
    shard: Callable[[nn.Module], Any],
    make_batch: Callable[[int, int], Any],
    *,
    steps: int = 3,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    seed: int = 0,
    rtol: float | None = None,
    atol: float | None = None,
) -> list[float]:
    """Train a sharded model and its unsharded copy in lockstep on this rank; assert they agree.

    Call it on every rank (inside :func:`fsdp2.testing.run_ranks` or a ``torchrun`` job). The model is
    built once (after ``torch.manual_seed(seed)``, then rank 0's values broadcast), copied, and
    ``shard(model)`` shards one copy (e.g. ``fully_shard`` on each block, then the root). Each step
    feeds ``make_batch(rank, step)`` to both, calls ``loss_fn(output)`` (default ``output.sum()``) and
    backward, averages the reference's gradients over all ranks, and steps both optimizers.

    Checks: losses every step; every gradient after the first backward and every parameter after the
    last step (``full_tensor()`` of sharded ones), with ``torch.testing.assert_close`` (its defaults,
    or ``rtol``/``atol``; pass looser ones for mixed precision).

    Args:
        build_model: returns a fresh model (plain ``nn.Module``).
        shard: shards the model in place (its return value is ignored).
        make_batch: ``(rank, step) -> input`` of the model.
        steps: training steps.
        loss_fn: ``output -> scalar``; default ``output.sum()``.
        optimizer: ``params -> optimizer``; default ``torch.optim.AdamW(params, lr=1e-2)``.
        seed: the seed the model is built with.
        rtol: relative tolerance for the comparisons.
        atol: absolute tolerance for the comparisons.

    Returns:
        This rank's losses, one per step.

    Raises:
        AssertionError: a loss, gradient or parameter differs; the message names it and the step.
    """
    tol = _Tolerance(None, None) if rtol is None and atol is None else _Tolerance(rtol or 0.0, atol or 0.0)
    loss_fn = loss_fn or (lambda out: out.sum())
    optimizer = optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-2))
    torch.manual_seed(seed)
    model = build_model()
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=0)
    ref = copy.deepcopy(model)
    shard(model)
    optim = optimizer([p for p in model.parameters() if p.requires_grad])
    ref_optim = optimizer([p for p in ref.parameters() if p.requires_grad])
    rank = dist.get_rank()
    losses = []
    for step in range(steps):
        batch = make_batch(rank, step)
        loss = loss_fn(model(batch))
        ref_loss = loss_fn(ref(batch))
        loss.backward()
        ref_loss.backward()
        torch.testing.assert_close(
            _full(loss), ref_loss, rtol=tol.rtol, atol=tol.atol, msg=_prefixed(f"loss at step {step}")
        )
        for param in ref.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
        if step == 0:
            _compare(ref, model, "gradient", lambda p: p.grad, tol)
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
        losses.append(float(_full(loss.detach())))
    _compare(ref, model, "parameter", lambda p: p, tol)
    return losses


class _Tolerance(NamedTuple):
    rtol: float | None
    atol: float | None


def _prefixed(what: str) -> Callable[[str], str]:
    return lambda message: f"{what}: {message}"


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _compare(
    ref: nn.Module, model: nn.Module, what: str, pick: Callable[[Any], Any], tol: _Tolerance
) -> None:
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        clean = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        ref_value, value = pick(ref_params[clean]), pick(param)
        if (ref_value is None) != (value is None):
            raise AssertionError(f"{what} of {clean}: present in only one of the two models")
        if value is None:
            continue
        torch.testing.assert_close(
            _full(value).detach(),
            ref_value.detach(),
            rtol=tol.rtol,
            atol=tol.atol,
            msg=_prefixed(f"{what} {clean}"),
        )
