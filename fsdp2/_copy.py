"""``copy.deepcopy`` of fully_shard modules: an independent sharded copy (e.g. for an EMA model).

Owns: ``deepcopy_fsdp``, installed as the ``__deepcopy__`` of every ``FSDP<Name>`` class. The copy is
made without copying FSDP's machinery (process groups cannot be copied, hooks are bound to their
state): the module tree is deep-copied as plain modules whose sharded parameters are meta
placeholders of their full shape, ``fully_shard`` is applied to the copy with the same arguments in the
same (bottom-up) order, and each new local shard is filled from the original's. The copy shares the
meshes (and so the process groups) with the original and nothing else. Does not own: sharding
(``fully_shard``) or the shard layout (``FSDPParam``).
Invariants: the original is unchanged except for being resharded first; a copy taken mid-iteration is
refused.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from ._composable import pop_torch_state, restore_torch_state
from ._fully_shard import fully_shard
from ._lifecycle import TrainingState
from ._module import original_class, set_deepcopy_impl
from ._state import FSDPState, get_state


def deepcopy_fsdp(root: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """An independent copy of ``root`` and the fully_shard modules under it, sharded the same way."""
    states = _states_under(root)
    for state in states:
        if state.training_state is not TrainingState.IDLE or any(
            g.training_state is not TrainingState.IDLE for g in state.groups
        ):
            raise RuntimeError(
                f"copy.deepcopy of {type(root).__name__} during a forward or backward: take the copy between "
                "steps (after optimizer.step()), or call reset_iter_state() after an aborted step."
            )
    for state in states:
        for group in state.groups:
            extended = [p.fqn for p in group.fsdp_params if p.has_extension]
            if extended:
                raise NotImplementedError(
                    f"copy.deepcopy of {type(root).__name__}: parameters {extended} use the all-gather "
                    "extension (a tensor subclass), which fsdp2 cannot copy yet. Copy the model before "
                    "fully_shard, or load a state dict into a second sharded model."
                )
    for state in states:
        for group in state.groups:
            group.reshard()
    names = {module: name for name, module in root.named_modules()}
    with _as_plain_modules(states):
        plain_copy = copy.deepcopy(root, memo)
    new_modules = dict(plain_copy.named_modules())
    for state in states:  # bottom-up, as they were applied
        args = dict(state.shard_args)
        ignored = args.get("ignored_params")
        if ignored:
            args["ignored_params"] = {memo.get(id(p), p) for p in ignored}
        targets = [new_modules[names[m]] for m in state.modules]
        fully_shard(targets if len(targets) > 1 else targets[0], **args)
        new_state = get_state(targets[0])
        assert new_state is not None, "fully_shard left no state on the copy"
        _copy_shards(state, new_state, memo)
        new_state.auto_reshard = state.auto_reshard
    _copy_prefetch_lists(states, names, new_modules)
    _copy_bucket_caps(get_state(root), get_state(plain_copy))
    return plain_copy


def _copy_bucket_caps(state: FSDPState | None, new_state: FSDPState | None) -> None:
    """The copy's root buckets like the original's root (``set_bucket_cap_mb``)."""
    if state is None or new_state is None or state.ctx is None or not state.ctx.schedule.bucketing.enabled:
        return
    old = state.ctx.schedule.bucketing
    new_state.shared_context().schedule.set_caps(old.all_gather_cap, old.reduce_scatter_cap)


def _states_under(root: nn.Module) -> list[FSDPState]:
    """The fully_shard states of ``root``'s tree, deepest first (the order they were applied)."""
    depth = {module: name.count(".") + (1 if name else 0) for name, module in root.named_modules()}
    seen: dict[int, FSDPState] = {}
    for module in root.modules():
        state = get_state(module)
        if state is not None and id(state) not in seen:
            seen[id(state)] = state
    return sorted(seen.values(), key=lambda s: -max(depth.get(m, 0) for m in s.modules))


@contextmanager
def _as_plain_modules(states: list[FSDPState]) -> Iterator[None]:
    """Temporarily make the FSDP modules plain, restoring everything on exit.

    Plain: original classes, no fsdp2 hooks or state, and each sharded parameter replaced by a meta
    placeholder of its full shape.
    """
    saved: list[tuple[nn.Module, str, Any]] = []
    hook_dicts: dict[int, tuple[dict[Any, Any], list[tuple[Any, Any]]]] = {}
    try:
        for state in states:
            for handle in state.hook_handles:
                for ref in (handle.hooks_dict_ref, *getattr(handle, "extra_dict_ref", ())):
                    hooks = ref()
                    if hooks is not None and handle.id in hooks:
                        hook_dicts.setdefault(id(hooks), (hooks, list(hooks.items())))
                        del hooks[handle.id]
            for module in state.modules:
                saved.append((module, "__class__", module.__class__))
                module.__class__ = original_class(module.__class__)  # FSDP<Name> -> <Name>
                saved.append((module, "state", module.__dict__.pop("_fsdp2_state")))
                saved.append((module, "torch_state", pop_torch_state(module)))
            for group in state.groups:
                for fsdp_param in group.fsdp_params:
                    placeholder = fsdp_param.placeholder()
                    for owner, attr in fsdp_param.owners:
                        saved.append((owner, f"param:{attr}", owner._parameters[attr]))  # noqa: SLF001
                        owner._parameters[attr] = placeholder  # noqa: SLF001 - swapped back below
        yield
    finally:
        for module, what, value in reversed(saved):
            if what == "__class__":
                module.__class__ = value
            elif what == "state":
                module.__dict__["_fsdp2_state"] = value
            elif what == "torch_state":
                restore_torch_state(module, value)
            else:
                module._parameters[what[len("param:") :]] = value  # noqa: SLF001 - restoring
        for hooks, items in hook_dicts.values():
            hooks.clear()
            hooks.update(items)


def _copy_shards(state: FSDPState, new_state: FSDPState, memo: dict[int, Any]) -> None:
    """Fill the copy's (meta) local shards from the original's, group by group, parameter by parameter.

    Each original sharded parameter maps to its copy in ``memo``, so objects copied in the same
    ``deepcopy`` call after the model (``copy.deepcopy((model, optimizer))``) refer to the copy's
    parameters, as they do for plain modules.
    """
    for group, new_group in zip(state.groups, new_state.groups, strict=True):
        new_group.controls = copy.copy(group.controls)
        for fsdp_param, new_param in zip(group.fsdp_params, new_group.fsdp_params, strict=True):
            new_param.adopt_local_shard(fsdp_param.local_shard_copy())
            memo[id(fsdp_param.sharded_param)] = new_param.sharded_param


def _copy_prefetch_lists(
    states: list[FSDPState], names: dict[nn.Module, str], new_modules: dict[str, nn.Module]
) -> None:
    for state in states:
        new_state = get_state(new_modules[names[state.modules[0]]])
        assert new_state is not None, "a copied module without its state"
        for attr in ("forward_prefetch", "backward_prefetch"):
            targets = [get_state(new_modules[names[t.modules[0]]]) for t in getattr(state, attr)]
            setattr(new_state, attr, [t for t in targets if t is not None])


set_deepcopy_impl(deepcopy_fsdp)

__all__ = ["deepcopy_fsdp"]
