"""Bucketing's model and runs, shared by its thread-rank, gloo, autocap and house tests."""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2.runtime._state import get_state
from fsdp2.testing import record_collectives


class Block(nn.Module):
    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim_in, dim_out)
        self.norm = nn.LayerNorm(dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.lin(x)))


class Blocks(nn.Module):
    """``len(dims) - 1`` blocks plus a root-owned input and output layer."""

    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        self.inp = nn.Linear(dims[0], dims[0])
        self.blocks = nn.ModuleList(Block(a, b) for a, b in itertools.pairwise(dims))
        self.out = nn.Linear(dims[-1], 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _shard(model: Blocks, raf: bool, mp: fsdp2.MixedPrecisionPolicy | None = None) -> None:
    kwargs: dict[str, Any] = {"reshard_after_forward": raf}
    if mp is not None:
        kwargs["mp_policy"] = mp
    for block in model.blocks:
        fsdp2.fully_shard(block, **kwargs)
    fsdp2.fully_shard(model, **kwargs)


def _input(dim: int, rank: int, step: int, micro: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    return torch.randn(4, dim, generator=gen)


def _train(
    model: Blocks,
    dim: int,
    steps: int,
    micro_steps: int,
    counts: list[Counter[str]] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """AdamW steps (with ``micro_steps - 1`` no-sync micro-steps each); losses, first grads, params."""
    rank = dist.get_rank()
    params = list(model.parameters())  # the sharded parameters (set_reshard_after_backward(False) aside)
    optim = torch.optim.AdamW(params, lr=1e-2)
    losses: list[torch.Tensor] = []
    first_grads: list[torch.Tensor] = []
    for step in range(steps):
        with record_collectives(model) as counter:
            for micro in range(micro_steps):
                last = micro == micro_steps - 1
                model.set_requires_gradient_sync(last)
                loss = model(_input(dim, rank, step, micro)).sum()
                loss.backward()
                losses.append(loss.detach().clone())
        if counts is not None:
            counts.append(counter)
        if step == 0:
            first_grads = [_full(p.grad) for p in params]
        optim.step()
        optim.zero_grad()
    return losses, first_grads, [_full(p) for p in params]


def _full(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().clone()


def _caps(model: nn.Module) -> tuple[int | None, int | None]:
    state = get_state(model)
    assert state is not None
    bucketing = state.shared_context().schedule.bucketing
    return bucketing.all_gather_cap, bucketing.reduce_scatter_cap
