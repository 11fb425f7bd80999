"""Helpers shared by the spawned snapshot tests of HSDP layouts (plain and with sliced optimizer state).

``train_step`` (one AdamW step on a rank's own batch), ``whole`` (every parameter and optimizer state
entry as its whole tensor, to compare runs) and ``snapshots`` (``fsdp2.Snapshots`` every 2 steps, 2
ranks a simulated node); ``received_from`` (what a restore plan's ``outgoing`` sent a rank, read
per sender as the exchange hands it to ``incoming``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    inputs = torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))
    model(inputs).square().sum().backward()
    optim.step()
    optim.zero_grad()


def whole(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state entry as its whole tensor."""
    out = {}
    for name, param in model.named_parameters():
        out[name] = param.full_tensor() if isinstance(param, DTensor) else param.detach().clone()
        for key, value in optim.state[param].items():
            value = value.full_tensor() if isinstance(value, DTensor) else value
            out[f"{name}/{key}"] = value.detach().clone()
    return out


def snapshots(root: str, model: torch.nn.Module, optim: torch.optim.Optimizer, name: str) -> Any:
    import fsdp2

    node = f"{root}/node{dist.get_rank() // 2}"  # 2 ranks a node
    return fsdp2.Snapshots(model, optim, every=2, directory=node, name=name, job="j")


def received_from(sent: dict[int, dict[int, list[torch.Tensor]]], me: int) -> Any:
    """``part(sender)``: the bytes ``sent[sender]`` holds for ``me``, back to back (none: empty)."""

    def part(sender: int) -> torch.Tensor:
        pieces = sent[sender].get(me, [])
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)

    return part
