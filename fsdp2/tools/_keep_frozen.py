"""Frozen parameters gathered once and kept: ``fsdp2.keep_frozen_gathered``.

Owns: choosing which frozen parameters of a root's groups stay unsharded (largest first, within a
budget of unsharded bytes per rank, the same choice on every rank) and asking the root's context to
keep them (``RootContext.keep_gathered``: a group of their own where they share one with trainable
parameters). Does not own: what a kept group does each step (the group's controls, the schedule's
check of its shards' versions).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from . import _engine as engine

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
    unfreezing it, ``load_state_dict``, ``init_like_unsharded``) is gathered again at its next use,
    never served stale. Call it on the root, outside forward and backward; a later call replaces the
    earlier choice (``budget_bytes=0`` keeps none). ``model.reshard()`` on the root frees the kept
    copies until their next use. Setters called later on a module (``set_reshard_after_backward``,
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
    state = engine.state_of(model)
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
    states = engine.states_under(model)
    if engine.busy(states):
        raise RuntimeError("keep_frozen_gathered: call it outside forward and backward.")
    frozen = engine.frozen_params(model)  # runs the root's lazy init
    ctx = engine.root_context(model)
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
