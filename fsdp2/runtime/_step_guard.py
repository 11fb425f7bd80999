"""What an optimizer step means for the groups that own its parameters.

Owns: the roots it watches (weak references to every ``RootContext``, registered at its lazy init;
each root holds its own groups and, per optimizer, which of them the optimizer steps: rebuilt only
when roots are added or the optimizer's parameter lists change), and its part in the optimizer
pre-step and post-step hooks (``_optimizer_hooks``) that turns silent mistakes into an error or the
intended result:

- a step over parameter objects ``fully_shard`` replaced (an optimizer built before it): their
  objects are no longer in the model and never get gradients, so the step would silently train
  nothing (torch's ``fully_shard`` lets it): ``RuntimeError`` (``mark_replaced`` records them; an
  optimizer's parameters are scanned at its first step, and again only after another ``fully_shard``
  call or a change in its number of param groups);
- a step while a group still holds gradients that were never reduced (a backward with
  ``set_requires_gradient_sync(False)`` and no synced backward after it): ``RuntimeError`` before the
  step changes anything; the sharded gradients do not contain them, so the step would ignore them;
- a step between a forward and the backward of that forward: the group remembers it, and that
  backward raises (it would differentiate with the stepped parameters);
- a step after a backward that kept the parameters unsharded (``set_reshard_after_backward(False)``):
  the group reshards after the step, so the next forward gathers the updated parameters instead of
  reusing the stale unsharded ones;
- a step after an ``fsdp2.accumulate`` block that raised: ``RuntimeError`` until ``zero_grad()``, since
  the gradients hold the micro-batches reduced before the exception (a partial accumulation);
- ``optimizer.zero_grad()`` after a no-sync backward: it also drops the gradients the groups hold for
  a later synced backward, as it would clear them on the unsharded model (``torch.optim.Optimizer``'s
  ``zero_grad`` is wrapped once, at the first ``fully_shard``; ``FSDPModule.zero_grad`` does the same).

Does not own: the flags behind it (``FSDPParamGroup`` sets them; this module reads them and calls the
group's methods), the lists of groups (the roots'), or the optimizer. Every case needs a forward, so
groups whose root has not run one yet have nothing to guard.
Cost: one participant in each optimizer-step hook (``_optimizer_hooks``) and one attribute check
per group of the stepped parameters.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Any, Protocol

import torch
from torch import nn

from ..base import ShardedState, TrainingState, eager
from ..group import FSDPParamGroup
from ._optimizer_hooks import take_part

_roots: list[weakref.ref[Any]] = []  # the watched RootContexts, in the order they were adopted
_calls = itertools.count(1)
_generation = 0  # bumped whenever a root is added
_joined: list[Any] = []  # the way out of the optimizer-step hooks, once joined
# id -> weak reference of each replaced parameter object. Not an attribute on the tensor: a deep
# copy of a replaced parameter (a fresh tensor the user may train) must not count as replaced.
_replaced: dict[int, weakref.ref[torch.Tensor]] = {}
_replacements = 0  # bumped by every fully_shard call that replaced parameters
# optimizer -> (replacements, number of param groups) when its parameters were last scanned
_scanned: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, int]] = weakref.WeakKeyDictionary()


class _Root(Protocol):
    """What the guard reads of a root's context (``_root.RootContext``)."""

    # optimizer -> ((generation, parameter count), the root's groups it steps, in its parameter order)
    stepped_groups: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[tuple[int, int], list[Any]]]

    def groups(self) -> list[FSDPParamGroup]: ...


def watch_optimizer_steps() -> None:
    """Join the optimizer-step hooks and wrap ``zero_grad`` (once; called by ``fully_shard``)."""
    if not _joined:
        _joined.append(take_part(before=_before_step, after=_after_step))
        _wrap_zero_grad()


def mark_replaced(params: list[torch.Tensor]) -> None:
    """Record that ``params`` (the original objects) are being replaced by sharded parameters."""
    global _replacements
    if not params:
        return
    for param in params:
        _replaced[id(param)] = weakref.ref(param, functools.partial(_forget, id(param)))
    _replacements = next(_calls)
    watch_optimizer_steps()


def _refuse_replaced(optimizer: torch.optim.Optimizer) -> None:
    groups = optimizer.param_groups
    seen = (_replacements, len(groups))
    if _scanned.get(optimizer) == seen:
        return
    params = (p for group in groups for p in group["params"])
    stale = [index for index, param in enumerate(params) if _is_replaced(param)]
    if stale:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step(): {len(stale)} of its parameters (positions {stale[:8]}"
            f"{', ...' if len(stale) > 8 else ''} in its param groups) were replaced by fully_shard, "
            "so they are no longer in the model and this step would not train them. Build the "
            "optimizer after fully_shard, from model.parameters() (the sharded DTensors)."
        )
    _scanned[optimizer] = seen


def _is_replaced(param: torch.Tensor) -> bool:
    ref = _replaced.get(id(param))
    return ref is not None and ref() is param


def _forget(key: int, ref: weakref.ref[torch.Tensor]) -> None:
    if _replaced.get(key) is ref:  # not a newer object that reused the id
        del _replaced[key]


def groups_changed() -> None:
    """A root's groups changed (a split): the optimizers' maps are rebuilt at their next step."""
    global _generation
    _generation = next(_calls)


def watch_root(root: _Root) -> None:
    """Guard steps over the groups of ``root`` (its lazy init)."""
    global _generation
    _roots[:] = [ref for ref in _roots if ref() is not None]
    _roots.append(weakref.ref(root))
    _generation = next(_calls)


def _wrap_zero_grad() -> None:
    original = torch.optim.Optimizer.zero_grad

    @functools.wraps(original)
    def zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        original(self, set_to_none)
        drop_held_gradients(_stepped_groups(self))

    torch.optim.Optimizer.zero_grad = eager(zero_grad)  # type: ignore[method-assign]


def drop_held_gradients(groups: list[FSDPParamGroup]) -> None:
    """Forget the gradients no-sync backwards left for a later reduction (what zero_grad means)."""
    for group in groups:
        drop_unreduced_grads(group)


def _stepped_groups(optimizer: torch.optim.Optimizer) -> list[FSDPParamGroup]:
    """The groups whose sharded parameters ``optimizer`` steps, root by root."""
    key = (_generation, sum(len(group["params"]) for group in optimizer.param_groups))
    found: list[FSDPParamGroup] = []
    ids: dict[int, int] | None = None  # parameter id -> position in the optimizer, built on a miss
    for ref in _roots:
        root = ref()
        if root is None:
            continue
        cached = root.stepped_groups.get(optimizer)
        if cached is None or cached[0] != key:
            if ids is None:
                params = (p for group in optimizer.param_groups for p in group["params"])
                ids = {id(p): i for i, p in enumerate(params)}
            positions = {}
            for group in root.groups():
                where = [ids[id(p)] for p in sharded_params(group) if id(p) in ids]
                if where:
                    positions[id(group)] = (min(where), group)
            cached = (key, [group for _, group in sorted(positions.values(), key=lambda item: item[0])])
            root.stepped_groups[optimizer] = cached
        found.extend(cached[1])
    return found


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _refuse_replaced(optimizer)
    groups = _stepped_groups(optimizer)
    partial = [why for why in map(partial_grads, groups) if why]
    if partial:
        raise RuntimeError(f"{type(optimizer).__name__}.step(): {partial[0]}")
    held = [g for g in groups if holds_unreduced_grads(g)]
    if held:
        names = ", ".join(g.module_fqn or "the root" for g in held[:4]) + (", ..." if len(held) > 4 else "")
        raise RuntimeError(
            f"{type(optimizer).__name__}.step(): {len(held)} fully_shard group(s) ({names}) still hold "
            "gradients from a backward with set_requires_gradient_sync(False) that no synced backward "
            "has reduced, so this step would ignore them. Call set_requires_gradient_sync(True) before "
            "the last micro-batch's backward (the reduction of that backward includes the held "
            "gradients), then step."
        )
    for group in groups:
        before_optimizer_step(group)


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group in _stepped_groups(optimizer):
        after_optimizer_step(group)


# ---- what a step means for one group ----------------------------------------------------------------


def sharded_params(group: FSDPParamGroup) -> list[nn.Parameter]:
    """The sharded parameters an optimizer holds for ``group``."""
    return [p.sharded_param for p in group.fsdp_params]


def holds_unreduced_grads(group: FSDPParamGroup) -> bool:
    """Whether a no-sync backward left gradients that no synced backward has reduced yet."""
    return group.unreduced_grads


def drop_unreduced_grads(group: FSDPParamGroup) -> None:
    """Forget those gradients (what ``zero_grad`` means for them), and that they were partial."""
    if group.unreduced_grads or group.partial_grads:
        group.drop_unreduced_grads()


def mark_partial_grads(group: FSDPParamGroup, why: str) -> None:
    """``group``'s gradients hold a partial accumulation: optimizer steps refuse them until zero_grad."""
    group.partial_grads = why


def partial_grads(group: FSDPParamGroup) -> str | None:
    """Why ``group``'s gradients are partial (``None``: they are not)."""
    return group.partial_grads


def before_optimizer_step(group: FSDPParamGroup) -> None:
    """A step of ``group``'s parameters is about to run: a pending backward will refuse to run."""
    if group.awaiting_backward:
        group.stepped_after_forward = True


def after_optimizer_step(group: FSDPParamGroup) -> None:
    """A step ran: unsharded parameters kept after backward are stale, so reshard them."""
    if (
        group.sharded_state is ShardedState.UNSHARDED
        and group.training_state is TrainingState.IDLE
        and not group.awaiting_backward
    ):
        group.reshard()  # the next forward gathers the updated parameters
