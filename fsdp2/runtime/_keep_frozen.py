"""Frozen parameters gathered once and kept: ``fsdp2.keep_frozen_gathered``.

Owns: choosing which frozen parameters of a root's groups stay unsharded (largest first, within a
budget of unsharded bytes per rank, the same choice on every rank) and asking the root's context to
keep them (``RootContext.keep_gathered``: a group of their own where they share one with trainable
parameters; a later call first stops keeping what an earlier one kept). Does not own: what a kept
group does each step (its unsharded buffer holds the copy and checks its shards' versions, see
[Note: A kept copy] in ``group/_unshard_buffer.py``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..group import FSDPParamGroup
from ..param import FSDPParam
from ._root import RootContext
from ._state import FSDPState, busy, get_state, states_under

__all__ = ["keep_frozen_gathered"]


def keep_frozen_gathered(model: nn.Module, budget_bytes: int | None = None) -> list[str]:
    """Keep the frozen parameters of ``model`` unsharded once gathered, within ``budget_bytes`` per rank.

    For LoRA and other fine-tuning with a frozen backbone: parameters with ``requires_grad=False``
    are all-gathered at their first use and the gathered copy stays across forwards, backwards,
    micro-batches and optimizer steps, so a step gathers only the trainable parameters. Trainable
    parameters that share a ``fully_shard`` group with frozen ones (PEFT puts adapters inside the
    frozen modules) are gathered and resharded as before: the frozen ones move into a group of their
    own over the same modules. Numbers are unchanged.

    The largest frozen parameters are kept first (ties by name) while their unsharded bytes on a rank
    fit ``budget_bytes``; one that does not fit is skipped and smaller ones may still fit. Every rank
    makes the same choice. Between steps kept parameters are registered sharded, as every
    other parameter (``model.parameters()``, optimizers, state dicts and ``WeightSync`` see the
    DTensors); only the gathered storage stays, and the next use registers it again without a
    collective. A kept parameter whose shard is written in place afterwards (an optimizer step after
    unfreezing it, ``load_state_dict``, ``fsdp2.load_pretrained``, a write into ``state_dict()``'s
    tensors, ``init_like_unsharded``) is gathered again at its next use, never served stale. Call it
    on the root, outside forward and backward; a later call replaces the earlier choice
    (``budget_bytes=0`` keeps none). ``model.reshard()`` on the root frees the kept copies until
    their next use. Setters called later on a module (``set_reshard_after_backward``,
    ``set_reshard_after_forward``) apply to its kept group too.

    Args:
        model: the root ``fully_shard`` module.
        budget_bytes: unsharded bytes per rank the kept parameters may take; ``None``: no limit, ``0``:
            keep none.

    Returns:
        The names of the kept parameters (relative to ``model``), largest first.
    """
    if isinstance(budget_bytes, bool) or not (budget_bytes is None or isinstance(budget_bytes, int)):
        raise TypeError(f"keep_frozen_gathered: budget_bytes must be an int or None, got {budget_bytes!r}.")
    if budget_bytes is not None and budget_bytes < 0:
        raise ValueError(
            f"keep_frozen_gathered: budget_bytes must be >= 0 (0 keeps none), got {budget_bytes}."
        )
    state = get_state(model)
    if state is None:
        raise ValueError(
            f"keep_frozen_gathered: {type(model).__name__} is not a fully_shard module. Call it on the root "
            "after fully_shard."
        )
    if state.is_root is False or (state.is_root is None and state.nested):
        raise ValueError(
            f"keep_frozen_gathered: {type(model).__name__} is not the root of its model; call it on the "
            "root (the module whose forward runs first), which keeps the frozen parameters of every group "
            "under it."
        )
    states = states_under(model)
    if busy(states):
        raise RuntimeError("keep_frozen_gathered: call it outside forward and backward.")
    frozen = _frozen_params(model)  # runs the root's lazy init
    ctx = _root_context(model)
    ctx.stop_keeping()  # a later call replaces the earlier choice
    frozen.sort(key=lambda item: (-item[3], item[2].fqn))
    chosen, total = [], 0
    for item in frozen:
        if budget_bytes is None or total + item[3] <= budget_bytes:
            chosen.append(item)
            total += item[3]
    by_group: dict[int, list[Any]] = {}
    for item in chosen:
        by_group.setdefault(id(item[1]), []).append(item)
    for items in by_group.values():
        state_, group = items[0][0], items[0][1]
        ctx.keep_gathered(state_, group, [item[2] for item in items])
    return [item[2].fqn for item in chosen]


def _frozen_params(root: nn.Module) -> list[tuple[FSDPState, FSDPParamGroup, FSDPParam, int]]:
    """Each frozen (``requires_grad=False``) parameter under ``root``, with its state and group.

    Also the bytes its unsharded form takes on a rank. The root's lazy init runs first (names, dtypes,
    its context).
    """
    root_state = get_state(root)
    assert root_state is not None, "not a fully_shard module"
    root_state.lazy_init()
    found = []
    for state in states_under(root):
        for group in state.groups:
            for fsdp_param in group.fsdp_params:
                if not fsdp_param.sharded_param.requires_grad:
                    nbytes = fsdp_param.layout.orig_numel * fsdp_param.unsharded_dtype.itemsize
                    found.append((state, group, fsdp_param, nbytes))
    return found


def _root_context(root: nn.Module) -> RootContext:
    """The context of the root ``root`` (after its lazy init)."""
    state = get_state(root)
    assert state is not None, "not a fully_shard module"
    assert state.ctx is not None, "the root's lazy init has not run"
    return state.ctx
