"""The model, batches and reference of the spawned pipelining tests (sharded and replicated stages).

``BLOCKS`` residual MLP blocks of width ``DIM`` (``full_model``: the same values in every process),
each data-parallel rank's batch of ``2 x MICROBATCHES`` rows (``batch``), the summed squared error
(``loss``) and the unsharded model's gradients, per micro-batch and averaged over the data-parallel
ranks (``reference_grads``).
"""

from __future__ import annotations

import torch
from torch import nn

from tests._training import fill_deterministic_

DIM, BLOCKS, MICROBATCHES = 8, 8, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def full_model() -> nn.Sequential:
    model = nn.Sequential(*[Block() for _ in range(BLOCKS)])
    fill_deterministic_(model, scale=0.3)
    return model


def batch(dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + dp_rank)
    inputs = torch.randn(2 * MICROBATCHES, DIM, generator=gen)
    return inputs, torch.randn(2 * MICROBATCHES, DIM, generator=gen)


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).sum()


def reference_grads(dp_size: int) -> dict[int, dict[str, torch.Tensor]]:
    """Per block: the unsharded model's gradients, summed over micro-batches, / micro-batches, dp-averaged."""
    model = full_model()
    for dp_rank in range(dp_size):
        inputs, target = batch(dp_rank)
        loss(model(inputs), target).backward()
    return {
        i: {name: p.grad / (MICROBATCHES * dp_size) for name, p in block.named_parameters()}
        for i, block in enumerate(model)
    }
