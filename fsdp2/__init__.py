"""fsdp2: fully sharded data parallel training with one call, ``fully_shard(module)``.

A drop-in for ``torch.distributed.fsdp.fully_shard`` written on DTensor, DeviceMesh and c10d.
"""

from .base._api import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from .base._lifecycle import TrainingState
from .base._mesh import FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult
from .comm._comms import AllGather, Comm, ReduceScatter
from .compile._compile_fixes import install_cache_key_fix, install_rng_order_fix
from .debug._guard import DivergenceError, install_guard
from .debug._replicas import check_replicas
from .experts._declare import shard_experts
from .frontend._fully_shard import fully_shard, on_first_fully_shard
from .frontend._module import FSDPModule, ReplicateModule, UnshardHandle, set_deepcopy_impl
from .frontend._module_functions import register_fsdp_forward_method, share_comm_ctx
from .frontend._patch import TorchPatch, patch_torch_fsdp
from .frontend._replicate import replicate
from .optim import enable_automatic_local_steps, enable_whole_tensor_steps
from .optim._accumulate import Accumulation, accumulate
from .optim._clip import clip_grad_norm_
from .optim._cross_replica import shard_optimizer_across_replicas
from .optim._local_optim import local_step
from .optim._stacked_muon import StackedMuon
from .optim._whole_tensor import declare_optimizer, whole_tensor_step
from .param import install_deepcopy, install_pickling
from .param._init import init_like_unsharded
from .plan._memory import MemoryReport, PhaseMemory, SimulatedValueError, estimate_memory, is_simulated
from .plan._plan import Plan, PlanError
from .plan._planner import plan
from .plan._wrap import apply_fully_shard
from .resilience._snapshots import Restored, Snapshots, SnapshotStats
from .runtime._autocap import BucketCaps, CollectiveFit
from .runtime._keep_frozen import keep_frozen_gathered
from .trace._debug import on_root_init, set_debug
from .trace._events import Event, Span, record_events, save_chrome_trace
from .trace._report import CommunicationReport, CommunicationRow, communication_report
from .trace._straggler import StragglerReport, StragglerRow, straggler_report
from .trace._timeline import merge_timelines, save_timeline
from .weights._copy import deepcopy_fsdp
from .weights._flat_save import PendingSave, ShardedCheckpointer, load_sharded, save_sharded
from .weights._full_state import load_full_state_dict, save_full_state_dict
from .weights._local_shards import LocalShard
from .weights._pretrained import load_pretrained, save_pretrained
from .weights._weight_sync import WeightSync

# What importing fsdp2 installs: the package's only import-time registrations, here and nowhere else
# (tests/house/test_layering.py refuses a module-level call in any other module).
install_pickling()  # torch.save of a sharded state dict: DTensors over packed shards (param/_dtensor.py)
install_deepcopy()  # copy.deepcopy(model.state_dict()): DTensors over packed shards (param/_dtensor.py)
set_deepcopy_impl(deepcopy_fsdp)  # copy.deepcopy(model) of fully_shard modules (weights/_copy.py)
install_rng_order_fix()  # compile: checkpointing with dropout/attention (compile/_compile_fixes.py)
install_cache_key_fix()  # compile: a cached graph per local shape, uneven shards (compile/_compile_fixes.py)
on_first_fully_shard(enable_automatic_local_steps)  # optim: local-shard steps for elementwise optimizers
on_first_fully_shard(enable_whole_tensor_steps)  # optim: owner-rank steps for whole-tensor optimizers
on_root_init(install_guard)  # debug mode: the divergence guard on each root (debug/_guard.py)

__version__ = "0.1.0"

__all__ = [
    "Accumulation",
    "AllGather",
    "BucketCaps",
    "CPUOffloadPolicy",
    "CollectiveFit",
    "Comm",
    "CommunicationReport",
    "CommunicationRow",
    "DataParallelMeshDims",
    "DivergenceError",
    "Event",
    "FSDPMeshInfo",
    "FSDPModule",
    "HSDPMeshInfo",
    "LocalShard",
    "MemoryReport",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "PendingSave",
    "PhaseMemory",
    "Plan",
    "PlanError",
    "ReduceScatter",
    "ReplicateModule",
    "Restored",
    "ShardPlacementResult",
    "ShardedCheckpointer",
    "SimulatedValueError",
    "SnapshotStats",
    "Snapshots",
    "Span",
    "StackedMuon",
    "StragglerReport",
    "StragglerRow",
    "TorchPatch",
    "TrainingState",
    "UnshardHandle",
    "WeightSync",
    "__version__",
    "accumulate",
    "apply_fully_shard",
    "check_replicas",
    "clip_grad_norm_",
    "communication_report",
    "declare_optimizer",
    "estimate_memory",
    "fully_shard",
    "init_like_unsharded",
    "is_simulated",
    "keep_frozen_gathered",
    "load_full_state_dict",
    "load_pretrained",
    "load_sharded",
    "local_step",
    "merge_timelines",
    "patch_torch_fsdp",
    "plan",
    "record_events",
    "register_fsdp_forward_method",
    "replicate",
    "save_chrome_trace",
    "save_full_state_dict",
    "save_pretrained",
    "save_sharded",
    "save_timeline",
    "set_debug",
    "shard_experts",
    "shard_optimizer_across_replicas",
    "share_comm_ctx",
    "straggler_report",
    "whole_tensor_step",
]
