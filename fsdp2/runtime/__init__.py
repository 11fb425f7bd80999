"""Floor 5: a training step across groups.

A training step across groups: each ``fully_shard`` call's state (its hooks), the root's
context (lazy init and its checks, iteration boundaries, recovery, every list of groups), the schedule
(the one caller of a step's gathers and reductions: execution orders, bucket plans, the
reduce-scatter queue), the usage agreement, automatic bucket caps, state-dict hooks, torch's private
state names, and the process-wide optimizer-step hooks (the step guard with the replaced-parameter
check, local-shard steps).
Imports the floors below.

Internal: fsdp2's public names are in ``fsdp2``; this face is for reading the architecture.
"""

from ._root import RootContext
from ._schedule import Schedule
from ._state import FSDPState

__all__ = ["FSDPState", "RootContext", "Schedule"]
