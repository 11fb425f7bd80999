"""Floor 5: a training step across groups.

A training step across groups: each ``fully_shard`` call's state (its hooks), the root's
context (lazy init and its checks, iteration boundaries, recovery, every list of groups), the schedule
(the one caller of a step's gathers and reductions: execution orders, bucket plans, the
reduce-scatter queue), the usage agreement, automatic bucket caps, state-dict hooks, torch's private
state names, and the process-wide optimizer-step hooks (the step guard with the replaced-parameter
check, local-shard steps), and the engine's queries for the rooms above (``_queries.py``: they read
no field of a state or a group themselves). Imports the floors below.

The face: ``__all__`` is what the rooms above may use, and they import nothing else of this room
(``tests/house/test_layering.py`` checks). fsdp2's public names are in ``fsdp2``.
"""

from ._autocap import BucketCaps, CapMB, CapMBOrUnset, CollectiveFit, choose_caps, fit_collective, read_caps
from ._bucket import MIB
from ._keep_frozen import keep_frozen_gathered
from ._optimizer_hooks import take_part
from ._queries import (
    GroupFacts,
    copy_prefetch_and_caps,
    copy_state_into,
    data_parallel_groups,
    extension_params,
    groups_under,
    reshard,
    sharding_calls,
    unsharded_tensors,
    wrap_comms,
)
from ._root import RootContext
from ._schedule import Schedule
from ._state import FSDPState, busy, get_state, states_under
from ._step_guard import (
    drop_held_gradients,
    mark_partial_grads,
    mark_replaced,
    sharded_params,
    watch_optimizer_steps,
)

__all__ = [
    "MIB",
    "BucketCaps",
    "CapMB",
    "CapMBOrUnset",
    "CollectiveFit",
    "FSDPState",
    "GroupFacts",
    "RootContext",
    "Schedule",
    "busy",
    "choose_caps",
    "copy_prefetch_and_caps",
    "copy_state_into",
    "data_parallel_groups",
    "drop_held_gradients",
    "extension_params",
    "fit_collective",
    "get_state",
    "groups_under",
    "keep_frozen_gathered",
    "mark_partial_grads",
    "mark_replaced",
    "read_caps",
    "reshard",
    "sharded_params",
    "sharding_calls",
    "states_under",
    "take_part",
    "unsharded_tensors",
    "watch_optimizer_steps",
    "wrap_comms",
]
