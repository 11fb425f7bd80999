"""Floor 0: the types, policies and autograd nodes everything else builds on.

What everything else builds on: the user's policies, a group's configuration and run-time
controls, mesh facts, the training-state table and its one transition function, the autograd nodes
fsdp2 hooks backward with, casting, and warnings that point at the user's line. Imports no other
subpackage.

The face: ``__all__`` is what the rooms above may use, and they import nothing else of this room
(``tests/house/test_layering.py`` checks). fsdp2's public names are in ``fsdp2``.
"""

from ._api import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy, as_fsdp2_policy
from ._autograd import (
    eager,
    in_backward_task_id,
    outside_functorch,
    preserve_version_counter,
    queue_end_of_backward_callback,
    register_post_backward,
    register_pre_backward,
    route_untracked_outputs,
)
from ._buffers import KeptBuffers, unset_buffers
from ._cast import cast_floating, move_to_device
from ._config import GroupConfig, GroupControls, ParamSpec
from ._lifecycle import ALLOWED, ShardedState, TrainingState, stepped_before_backward, transition
from ._mesh import (
    FSDPMeshInfo,
    HSDPMeshInfo,
    MeshInfo,
    ShardPlacementResult,
    SpmdDims,
    data_and_tensor_parallel_mesh,
    default_mesh,
    mesh_device,
    post_forward_mesh_info,
)
from ._warn import warn_user

__all__ = [
    "ALLOWED",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPMeshInfo",
    "GroupConfig",
    "GroupControls",
    "HSDPMeshInfo",
    "KeptBuffers",
    "MeshInfo",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ParamSpec",
    "ShardPlacementResult",
    "ShardedState",
    "SpmdDims",
    "TrainingState",
    "as_fsdp2_policy",
    "cast_floating",
    "data_and_tensor_parallel_mesh",
    "default_mesh",
    "eager",
    "in_backward_task_id",
    "mesh_device",
    "move_to_device",
    "outside_functorch",
    "post_forward_mesh_info",
    "preserve_version_counter",
    "queue_end_of_backward_callback",
    "register_post_backward",
    "register_pre_backward",
    "route_untracked_outputs",
    "stepped_before_backward",
    "transition",
    "unset_buffers",
    "warn_user",
]
