"""The engine's interface for the rooms built on it: deep copy, memory, accumulation, debug mode.

Owns nothing. It is the one place above the engine's own classes that knows their fields: the rooms
above ``frontend`` (``weights/_copy``, ``plan/_memory``, ``optim/_accumulate``, ``debug/_guard``,
``testing/_recording``) call these functions and never read a state's or a group's fields
themselves, so the engine's layout can change without touching them.

The interface, by room:

- every room: ``states_under(root)`` (the states of a module tree, in the order ``fully_shard`` was
  applied) and ``state_of(module)``;
- deep copy: ``busy`` (a forward or backward is running), ``extension_params``, ``reshard``,
  ``detached`` (the tree as plain modules while it is copied), ``sharding_calls`` (what to call
  ``fully_shard`` with again), ``copy_state_into`` (shards, controls and settings onto the copy's
  state) and ``copy_prefetch_and_caps``;
- the memory tracker: ``unsharded_tensors(state)``;
- the collective recorder (``fsdp2.testing.record_collectives``): ``wrap_comms``;
- the divergence guard of debug mode (``_guard``): ``wrap_comms``, whose ``GroupFacts`` also tell
  the phase of the step, the group's gradient sync, trainable parameters and the root's iteration, and
  ``data_parallel_groups`` (where an export or import agrees);
- gradient accumulation (``fsdp2.accumulate``): ``groups_under``, ``group_name``,
  ``kept_grad_bytes``, ``held_grad_bytes`` and ``set_gradient_sync``, each on one group
  (``wrap_comms`` counts its collectives); the operation itself is the group's
  (``FSDPParamGroup.reduce_held_grads``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..base import in_backward_task_id
from ..group import FSDPParamGroup
from ..runtime import FSDPState, busy, get_state, states_under
from ._composable import pop_torch_state, restore_torch_state
from ._module import original_class

__all__ = [
    "GroupFacts",
    "busy",
    "copy_prefetch_and_caps",
    "copy_state_into",
    "data_parallel_groups",
    "detached",
    "extension_params",
    "group_name",
    "groups_under",
    "held_grad_bytes",
    "kept_grad_bytes",
    "reshard",
    "set_gradient_sync",
    "sharding_calls",
    "state_of",
    "states_under",
    "unsharded_tensors",
    "wrap_comms",
]

state_of = get_state
# states_under (every room) and busy (deep copy) are the runtime's: ``runtime/_state.py``.


# ---- deep copy -----------------------------------------------------------------------------------


def extension_params(states: list[FSDPState]) -> list[str]:
    """Names of the parameters that use an all-gather extension (a tensor subclass)."""
    return [p.fqn for s in states for g in s.groups for p in g.fsdp_params if p.has_extension]


def reshard(states: list[FSDPState]) -> None:
    """Register every group's sharded parameters and free the unsharded ones (kept ones too)."""
    for state in states:
        for group in state.groups:
            group.release()


@contextmanager
def detached(states: list[FSDPState]) -> Iterator[None]:
    """The states' modules as plain modules for the duration, everything restored on exit.

    Plain: original classes, no fsdp2 hooks or state, each sharded parameter replaced by a meta
    placeholder of its full shape (what a copy rebuilds with ``fully_shard``).
    """
    undo: list[Callable[[], None]] = []
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
                undo.append(_restorer(module, "__class__", module.__class__))
                module.__class__ = original_class(module.__class__)  # FSDP<Name> -> <Name>
                undo.append(_restorer(module, "state", module.__dict__.pop("_fsdp2_state")))
                undo.append(_restorer(module, "torch_state", pop_torch_state(module)))
            for group in state.groups:
                for fsdp_param in group.fsdp_params:
                    placeholder = fsdp_param.placeholder()
                    for owner, attr in fsdp_param.owners:
                        undo.append(_restorer(owner, f"param:{attr}", owner._parameters[attr]))  # noqa: SLF001
                        owner._parameters[attr] = placeholder  # noqa: SLF001 - swapped back on exit
        yield
    finally:
        for restore in reversed(undo):
            restore()
        for hooks, items in hook_dicts.values():
            hooks.clear()
            hooks.update(items)


def _restorer(module: nn.Module, what: str, value: Any) -> Callable[[], None]:
    def restore() -> None:
        if what == "__class__":
            module.__class__ = value
        elif what == "state":
            module.__dict__["_fsdp2_state"] = value
        elif what == "torch_state":
            restore_torch_state(module, value)
        else:
            module._parameters[what[len("param:") :]] = value  # noqa: SLF001 - restoring

    return restore


def sharding_calls(states: list[FSDPState]) -> list[tuple[list[nn.Module], dict[str, Any]]]:
    """For each state, in order: its modules and the arguments ``fully_shard`` was called with."""
    return [(list(s.modules), dict(s.shard_args)) for s in states]


def copy_state_into(state: FSDPState, new_state: FSDPState, memo: dict[int, Any]) -> None:
    """Give the copy's state the original's local shards, group controls and automatic resharding.

    Each original sharded parameter maps to its copy in ``memo``, so objects copied in the same
    ``deepcopy`` call after the model (``copy.deepcopy((model, optimizer))``) refer to the copy's
    parameters, as they do for plain modules.
    """
    for group, new_group in zip(state.groups, new_state.groups, strict=True):
        new_group.controls = copy.copy(group.controls)
        for fsdp_param, new_param in zip(group.fsdp_params, new_group.fsdp_params, strict=True):
            new_param.adopt_local_shard(fsdp_param.local_shard_copy())
            memo[id(fsdp_param.sharded_param)] = new_param.sharded_param
    new_state.auto_reshard = state.auto_reshard


def copy_prefetch_and_caps(
    states: list[FSDPState], copy_of: Callable[[FSDPState], FSDPState | None], root: FSDPState | None
) -> None:
    """Explicit prefetch lists and the root's bucket caps, onto the copies (``copy_of`` maps states)."""
    for state in states:
        new_state = copy_of(state)
        assert new_state is not None, "a copied module without its state"
        for attr in ("forward_prefetch", "backward_prefetch"):
            targets = [copy_of(t) for t in getattr(state, attr)]
            setattr(new_state, attr, [t for t in targets if t is not None])
    new_root = copy_of(root) if root is not None else None
    if root is None or new_root is None or root.ctx is None or not root.ctx.schedule.bucketing.enabled:
        return
    old = root.ctx.schedule.bucketing
    new_root.shared_context().schedule.set_caps(old.all_gather_cap, old.reduce_scatter_cap)


# ---- the memory tracker --------------------------------------------------------------------------


def unsharded_tensors(state: FSDPState) -> list[torch.Tensor]:
    """Tensors holding unsharded data of ``state``'s groups (in-flight all-gathers included)."""
    tensors: list[torch.Tensor] = []
    for group in state.groups:
        tensors.extend(t for p in group.fsdp_params for t in p.unsharded_tensors())
        result = group.gatherer.result  # an all-gather in flight (not the packed shards themselves)
        if result is not None and result.output is not group.packed.flat:
            tensors.append(result.output)
    return tensors


# ---- the collective recorder ---------------------------------------------------------------------

# (GroupComms attribute, the kind of collective it issues)
_COMM_KINDS = (
    ("all_gather", "all_gather"),
    ("reduce_scatter", "reduce_scatter"),
    ("all_reduce", "all_reduce"),
    ("all_to_all", "all_to_all"),
    ("replica_all_gather", "all_gather"),
)


class GroupFacts:
    """What a comm wrapper may read about its group, at call time; calling it gives the module name."""

    __slots__ = ("_group", "_state")

    def __init__(self, group: FSDPParamGroup, state: FSDPState) -> None:
        self._group = group
        self._state = state  # its root context (known from the root's first forward on)

    def __call__(self) -> str:
        """The group's module name (known from the root's first forward on)."""
        return self._group.module_fqn

    def phase(self) -> str:
        """``"backward"`` inside autograd's backward, ``"forward"`` in the root's forward, else ``"idle"``.

        The root's phase, not the group's own state: a group prefetched in backward is still idle.
        """
        if in_backward_task_id() != -1:
            return "backward"
        root = self._state.ctx
        return "forward" if root is not None and root.iteration_root is not None else "idle"

    def gradient_sync(self) -> bool:
        """Whether the group reduces its gradients after backward (``set_requires_gradient_sync``)."""
        return self._group.controls.reduce_grads

    def trainable(self) -> list[tuple[str, bool]]:
        """Each parameter's name (relative to the root) and ``requires_grad``."""
        return [(p.fqn, p.sharded_param.requires_grad) for p in self._group.fsdp_params]

    def iteration(self) -> int:
        """How many forwards of the root have begun (0 before the first)."""
        root = self._state.ctx
        return root.iterations if root is not None else 0


def data_parallel_groups(root: nn.Module) -> list[Any]:
    """The process groups of the first group under ``root``: shard group, then HSDP's replicate group."""
    for state in states_under(root):
        for group in state.groups:
            info = group.mesh_info
            return [info.shard_group] + ([info.replicate_group] if info.replicate_group is not None else [])
    return []


def wrap_comms(states: list[FSDPState], wrap: Callable[[str, Any, GroupFacts], Any]) -> Callable[[], None]:
    """Replace each group's collectives by ``wrap(kind, comm, facts)``; returns the undo.

    ``kind`` is ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"`` or ``"all_to_all"``;
    ``facts()`` names the group's module (known from the root's first forward on). A wrapper must
    forward to ``comm`` and name it in its ``wrapped`` attribute (so bucketing and fast paths see the
    original); it does not mark the group's collectives as custom. The undo puts back each original
    that is still wrapped (a setter called in between wins).
    """
    swapped: list[tuple[Any, str, Any, Any]] = []
    for state in states:
        for group in state.groups:
            for attr, kind in _COMM_KINDS:
                original = getattr(group.comms, attr)
                wrapper = wrap(kind, original, GroupFacts(group, state))
                assert getattr(wrapper, "wrapped", None) is original, "a comm wrapper must name what it wraps"
                setattr(group.comms, attr, wrapper)
                swapped.append((group.comms, attr, original, wrapper))

    def undo() -> None:
        for comms, kind, original, wrapper in reversed(swapped):
            if getattr(comms, kind) is wrapper:
                setattr(comms, kind, original)

    return undo


# ---- gradient accumulation -----------------------------------------------------------------------


def groups_under(root: nn.Module) -> list[FSDPParamGroup]:
    """The groups of ``root``'s tree, in the order ``fully_shard`` was applied (deepest first)."""
    return [group for state in states_under(root) for group in state.groups]


def group_name(group: FSDPParamGroup) -> str:
    """The group's module name (``""``: the root; known from the root's first forward on)."""
    return group.module_fqn


def kept_grad_bytes(group: FSDPParamGroup) -> int:
    """Bytes of the unsharded gradients ``group`` holds when it skips a reduction.

    Kept in ``reduce_dtype`` where the policy sets one, else in the compute dtype; only trainable
    parameters count.
    """
    policy = group.config.mp_policy
    total = 0
    for fsdp_param in group.fsdp_params:
        if not fsdp_param.sharded_param.requires_grad:
            continue
        dtype = policy.reduce_dtype or policy.param_dtype or fsdp_param.orig_dtype
        total += fsdp_param.layout.orig_size.numel() * dtype.itemsize
    return total


def held_grad_bytes(group: FSDPParamGroup) -> int:
    """Bytes of the unsharded gradients ``group`` holds now (waiting for a reduction)."""
    return sum(t.numel() * t.element_size() for p in group.fsdp_params for t in p.unsharded.held_grads())


def set_gradient_sync(group: FSDPParamGroup, enabled: bool) -> bool:
    """Reduce ``group``'s gradients in each backward (``True``) or keep them; returns the old value."""
    previous = group.controls.reduce_grads
    group.controls.update(reduce_grads=enabled)
    return previous
