"""A model of uneven shards, shared by the loading and meta-initialisation tests."""

from __future__ import annotations

import torch
from torch import nn


class _Net(nn.Module):
    """Uneven row counts (6, 3, 5) so that world 4 pads, and a bias-free layer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3, bias=False)
        self.head = nn.Linear(3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))
