"""Floor 7: choosing a wrapping before training: the memory estimate, the cost model and the planner.

Owns: ``estimate_memory`` (a step run on fake tensors in a simulated world of ranks, its peak per
phase), the step-time cost model and its calibration, ``plan`` (the search over groupings, resharding,
bucket caps, frozen residency and offload, by memory or by measured time) and ``apply_fully_shard``
(wrapping by module class).
Reads the engine through its queries (``runtime``, ``group``); imports the floors below.

The face: ``__all__`` is what the rooms above may use, and they import nothing else of this room
(``tests/house/test_layering.py`` checks). fsdp2's public names are in ``fsdp2``.
"""

from ._memory import MemoryReport, MemoryTracker, current_tracker, estimate_memory, process_hooks, run_tracked
from ._planner import plan
from ._wrap import apply_fully_shard

__all__ = [
    "MemoryReport",
    "MemoryTracker",
    "apply_fully_shard",
    "current_tracker",
    "estimate_memory",
    "plan",
    "process_hooks",
    "run_tracked",
]
