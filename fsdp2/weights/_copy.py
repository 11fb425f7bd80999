"""``copy.deepcopy`` of fully_shard modules: an independent sharded copy (e.g. for an EMA model).

Owns: ``deepcopy_fsdp``, installed as the ``__deepcopy__`` of every ``FSDP<Name>`` class. The copy is
made without copying FSDP's machinery (process groups cannot be copied, hooks are bound to their
state): the module tree is deep-copied as plain modules whose sharded parameters are meta
placeholders of their full shape, ``fully_shard`` is applied to the copy with the same arguments in the
same (bottom-up) order, and each new local shard is filled from the original's. The copy shares the
meshes (and so the process groups) with the original and nothing else. Does not own: sharding
(``fully_shard``) or the engine's state: it reaches the states, groups and shards only through the
engine's queries for the rooms above it (``runtime/_queries.py``) and ``frontend``'s ``detached``.
Invariants: the original is unchanged except for being resharded first; a copy taken mid-iteration is
refused. Importing this module also makes DTensors over packed shards deep-copyable
(``_dtensor.install_deepcopy``), so ``copy.deepcopy(model.state_dict())`` works as with torch.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from ..frontend import detached, fully_shard, replicate
from ..runtime import (
    busy,
    copy_prefetch_and_caps,
    copy_state_into,
    extension_params,
    get_state,
    reshard,
    sharding_calls,
    states_under,
)


def deepcopy_fsdp(root: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """An independent copy of ``root`` and the fully_shard modules under it, sharded the same way."""
    states = states_under(root)
    if busy(states):
        raise RuntimeError(
            f"copy.deepcopy of {type(root).__name__} during a forward or backward: take the copy between "
            "steps (after optimizer.step()), or call reset_iter_state() after an aborted step."
        )
    extended = extension_params(states)
    if extended:
        raise NotImplementedError(
            f"copy.deepcopy of {type(root).__name__}: parameters {extended} use the all-gather "
            "extension (a tensor subclass), which fsdp2 cannot copy yet. Copy the model before "
            "fully_shard, or load a state dict into a second sharded model."
        )
    reshard(states)
    names = {module: name for name, module in root.named_modules()}
    with detached(states):
        plain_copy = copy.deepcopy(root, memo)
    new_modules = dict(plain_copy.named_modules())
    new_states = {}
    for state, (modules, api, args) in zip(states, sharding_calls(states), strict=True):
        ignored = args.get("ignored_params")  # bottom-up, as they were applied
        if ignored:
            args["ignored_params"] = {memo.get(id(p), p) for p in ignored}
        targets = [new_modules[names[m]] for m in modules]
        apply = replicate if api == "replicate" else fully_shard
        apply(targets if len(targets) > 1 else targets[0], **args)
        new_state = get_state(targets[0])
        assert new_state is not None, f"{api} left no state on the copy"
        copy_state_into(state, new_state, memo)
        new_states[id(state)] = new_state
    copy_prefetch_and_caps(states, lambda s: new_states.get(id(s)), get_state(root))
    return plain_copy


__all__ = ["deepcopy_fsdp"]
