"""The engine's ownership rules, checked on a live model after bucketed training steps.

- Only the root's ``Schedule`` holds lists of groups: no group refers to another group, a state refers
  to its own groups only, and the shared context refers to none (work across groups has one owner).
- The numbers of the bucketed steps equal the unbucketed model's in the same rank (the rules did not
  cost correctness).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from fsdp2.group._param_group import FSDPParamGroup
from fsdp2.runtime._schedule import Schedule
from fsdp2.runtime._state import get_state
from tests._harness import broadcast_module_, run_threaded
from tests.multithread.test_bucketing import Blocks, _input, _shard


def _groups_referenced(obj: Any) -> list[FSDPParamGroup]:
    """Groups ``obj``'s attributes refer to, directly or inside a list, tuple, set or dict."""
    found: list[FSDPParamGroup] = []
    for value in vars(obj).values():
        items = value.values() if isinstance(value, dict) else value
        if isinstance(items, (list, tuple, set, type({}.values()))):
            found.extend(item for item in items if isinstance(item, FSDPParamGroup))
        elif isinstance(value, FSDPParamGroup):
            found.append(value)
    return found


def _only_the_schedule_holds_groups() -> None:
    torch.manual_seed(0)
    model = broadcast_module_(Blocks([8, 8, 8, 8, 8]))
    plain = copy.deepcopy(model)
    _shard(model, raf=True)
    _shard(plain, raf=True)
    model.set_bucket_cap_mb(25.0, 25.0)
    for step in range(3):
        x = _input(8, torch.distributed.get_rank(), step)
        loss, plain_loss = model(x).sum(), plain(x).sum()
        loss.backward()
        plain_loss.backward()
        torch.testing.assert_close(loss, plain_loss, rtol=0, atol=0)
    for param, plain_param in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(param.grad, plain_param.grad, rtol=0, atol=0)

    root = get_state(model)
    assert root is not None
    assert root.ctx is not None
    schedule = root.ctx.schedule
    assert isinstance(schedule, Schedule)
    assert any(len(set(map(id, members))) > 1 for members in vars(schedule)["_forward"].values()), (
        "the test did not bucket anything"
    )
    assert _groups_referenced(root.ctx) == []
    for state in root.ctx.all_states:
        assert {id(g) for g in _groups_referenced(state)} <= {id(g) for g in state.groups}, state
        for group in state.groups:
            assert _groups_referenced(group) == [], f"{group} refers to a sibling group"
            for part in (group.gatherer, group.buffer, group.packed, group.reducer):
                assert _groups_referenced(part) == [], f"{group}: {type(part).__name__} refers to a group"


def test_only_the_schedule_holds_lists_of_groups() -> None:
    run_threaded(2, _only_the_schedule_holds_groups)
