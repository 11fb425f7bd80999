"""Shared pieces of the training tests: a seeded model, the lockstep forward/backward of a model
and its reference, the reference's gradient average over ranks, and the optimizers' step.

The reference is an unsharded copy of the model run on the same per-rank inputs; averaging its
gradients over ranks (all-reduce AVG) is what FSDP's reduce-scatter computes shard by shard.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests._harness import broadcast_module_
from tests._impls import Impl

EXACT: dict[str, float] = {"rtol": 0.0, "atol": 0.0}
TIGHT: dict[str, float] = {}  # assert_close's float32 defaults: rtol 1.3e-6, atol 1e-5

Inputs = Callable[[int, int], Any]  # (rank, step) -> input
AssertParity = Callable[..., None]  # (ref, model, *, grads: bool)


def seeded(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` after ``torch.manual_seed(0)``, then rank 0's values everywhere (threads share the RNG)."""
    torch.manual_seed(0)
    return broadcast_module_(build())


def fill_deterministic_(module: nn.Module, scale: float = 1.0, seed: int = 0) -> nn.Module:
    """Overwrite every parameter with normal values from a private generator; returns ``module``.

    The same values on every call, thread and process (threads share torch's global RNG, so building
    under ``torch.manual_seed`` in rank threads races).
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * scale)
    return module


def mp_policy(impl: Impl, **kwargs: Any) -> Any:
    """The implementation's own ``MixedPrecisionPolicy`` built from ``kwargs``."""
    if impl.name == "fsdp2":
        import fsdp2

        return fsdp2.MixedPrecisionPolicy(**kwargs)
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(**kwargs)


def average_grads(ref: nn.Module, skip: Collection[str] = ()) -> None:
    """All-reduce (AVG) every present gradient of ``ref`` except the parameters named in ``skip``."""
    for name, param in ref.named_parameters():
        if param.grad is not None and name not in skip:
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)


def forward_backward(x: Any, *models: nn.Module) -> list[torch.Tensor]:
    """Every model's ``model(x).sum()``, then each loss's backward; returns the losses."""
    losses = [model(x).sum() for model in models]
    for loss in losses:
        loss.backward()
    return losses


def step_all(*optims: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    """Step every optimizer, then zero every optimizer's gradients."""
    for optim in optims:
        optim.step()
    for optim in optims:
        optim.zero_grad(set_to_none=set_to_none)


def train_in_lockstep(
    model: nn.Module,
    ref: nn.Module,
    inputs: Inputs,
    steps: int,
    assert_parity: AssertParity,
    *,
    local_grads: Collection[str] = (),
    during: Callable[[], None] | None = None,
) -> list[float]:
    """``steps`` AdamW steps on ``model`` and its reference ``ref``; returns this rank's losses.

    Losses agree every step (exactly on the first, while the parameters are the initial ones),
    gradients after the first backward, parameters after the last step. The reference's
    gradients are averaged over ranks, except those named in ``local_grads``; ``during`` runs
    before each optimizer step.
    """
    rank = dist.get_rank()
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_optim = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(steps):
        loss, ref_loss = forward_backward(inputs(rank, step), model, ref)
        torch.testing.assert_close(loss, ref_loss, **(EXACT if step == 0 else TIGHT))
        average_grads(ref, local_grads)
        if step == 0:
            assert_parity(ref, model, grads=True)
        if during is not None:
            during()
        step_all(optim, ref_optim)
        losses.append(loss.item())
    assert_parity(ref, model, grads=False)
    return losses


def small_sharded_mlp(mesh: Any = None) -> nn.Module:
    """``Linear(4, 8) ReLU Linear(8, 8) ReLU Linear(8, 2)``, modules 0 and 2 and the root sharded."""
    import fsdp2

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    fill_deterministic_(model)
    for layer in (model[0], model[2]):
        fsdp2.fully_shard(layer, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    return model


def mlp_step(model: nn.Module, rank: int, seed: int = 0) -> None:
    """Forward and backward of a rank-dependent batch of 2 x 4 (a different batch per ``seed``)."""
    x = torch.arange(8.0).reshape(2, 4) / (3 + rank + seed)
    model(x).square().sum().backward()
