"""The checkpoint tests' model and checks, shared by the DCP and the sharded-checkpointer tests.

``Net``: three residual blocks with buffers, 13 hidden rows so that worlds 2 and 4 pad; ``snapshot``:
full values of parameters, buffers and AdamW state; ``assert_matches``: those equal the expected ones
exactly and the next step equals an unsharded reference given the same weights and AdamW state.
"""

from __future__ import annotations

from typing import Any

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
from torch.distributed.tensor import DTensor

from tests._harness import assert_sharded_parity
from tests._impls import get_impl
from tests._training import EXACT, average_grads, seeded
from tests.models import make_input


class Block(nn.Module):
    """A residual MLP with a buffer; 13 hidden rows so that world 2 and 4 pad."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 13)
        self.down = nn.Linear(13, 8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.relu(self.up(h))) * self.scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 3)
        self.register_buffer("offset", torch.arange(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h) + self.offset


def inputs(rank: int, step: int) -> torch.Tensor:
    return make_input((4, 5), rank, seed=step)


def perturbed() -> Net:
    """Other values than ``seeded(Net)``'s, so that a load has to overwrite every tensor."""
    model = seeded(Net)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.mul_(-2.0).add_(0.25)
    return model


def shard(model: nn.Module, impl: str = "fsdp2") -> nn.Module:
    fully_shard = get_impl(impl).fully_shard
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block)
    fully_shard(model)
    return model


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        loss = model(inputs(dist.get_rank(), step)).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    return losses


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def snapshot(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Full values of every parameter, buffer and AdamW state entry (same on every rank)."""
    return {
        "model": {k: full_value(v) for k, v in model.state_dict().items()},
        "optim": {
            name: {k: full_value(v) for k, v in optim.state[param].items()}
            for name, param in model.named_parameters()
        },
    }


def assert_matches(model: nn.Module, optim: torch.optim.Optimizer, expected: dict[str, Any]) -> None:
    """Parameters, buffers and optimizer state equal ``expected``; the next step equals the reference's."""
    got = snapshot(model, optim)
    torch.testing.assert_close(got, expected, **EXACT)
    # Unsharded reference with the same weights and AdamW state, gradients averaged over ranks.
    ref = Net()
    ref.load_state_dict(expected["model"])
    ref_optim = adamw(ref)
    for name, param in ref.named_parameters():
        ref_optim.state[param] = {k: v.clone() for k, v in expected["optim"][name].items()}
    x = inputs(dist.get_rank(), 100)
    loss, ref_loss = model(x).sum(), ref(x).sum()
    torch.testing.assert_close(loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    average_grads(ref)
    optim.step()
    ref_optim.step()
    assert_sharded_parity(ref, model)
    x = inputs(dist.get_rank(), 101)
    torch.testing.assert_close(model(x).sum(), ref(x).sum())


def dcp_load(impl: str, path: str, expected: dict[str, Any]) -> None:
    model = shard(perturbed(), impl)
    optim = adamw(model)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
    assert_matches(model, optim, expected)
