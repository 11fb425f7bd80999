"""Floor 3: one ``fully_shard`` group over its own parameters.

One ``fully_shard`` group over its own parameters: the packed shards (all-gather input), the
pending all-gather, the unsharded buffer and its registrations, the gradient reduction (ordered,
skipping unused parameters, the usage rows, the one reduce path that buckets share) and the group's
side of bucketing. A group holds what it works with (the root's streams and event scope, handed over
by ``attach``), never its root, its schedule or a sibling: ``runtime``'s schedule calls it. One
group's queries for the rooms above (``_queries.py``: gradient sync, gradient bytes). Imports the
floors below.

The face: ``__all__`` is what the rooms above may use, and they import nothing else of this room
(``tests/house/test_layering.py`` checks). fsdp2's public names are in ``fsdp2``.
"""

from ._param_group import FSDPParamGroup, build_group, split_group
from ._pending import PendingReduceScatter, pack_gradients, reduce_scatter_key
from ._queries import (
    group_mesh_info,
    group_name,
    held_grad_bytes,
    kept_grad_bytes,
    replica_all_gather,
    replica_slicing_problem,
    set_gradient_sync,
    slice_across_replicas,
)
from ._reduce import ReducePart, reduce_shared
from ._skip import Skip, UseTracker

__all__ = [
    "FSDPParamGroup",
    "PendingReduceScatter",
    "ReducePart",
    "Skip",
    "UseTracker",
    "build_group",
    "group_mesh_info",
    "group_name",
    "held_grad_bytes",
    "kept_grad_bytes",
    "pack_gradients",
    "reduce_scatter_key",
    "reduce_shared",
    "replica_all_gather",
    "replica_slicing_problem",
    "set_gradient_sync",
    "slice_across_replicas",
    "split_group",
]
