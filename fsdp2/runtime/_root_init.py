"""The root's lazy init, before it changes anything: the states under a root and every check on them.

Owns: which ``fully_shard`` state a module carries (``STATE_ATTR``, ``state_of``), finding the states
under a root module at its first forward (``validate_tree``, with the errors for a second root, a
sharded module shared by two models, a list of modules as the root), naming groups and parameters
relative to the root, refusing tied parameters across groups, prefetch lists outside the root, bucket
caps set on a non-root, unknown ignored parameters, and (debug mode) different models on different
ranks; then each group's own lazy init. Everything here raises before any state changes, so a failed
first forward can be retried. Does not own: what the root's context then changes (``RootContext``'s
``init_root`` and ``adopt``), the states themselves (``FSDPState``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from ..group import FSDPParamGroup
from ..trace import check_environment, check_same_model, debug_enabled

__all__ = ["STATE_ATTR", "TreeState", "state_device", "state_of", "validate_tree"]

STATE_ATTR = "_fsdp2_state"


class TreeState(Protocol):
    """What the checks read of a ``fully_shard`` state (``_state.FSDPState``, which builds on this)."""

    modules: tuple[nn.Module, ...]
    is_root: bool | None
    ctx: Any
    forward_prefetch: list[Any]
    backward_prefetch: list[Any]
    foreign_ignored: list[torch.Tensor]

    @property
    def groups(self) -> Sequence[FSDPParamGroup]: ...


def state_of(module: nn.Module) -> Any:
    """The ``FSDPState`` attached to ``module`` by ``fully_shard``, if any (``_state.get_state``, typed)."""
    return module.__dict__.get(STATE_ATTR)


def validate_tree(root: TreeState) -> list[Any]:
    """The states under ``root``'s module (``root`` first), named, checked and lazy-initialized.

    Raises before any state or group changes (group names and lazy init are idempotent).
    """
    if debug_enabled():
        check_environment()  # FSDP2_DEBUG=1 takes effect here: its FSDP2_DEBUG_* values must be usable
    if len(root.modules) > 1:
        names = ", ".join(type(m).__name__ for m in root.modules)
        raise RuntimeError(
            f"fully_shard on a list of modules ({names}) cannot be the root: FSDP needs a single root "
            "module. Call fully_shard on the parent module that runs forward."
        )
    root_module = root.modules[0]
    states: list[Any] = []
    module_names: dict[nn.Module, str] = {}
    for name, module in root_module.named_modules():
        module_names[module] = name
        state = state_of(module)
        if state is None or state in states:
            continue
        if state is not root and state.is_root:
            raise RuntimeError(
                f"The fully_shard module {name!r} already ran forward on its own before its root "
                f"{type(root_module).__name__}. Run forward through the root module first."
            )
        if state is not root and state.is_root is False:
            owner = state.ctx.all_states[0].modules[0] if state.ctx and state.ctx.all_states else None
            raise RuntimeError(
                f"The fully_shard module {name!r} of {type(root_module).__name__} already belongs to "
                f"another root ({type(owner).__name__ if owner is not None else 'another model'}), "
                "which ran forward first: a sharded module has one root, whose iteration drives its "
                "gathers and reductions. Do not share a sharded module between two models; give each "
                "its own copy (copy.deepcopy), or make one root that holds both."
            )
        states.append(state)
    _check_prefetch_targets(states, module_names)
    _check_bucketing_on_root(root, states, module_names)
    _check_ignored_params(states, root_module)
    # Validate every group before changing any state, so a failed first forward can be retried.
    owners: dict[int, str] = {}
    for state in states:
        for group in state.groups:
            group.module_fqn = ", ".join(module_names[m] for m in group.modules)
            _name_params(group, module_names, owners)
    for state in states:
        for group in state.groups:
            group.lazy_init()
    if debug_enabled():
        _check_same_model_everywhere(states, type(root_module).__name__)
    return states


def _check_bucketing_on_root(root: TreeState, states: list[Any], names: dict[nn.Module, str]) -> None:
    """Refuse bucket caps set on a module that turned out not to be the root (they would be lost)."""
    for state in states:
        if state is not root and state.ctx is not None and state.ctx.schedule.bucketing.enabled:
            name = names.get(state.modules[0], "?")
            raise RuntimeError(
                f"set_bucket_cap_mb was called on {name!r} ({type(state.modules[0]).__name__}), but the "
                f"root fully_shard module is {type(root.modules[0]).__name__}, which runs forward first. "
                "Bucket caps apply to the whole tree under the root: call set_bucket_cap_mb on the root "
                f"module (and set_bucket_cap_mb(None, None) on {name!r} to clear it there)."
            )


def _name_params(group: FSDPParamGroup, module_names: dict[nn.Module, str], seen: dict[int, str]) -> None:
    """Give parameters root-relative names and refuse a parameter owned by two groups."""
    for fsdp_param in group.fsdp_params:
        module, attr = fsdp_param.owners[0]
        prefix = module_names.get(module, "")
        fsdp_param.fqn = f"{prefix}.{attr}" if prefix else attr
        key = fsdp_param.source_id
        other = seen.get(key)
        if other is not None:
            raise ValueError(
                f"Parameter {fsdp_param.fqn} is the same tensor as {other}, which another fully_shard "
                f"group already manages (group {group.module_fqn or '<root>'}). Shard tied parameters "
                "in one call: fully_shard([module_a, module_b])."
            )
        seen[key] = fsdp_param.fqn


def _check_prefetch_targets(states: list[Any], module_names: dict[nn.Module, str]) -> None:
    """Refuse prefetch lists that name modules outside this root (they would never be waited on)."""
    members = set(states)
    for state in states:
        for kind, targets in (("forward", state.forward_prefetch), ("backward", state.backward_prefetch)):
            for target in targets:
                if target not in members:
                    owner = module_names.get(state.modules[0], "?")
                    raise ValueError(
                        f"The {kind} prefetch list of {owner or '<root>'} names a "
                        f"{type(target.modules[0]).__name__} that is not under this root module. Prefetch "
                        f"only fully_shard modules of the same model (set_modules_to_{kind}_prefetch)."
                    )


def _check_same_model_everywhere(states: list[Any], root_name: str) -> None:
    """Debug mode: every rank of the root's data-parallel groups manages the same parameters."""
    groups = [group for state in states for group in state.groups]
    if not groups:
        return
    fingerprint = [
        (p.fqn, tuple(p.global_size), str(p.sharded_param.dtype), group.module_fqn)
        for group in groups
        for p in group.fsdp_params
    ]
    info = groups[0].mesh_info
    process_groups = [info.shard_group] + ([info.replicate_group] if info.replicate_group is not None else [])
    check_same_model(fingerprint, process_groups, root_name)


def _check_ignored_params(states: list[Any], root: nn.Module) -> None:
    """Refuse ``ignored_params`` entries that are not parameters anywhere under the root."""
    present = {id(p) for p in root.parameters()}
    strangers = [p for state in states for p in state.foreign_ignored if id(p) not in present]
    if strangers:
        shapes = ", ".join(f"{tuple(p.shape)} {p.dtype}" for p in strangers[:3])
        raise ValueError(
            f"ignored_params holds {len(strangers)} tensor(s) that are not parameters of the model "
            f"{type(root).__name__} (shape and dtype: {shapes}), e.g. parameters of another copy of the "
            "model. Pass this model's own parameters, or drop them from ignored_params."
        )


def state_device(states: list[TreeState]) -> torch.device:
    """The device the root's groups compute on (CPU without groups)."""
    for state in states:
        for group in state.groups:
            return group.device
    return torch.device("cpu")
