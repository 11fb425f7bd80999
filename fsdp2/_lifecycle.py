"""Lifecycle enums shared by states and parameter groups.

Owns: ``TrainingState`` (what the module is doing now) and ``ShardedState`` (what is registered).
Does not own: the transitions themselves; ``FSDPParamGroup`` and ``FSDPState`` perform them.
Invariants: every parameter of a group is in the group's ``ShardedState``.
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
