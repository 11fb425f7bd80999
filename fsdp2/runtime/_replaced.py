"""Parameters ``fully_shard`` replaced, and optimizers still holding them.

Owns: marking the original parameter objects a ``fully_shard`` call replaces with sharded DTensors,
and refusing an optimizer step over any of them. Such an optimizer was built before ``fully_shard``:
its parameters are no longer in the model, never get gradients, and its step would silently train
nothing (torch's ``fully_shard`` lets it). Does not own: the optimizer or its step.

Cost: one participant in the optimizer pre-step hook (``_optimizer_hooks``). An optimizer's parameters
are scanned on its first step, and again only after another ``fully_shard`` call or a change in its
number of param groups.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Any

import torch

from ._optimizer_hooks import take_part

# id -> weak reference of each replaced parameter object. Not an attribute on the tensor: a deep
# copy of a replaced parameter (a fresh tensor the user may train) must not count as replaced.
_replaced: dict[int, weakref.ref[torch.Tensor]] = {}
_calls = itertools.count(1)
_generation = 0  # bumped by every fully_shard call that replaced parameters
# optimizer -> (generation, number of param groups) when its parameters were last scanned
_scanned: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, int]] = weakref.WeakKeyDictionary()
_joined = False


def mark_replaced(params: list[torch.Tensor]) -> None:
    """Record that ``params`` (the original objects) are being replaced by sharded parameters."""
    global _generation, _joined
    if not params:
        return
    for param in params:
        _replaced[id(param)] = weakref.ref(param, functools.partial(_forget, id(param)))
    _generation = next(_calls)
    if not _joined:
        _joined = True
        take_part(before=_refuse_replaced)


def _refuse_replaced(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    groups = optimizer.param_groups
    seen = (_generation, len(groups))
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
