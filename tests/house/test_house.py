"""The engine's ownership rules, checked on a live model after bucketed training steps.

- Only the root's context and its schedule hold lists of groups (bucket plans, the reduce-scatter
  queue, the usage agreement, which groups an optimizer steps): no group or part of a group refers
  to a group, a state refers to its own groups only, and no fsdp2 module keeps a registry of groups
  at module level. Containers are searched to any depth, weak ones and weak references included.
- The numbers of the bucketed steps equal the unbucketed model's in the same rank (the rules did not
  cost correctness).
"""

from __future__ import annotations

import copy
import gc
import sys
import weakref
from typing import Any

import torch

from fsdp2.group._param_group import FSDPParamGroup
from fsdp2.runtime._schedule import Schedule
from fsdp2.runtime._state import get_state
from tests._harness import broadcast_module_, run_threaded
from tests.shared.bucketing import Blocks, _input, _shard

_CONTAINERS = (list, tuple, set, frozenset, dict, weakref.WeakSet, weakref.WeakKeyDictionary)


def _groups_in(value: Any, depth: int = 6) -> list[FSDPParamGroup]:
    """Groups ``value`` holds: itself, or inside containers (keys too) and weak references, nested."""
    if isinstance(value, FSDPParamGroup):
        return [value]
    if depth == 0:
        return []
    if isinstance(value, weakref.ref):
        return _groups_in(value(), depth - 1)
    items: list[Any] = []
    if isinstance(value, (dict, weakref.WeakKeyDictionary, weakref.WeakValueDictionary)):
        items = [*value.keys(), *value.values()]
    elif isinstance(value, _CONTAINERS):
        items = list(value)
    return [group for item in items for group in _groups_in(item, depth - 1)]


def _groups_referenced(obj: Any) -> list[FSDPParamGroup]:
    """Groups ``obj``'s attributes refer to, directly or nested in containers."""
    fields = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
    for name in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, name):
            fields[name] = getattr(obj, name)
    return [group for value in fields.values() for group in _groups_in(value)]


def _module_registries() -> list[str]:
    """``module.name`` of every fsdp2 module-level value that holds a group."""
    found = []
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("fsdp2") or module is None:
            continue
        for name, value in list(vars(module).items()):
            if isinstance(value, (*_CONTAINERS, weakref.ref)) and _groups_in(value):
                found.append(f"{module_name}.{name}")
    return found


def _only_the_root_holds_groups() -> None:
    torch.manual_seed(0)
    model = broadcast_module_(Blocks([8, 8, 8, 8, 8]))
    plain = copy.deepcopy(model)
    _shard(model, raf=True)
    _shard(plain, raf=True)
    model.set_bucket_cap_mb(25.0, 25.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(3):
        x = _input(8, torch.distributed.get_rank(), step)
        loss, plain_loss = model(x).sum(), plain(x).sum()
        loss.backward()
        plain_loss.backward()
        torch.testing.assert_close(loss, plain_loss, rtol=0, atol=0)
        for param, plain_param in zip(model.parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(param.grad, plain_param.grad, rtol=0, atol=0)
        optimizer.step()  # the step guard's lookups run
        plain_optimizer.step()

    root = get_state(model)
    assert root is not None
    assert root.ctx is not None
    schedule = root.ctx.schedule
    assert isinstance(schedule, Schedule)
    assert any(len(set(map(id, members))) > 1 for members in vars(schedule)["_forward"].values()), (
        "the test did not bucket anything"
    )
    every_group = {id(g) for g in root.ctx.groups()}
    assert {id(g) for g in _groups_referenced(root.ctx.use_agreement)} <= every_group
    assert {id(g) for g in _groups_referenced(root.ctx)} <= every_group
    for state in root.ctx.all_states:
        assert {id(g) for g in _groups_referenced(state)} <= {id(g) for g in state.groups}, state
        for group in state.groups:
            assert _groups_referenced(group) == [], f"{group} refers to a group"
            parts = (group.gatherer, group.buffer, group.packed, group.reducer, group.reducer.usage)
            for part in (*parts, group.use_tracker, group.comm_ctx, group.event_scope):
                if part is not None:
                    assert _groups_referenced(part) == [], f"{group}: {type(part).__name__} refers to a group"
            for fsdp_param in group.fsdp_params:
                assert _groups_referenced(fsdp_param) == [], f"{fsdp_param.fqn} refers to a group"
    assert _module_registries() == [], "module-level registries of groups"


def test_only_the_root_context_holds_lists_of_groups() -> None:
    run_threaded(2, _only_the_root_holds_groups)


def test_the_search_finds_nested_and_weak_references() -> None:
    """The checker itself: a group two containers deep, behind a weak reference, or a weak key."""

    class Holder:
        pass

    group = object.__new__(FSDPParamGroup)
    holder = Holder()
    holder.nested = {"a": [(1, group)]}  # type: ignore[attr-defined]
    assert _groups_referenced(holder) == [group]
    holder.nested = [weakref.ref(group)]  # type: ignore[attr-defined]
    assert _groups_referenced(holder) == [group]
    holder.nested = weakref.WeakKeyDictionary({group: 1})  # type: ignore[attr-defined]
    assert _groups_referenced(holder) == [group]
    holder.nested = weakref.WeakSet([group])  # type: ignore[attr-defined]
    assert _groups_referenced(holder) == [group]


# ---- one step crosses few files ---------------------------------------------------------------------

MAX_FILES_IN_ONE_STEP = 15  # issue 34: torch's FSDP2 enters 6 files for the same step


class _TwoBlocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(2)
        )
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _files_of_one_step() -> dict[str, int]:
    import fsdp2

    package = fsdp2.__file__.rsplit("__init__.py", 1)[0]
    torch.manual_seed(0)
    model = _TwoBlocks()
    plain = copy.deepcopy(model)
    for block in model.blocks:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    x = torch.randn(4, 8)

    def step() -> None:
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(3):  # lazy init, the first steps' plans and caches
        step()
    calls: dict[str, int] = {}

    def profile(frame: Any, event: str, arg: Any) -> None:
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(package):
            key = name[len(package) :]
            calls[key] = calls.get(key, 0) + 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    for _ in range(4):
        plain(x).sum().backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad()
    for param, plain_param in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(param.full_tensor(), plain_param, rtol=0, atol=0)
    return calls


def test_one_plain_step_enters_few_fsdp2_files() -> None:
    """One training step (2 sharded blocks and the root, SGD, one rank) crosses at most 15 files.

    Event recording, debug mode, bucketing and the compiled path stay out of a plain step's way: each
    is entered only when it is on.
    """
    gc.collect()  # models of earlier tests (a debug-mode one keeps the guard's step counter)
    calls = run_threaded(1, _files_of_one_step)[0]
    listing = "\n".join(f"{n:5d} {name}" for name, n in sorted(calls.items(), key=lambda kv: -kv[1]))
    assert len(calls) <= MAX_FILES_IN_ONE_STEP, f"{len(calls)} fsdp2 files in one step:\n{listing}"
    rooms_off_the_step = ("trace/", "compile/", "plan/", "debug/", "weights/")
    assert not any(name.startswith(rooms_off_the_step) for name in calls), listing
