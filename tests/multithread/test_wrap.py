"""``fsdp2.apply_fully_shard``: the same groups and numbers as the hand-written bottom-up calls."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp2
from fsdp2.testing import run_ranks
from tests.models import ModelArgs, Transformer, TransformerBlock, make_tokens

ARGS = ModelArgs(n_layers=3)


def _groups(model: nn.Module) -> list[str]:
    return sorted(
        group.module_fqn or "<root>"
        for module in model.modules()
        if isinstance(module, fsdp2.FSDPModule)
        for group in module._get_fsdp_state().groups
    )


def _compare(rank: int, world_size: int, base: nn.Module) -> None:
    by_hand, auto = copy.deepcopy(base), copy.deepcopy(base)
    for block in by_hand.layers:
        fsdp2.fully_shard(block, reshard_after_forward=True)
    fsdp2.fully_shard(by_hand, reshard_after_forward=True)
    returned = fsdp2.apply_fully_shard(auto, {TransformerBlock}, reshard_after_forward=True)
    assert returned is auto
    for model in (by_hand, auto):
        model(make_tokens(ARGS, rank)).sum().backward()  # lazy init names the groups
    assert _groups(auto) == _groups(by_hand) == ["<root>", "layers.0", "layers.1", "layers.2"]
    for (name, p), q in zip(auto.named_parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor(), rtol=0, atol=0, msg=name)
        assert p.placements == q.placements


def test_apply_fully_shard_equals_bottom_up_calls() -> None:
    torch.manual_seed(0)
    base = Transformer(ARGS)  # built once here, copied by every rank
    run_ranks(2, _compare, base)


def test_apply_fully_shard_argument_errors() -> None:
    def body(rank: int, world_size: int) -> None:
        model = nn.Sequential(nn.Linear(2, 2))
        with pytest.raises(TypeError, match=r"module_classes must hold nn.Module subclasses, got 'Linear'"):
            fsdp2.apply_fully_shard(model, {"Linear"})  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"expects an nn.Module, got int"):
            fsdp2.apply_fully_shard(3, {nn.Linear})  # type: ignore[arg-type]
        with pytest.warns(UserWarning, match=r"no module of Sequential is an instance of Conv2d"):
            fsdp2.apply_fully_shard(model, {nn.Conv2d})
        assert isinstance(model, fsdp2.FSDPModule)
        assert dist.get_world_size() == 2

    run_ranks(2, body)
