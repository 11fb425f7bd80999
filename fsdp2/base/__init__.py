"""Floor 0: the types, policies and autograd nodes everything else builds on.

What everything else builds on: the user's policies, a group's configuration and run-time
controls, mesh facts, the training-state table and its one transition function, the autograd nodes
fsdp2 hooks backward with, casting, and warnings that point at the user's line. Imports no other
subpackage.

Internal: fsdp2's public names are in ``fsdp2``; this face is for reading the architecture.
"""

from ._api import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from ._config import GroupConfig, GroupControls, ParamSpec
from ._lifecycle import ShardedState, TrainingState, transition
from ._mesh import MeshInfo

__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "GroupConfig",
    "GroupControls",
    "MeshInfo",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ParamSpec",
    "ShardedState",
    "TrainingState",
    "transition",
]
