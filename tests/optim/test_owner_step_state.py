"""The general owner step moves every kind of optimizer state and equals the unsharded model.

A declared whole-matrix optimizer (``tests/shared/owner_step.GramMomentum``) keeps a 0-dim step
count, a parameter-shaped momentum, an ``[n, n]`` Gram matrix and a plain count per matrix. Rows go
to the owner and back by one all-to-all each; the Gram matrix and the step count (not row-shaped)
reach every rank of the shard group by one all-gather of each owner's part. Reference: the unsharded
model with the same optimizer, each step's gradients averaged across ranks; parameters and state
equal bit for bit, at 3 ranks (the 2-row head leaves rank 2 an empty shard).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import fsdp2
from tests._harness import run_threaded
from tests.shared.owner_step import GramMomentum

EXACT = {"rtol": 0, "atol": 0}
WORLD = 3


def _base() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 13), nn.Tanh(), nn.Linear(13, 2))


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * rank + step))


def _train(base: nn.Module, sharded: bool) -> dict[str, Any]:
    model = copy.deepcopy(base)
    if sharded:
        for layer in model[::2]:
            fsdp2.fully_shard(layer)
        fsdp2.fully_shard(model)
    optim = GramMomentum([p for p in model.parameters() if p.ndim == 2], lr=0.05)
    if sharded:
        fsdp2.whole_tensor_step(optim)
    for step in range(3):
        for rank in [dist.get_rank()] if sharded else range(WORLD):
            model(_batch(rank, step)).pow(2).mean().backward()
        if not sharded:
            for param in model.parameters():
                param.grad /= WORLD
        optim.step()
        optim.zero_grad()

    def whole(value: Any) -> Any:
        return value.full_tensor() if isinstance(value, DTensor) else value

    params = {n: whole(p).detach().clone() for n, p in model.named_parameters() if p.ndim == 2}
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: {k: whole(v) for k, v in s.items()} for p, s in optim.state.items()}
    return {"params": params, "state": state}


def test_rows_and_whole_state_reach_every_rank_as_on_the_unsharded_model() -> None:
    base = _base()
    expected = run_threaded(1, _train, base, False)[0]
    for out in run_threaded(WORLD, _train, base, True):
        for name, value in out["params"].items():
            torch.testing.assert_close(value, expected["params"][name], **EXACT, msg=name)
        assert out["state"].keys() == expected["state"].keys()
        for name, state in out["state"].items():
            assert state["count"] == expected["state"][name]["count"] == 3
            for key in ("step", "momentum", "gram"):
                torch.testing.assert_close(state[key], expected["state"][name][key], **EXACT, msg=key)
