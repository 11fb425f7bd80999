"""fsdp2: fully sharded data parallel training with one call, ``fully_shard(module)``.

A drop-in for ``torch.distributed.fsdp.fully_shard`` written on DTensor, DeviceMesh and c10d.
"""

from ._api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._checkpoint import load_full_state_dict, save_full_state_dict
from ._comms import AllGather, Comm, ReduceScatter
from ._events import Event, record_events, save_chrome_trace
from ._fully_shard import fully_shard
from ._lifecycle import TrainingState
from ._module import FSDPModule, UnshardHandle, register_fsdp_forward_method, share_comm_ctx
from ._wrap import apply_fully_shard

__version__ = "0.1.0"

__all__ = [
    "AllGather",
    "CPUOffloadPolicy",
    "Comm",
    "Event",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ReduceScatter",
    "TrainingState",
    "UnshardHandle",
    "__version__",
    "apply_fully_shard",
    "fully_shard",
    "load_full_state_dict",
    "record_events",
    "register_fsdp_forward_method",
    "save_chrome_trace",
    "save_full_state_dict",
    "share_comm_ctx",
]
