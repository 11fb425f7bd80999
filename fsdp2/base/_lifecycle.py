"""Lifecycle enums and the one place training states change.

Owns: ``TrainingState`` (what a state or group is doing now), ``ShardedState`` (which parameters are
registered), the table of allowed training-state transitions and ``transition()``, which every change of
a ``TrainingState`` in fsdp2 goes through. Does not own: deciding *when* to transition (``FSDPState`` and
``FSDPParamGroup`` do).
Invariants: every parameter of a group is in the group's ``ShardedState``; a training state only ever
moves along an edge of ``ALLOWED``.
"""

from __future__ import annotations

from enum import Enum, auto


class TrainingState(Enum):
    """Phase of one FSDP state or parameter group within a training step."""

    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


class ShardedState(Enum):
    """Which version of each parameter is registered on the module.

    ``SHARDED``: the sharded DTensor parameter (padded local shard only).
    ``SHARDED_POST_FORWARD``: a placeholder on the smaller post-forward mesh (int ``reshard_after_forward``).
    ``UNSHARDED``: the full-size unsharded parameter used for compute.
    """

    SHARDED = auto()
    SHARDED_POST_FORWARD = auto()
    UNSHARDED = auto()


_IDLE = TrainingState.IDLE
_FORWARD = TrainingState.FORWARD
_PRE_BACKWARD = TrainingState.PRE_BACKWARD
_POST_BACKWARD = TrainingState.POST_BACKWARD

# Edges a training state may take. IDLE is reachable from everywhere (end of forward, the end-of-backward
# callback, reset_iter_state). The others:
# - FORWARD again: nested or grouped modules re-enter forward before it ends;
# - FORWARD -> PRE_BACKWARD: a backward run from inside a forward (e.g. a gradient penalty);
# - PRE_BACKWARD again: one hook per forward output;
# - IDLE -> POST_BACKWARD: the end-of-backward callback completes groups autograd never reached;
# - POST_BACKWARD -> PRE_BACKWARD / POST_BACKWARD: a module used several times in one forward is
#   reached again by the same backward.
# Never allowed: PRE_BACKWARD/POST_BACKWARD -> FORWARD (a forward after an unfinished backward: the
# states must be reset first, see RootContext.begin_iteration).
ALLOWED: dict[TrainingState, frozenset[TrainingState]] = {
    _IDLE: frozenset({_IDLE, _FORWARD, _PRE_BACKWARD, _POST_BACKWARD}),
    _FORWARD: frozenset({_IDLE, _FORWARD, _PRE_BACKWARD}),
    _PRE_BACKWARD: frozenset({_IDLE, _PRE_BACKWARD, _POST_BACKWARD}),
    _POST_BACKWARD: frozenset({_IDLE, _PRE_BACKWARD, _POST_BACKWARD}),
}


def transition(current: TrainingState, new: TrainingState, owner: object) -> TrainingState:
    """Return ``new`` if ``current -> new`` is an allowed edge; raise otherwise.

    Hot paths test ``new in ALLOWED[current]`` themselves and call this only to raise.

    Args:
        current: the state now.
        new: the state asked for.
        owner: who changes state; its ``str()`` names it in the message (built only on error).

    Raises:
        RuntimeError: the edge is not in the table (an fsdp2 bug or an iteration that was not reset).
    """
    if new not in ALLOWED[current]:
        raise RuntimeError(
            f"fsdp2 internal error: {owner} cannot go from {current.name} to {new.name}. If a previous "
            "forward or backward raised, call reset_iter_state() on the root module before continuing; "
            "otherwise please report this with the traceback."
        )
    return new


def stepped_before_backward(module_fqn: str) -> RuntimeError:
    """The error for a backward whose forward's parameters an optimizer stepped in between."""
    return RuntimeError(
        f"fsdp2: {module_fqn or 'the root'}'s parameters were updated by optimizer.step() after the "
        "forward this backward differentiates and before the backward, so its gradients would be "
        "computed with the new parameters (the unsharded model fails here too, with autograd's in-place "
        "error). Call optimizer.step() after loss.backward(). This iteration is unfinished: call "
        "reset_iter_state() on the root module first."
    )
