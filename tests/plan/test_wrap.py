"""``fsdp2.apply_fully_shard``: the same sharding as hand-written bottom-up ``fully_shard`` calls.

- the same modules become ``FSDPModule``s, with the same parameters per group, the same unshard /
  reshard / post-backward event sequence, equal losses and parameters over training steps;
- nested classes (``FeedForward`` inside ``TransformerBlock``) are sharded inner first, and keyword
  arguments reach every call;
- bad ``module_classes`` raise ``TypeError`` naming the entry before anything changes; nothing matched
  shards the root alone with a warning.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp2
from tests._harness import run_threaded
from tests._training import EXACT, seeded
from tests.models import FeedForward, ModelArgs, Transformer, TransformerBlock, make_tokens


def _by_hand_blocks(model: Transformer) -> None:
    for block in model.layers:
        fsdp2.fully_shard(block, reshard_after_forward=True)
    fsdp2.fully_shard(model, reshard_after_forward=True)


def _by_hand_nested(model: Transformer) -> None:
    for block in model.layers:
        fsdp2.fully_shard(block.feed_forward, reshard_after_forward=True)
        fsdp2.fully_shard(block, reshard_after_forward=True)
    fsdp2.fully_shard(model, reshard_after_forward=True)


def _groups(model: nn.Module) -> dict[str, list[str]]:
    """Sharded module name -> the names of the parameters its group manages."""
    groups: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, fsdp2.FSDPModule):
            groups_of = module._get_fsdp_state().groups
            ids = {id(p.sharded_param) for group in groups_of for p in group.fsdp_params}
            groups[name] = [n for n, p in model.named_parameters() if id(p) in ids]
    return groups


def _matches_by_hand(classes: set[type[nn.Module]], by_hand: Callable[[Transformer], None]) -> None:
    args = ModelArgs(n_layers=3)
    base = seeded(lambda: Transformer(args))
    model, expected = copy.deepcopy(base), copy.deepcopy(base)
    assert fsdp2.apply_fully_shard(model, classes, reshard_after_forward=True) is model
    by_hand(expected)
    assert _groups(model) == _groups(expected)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, expected)]
    for step in range(3):
        tokens = make_tokens(args, dist.get_rank() + 10 * step)
        events, losses = [], []
        for m, optim in zip((model, expected), optims, strict=True):
            with fsdp2.record_events() as recorded:
                loss = m(tokens).sum()
                loss.backward()
            optim.step()
            optim.zero_grad()
            events.append([(e.kind, e.module_fqn, e.training_state) for e in recorded])
            losses.append(loss.detach())
        assert events[0] == events[1]
        torch.testing.assert_close(losses[0], losses[1], **EXACT)
    for (name, param), other in zip(model.named_parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(param.full_tensor(), other.full_tensor(), **EXACT, msg=name)


# Dropout(p=0) returns its input: FeedForward's output is a view (same warning either way).
@pytest.mark.filterwarnings("ignore:A forward output of an FSDP module is a view")
@pytest.mark.parametrize(
    ("classes", "by_hand"),
    [({TransformerBlock}, _by_hand_blocks), ({TransformerBlock, FeedForward}, _by_hand_nested)],
    ids=["blocks", "nested"],
)
def test_apply_fully_shard_equals_bottom_up_calls(
    classes: set[type[nn.Module]], by_hand: Callable[[Transformer], None]
) -> None:
    run_threaded(2, _matches_by_hand, classes, by_hand)


def _nothing_matched() -> None:
    model = seeded(lambda: Transformer(ModelArgs()))
    with pytest.warns(UserWarning, match=r"no instance of Conv2d inside this Transformer: only the root is"):
        fsdp2.apply_fully_shard(model, nn.Conv2d)
    assert list(_groups(model)) == [""]
    assert len(_groups(model)[""]) == len(list(model.parameters()))


def test_apply_fully_shard_nothing_matched_shards_root_and_warns() -> None:
    run_threaded(2, _nothing_matched)


@pytest.mark.parametrize(
    ("classes", "match"),
    [
        ({TransformerBlock, "Block"}, r"module_classes holds 'Block', which is not an nn\.Module subclass"),
        ([nn.Linear(2, 2)], r"holds Linear\(in_features=2.*not an nn\.Module subclass"),
        ({int}, r"holds <class 'int'>, which is not an nn\.Module subclass"),
        ("TransformerBlock", r"module class or a collection of them, got str 'TransformerBlock'"),
        (set(), r"at least one module class"),
    ],
    ids=["name", "instance", "non-module-class", "string", "empty"],
)
def test_apply_fully_shard_bad_classes_raise_before_any_change(classes: Any, match: str) -> None:
    model = Transformer(ModelArgs())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TypeError, match=match):
        fsdp2.apply_fully_shard(model, classes)
    assert not any(isinstance(m, fsdp2.FSDPModule) for m in model.modules())
    torch.testing.assert_close(model.state_dict(), before, **EXACT)
