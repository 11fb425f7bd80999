"""Floor 7: everything a user calls beside training.

Everything a user calls beside training, built on the engine through ``_engine``'s queries:
deep copy, the memory estimate and planner, wrapping policies, gradient clipping, full-weight
checkpoints, budgeted accumulation, weight sync to an inference engine and debug mode's divergence
guard. Imports the floors below.

Internal: fsdp2's public names are in ``fsdp2``; this face is for reading the architecture.
"""

from ._accumulate import accumulate
from ._checkpoint import load_full_state_dict, save_full_state_dict
from ._clip import clip_grad_norm_
from ._keep_frozen import keep_frozen_gathered
from ._memory import estimate_memory
from ._planner import plan
from ._replicas import check_replicas
from ._weight_sync import WeightSync
from ._wrap import apply_fully_shard

__all__ = [
    "WeightSync",
    "accumulate",
    "apply_fully_shard",
    "check_replicas",
    "clip_grad_norm_",
    "estimate_memory",
    "keep_frozen_gathered",
    "load_full_state_dict",
    "plan",
    "save_full_state_dict",
]
