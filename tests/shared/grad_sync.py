"""A stack of layers and the error a test raises inside backward, shared by the gradient-sync and regression
tests.
"""

from __future__ import annotations

import torch
from torch import nn


class BoomError(Exception):
    pass


class Raiser(nn.Module):
    """Identity that raises in forward, or makes backward raise, when asked to."""

    def __init__(self) -> None:
        super().__init__()
        self.fail: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail == "forward":
            raise BoomError("forward")
        if self.fail == "backward":
            x.register_hook(self._raise)
        return x

    @staticmethod
    def _raise(grad: torch.Tensor) -> torch.Tensor:
        raise BoomError("backward")


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.raiser = Raiser()
        self.lin2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Backward computes lin2's gradients (into the unsharded parameters) before the raise.
        return self.lin2(torch.relu(self.raiser(self.lin1(x))))


class Stack(nn.Module):
    def __init__(self, dim: int = 6, n_blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))
        self.head = nn.Linear(dim, 3)  # the root's own parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)
