"""The engine's queries for the rooms above it, state by state: what they read and change of it.

Owns: the functions through which ``weights``, ``plan``, ``optim``, ``debug`` and ``testing`` see the
states and groups of a module tree (they read no field of a state or a group themselves, so the
engine's layout can change without touching them), by use:

- deep copy (``weights/_copy.py``): ``extension_params``, ``reshard``, ``sharding_calls`` (what to call
  ``fully_shard`` or ``replicate`` with again), ``copy_state_into`` (shards, controls and settings onto
  the copy's state) and ``copy_prefetch_and_caps``; with ``busy`` and ``states_under`` (``_state.py``) and
  ``frontend``'s ``detached``;
- the memory tracker (``plan/_memory.py``): ``unsharded_tensors(state)``;
- the collective recorder (``testing/_recording.py``), gradient accumulation and debug mode's
  divergence guard: ``wrap_comms``, whose ``GroupFacts`` also tell the phase of the step, the group's
  gradient sync, trainable parameters and the root's iteration; ``groups_under`` and
  ``data_parallel_groups`` (where an export or import agrees).

Does not own: the states (``_state.py``), the queries of one group (``group/_queries.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..base import in_backward_task_id
from ..group import FSDPParamGroup
from ._state import FSDPState, states_under

__all__ = [
    "GroupFacts",
    "copy_prefetch_and_caps",
    "copy_state_into",
    "data_parallel_groups",
    "extension_params",
    "groups_under",
    "reshard",
    "sharding_calls",
    "unsharded_tensors",
    "wrap_comms",
]


# ---- deep copy -----------------------------------------------------------------------------------


def extension_params(states: list[FSDPState]) -> list[str]:
    """Names of the parameters that use an all-gather extension (a tensor subclass)."""
    return [p.fqn for s in states for g in s.groups for p in g.fsdp_params if p.has_extension]


def reshard(states: list[FSDPState]) -> None:
    """Register every group's sharded parameters and free the unsharded ones (kept ones too)."""
    for state in states:
        for group in state.groups:
            group.release()


def sharding_calls(states: list[FSDPState]) -> list[tuple[list[nn.Module], str, dict[str, Any]]]:
    """For each state, in order: its modules, the call (``fully_shard`` or ``replicate``), its arguments."""
    return [(list(s.modules), s.api, dict(s.shard_args)) for s in states]


def copy_state_into(state: FSDPState, new_state: FSDPState, memo: dict[int, Any]) -> None:
    """Give the copy's state the original's local shards, group controls and automatic resharding.

    Each original sharded parameter maps to its copy in ``memo``, so objects copied in the same
    ``deepcopy`` call after the model (``copy.deepcopy((model, optimizer))``) refer to the copy's
    parameters, as they do for plain modules.
    """
    for group, new_group in zip(state.groups, new_state.groups, strict=True):
        new_group.controls = copy.copy(group.controls)
        # the optimizer sharded across replicas is the original's: the copy reduces as plain HSDP
        new_group.controls.update(replica_slices=None)
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


# ---- the collective wrappers -------------------------------------------------------------------

# (GroupComms attribute, the kind of collective it issues)
_COMM_KINDS = (
    ("all_gather", "all_gather"),
    ("reduce_scatter", "reduce_scatter"),
    ("all_reduce", "all_reduce"),
    ("all_to_all", "all_to_all"),
    ("replica_all_to_all", "all_to_all"),
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


def groups_under(root: nn.Module) -> list[FSDPParamGroup]:
    """The groups of ``root``'s tree, in the order ``fully_shard`` was applied (deepest first)."""
    return [group for state in states_under(root) for group in state.groups]
