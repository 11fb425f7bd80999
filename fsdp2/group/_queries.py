"""The queries of one group for the rooms above the engine: per-group switches and facts.

Owns: ``group_name``, ``kept_grad_bytes``, ``held_grad_bytes`` and ``set_gradient_sync``, which
``fsdp2.accumulate`` (``optim/_accumulate.py``) calls on each group of ``runtime``'s ``groups_under``
instead of reading the group's fields; and the optimizer sharding across replicas
(``optim/_cross_replica.py``): ``replica_slicing_problem``, ``slice_across_replicas``,
``group_mesh_info`` and ``replica_all_gather``. Does not own: the reduction of
what was kept (the group's ``FSDPParamGroup.reduce_held_grads``), the reduction across replicas
(``_replica_reduce.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..base import CPUOffloadPolicy, MeshInfo
from ._param_group import FSDPParamGroup

__all__ = [
    "group_mesh_info",
    "group_name",
    "held_grad_bytes",
    "kept_grad_bytes",
    "replica_all_gather",
    "replica_slicing_problem",
    "set_gradient_sync",
    "slice_across_replicas",
]


def group_name(group: FSDPParamGroup) -> str:
    """The group's module name (``""``: the root; known from the root's first forward on)."""
    return group.module_fqn


def kept_grad_bytes(group: FSDPParamGroup) -> int:
    """Bytes of the unsharded gradients ``group`` holds when it skips a reduction.

    Kept in ``reduce_dtype`` where the policy sets one, else in the compute dtype; only trainable
    parameters count.
    """
    policy = group.config.mp_policy
    total = 0
    for fsdp_param in group.fsdp_params:
        if not fsdp_param.sharded_param.requires_grad:
            continue
        dtype = policy.reduce_dtype or policy.param_dtype or fsdp_param.orig_dtype
        total += fsdp_param.layout.orig_size.numel() * dtype.itemsize
    return total


def held_grad_bytes(group: FSDPParamGroup) -> int:
    """Bytes of the unsharded gradients ``group`` holds now (waiting for a reduction)."""
    return sum(t.numel() * t.element_size() for p in group.fsdp_params for t in p.unsharded.held_grads())


def set_gradient_sync(group: FSDPParamGroup, enabled: bool) -> bool:
    """Reduce ``group``'s gradients in each backward (``True``) or keep them; returns the old value."""
    previous = group.controls.reduce_grads
    group.controls.update(reduce_grads=enabled)
    return previous


# ---- the optimizer sharded across replicas -------------------------------------------------------


def group_mesh_info(group: FSDPParamGroup) -> MeshInfo:
    """The group's data-parallel layout (shard and replicate process groups)."""
    return group.mesh_info


def replica_slicing_problem(group: FSDPParamGroup) -> str | None:
    """Why ``group``'s gradients cannot be reduce-scattered across replicas (``None``: they can)."""
    info = group.mesh_info
    if info.replicate_group is None or info.replicate_size < 2:
        return "its mesh has no replicate dim of more than one rank (plain FSDP: nothing to shard across)"
    if info.outer_data_parallel > 1:
        return "its parameters are experts on an expert-parallel mesh"
    if group.controls.all_reduce_hook is not None:
        return "it has an all-reduce hook (set_all_reduce_hook), which reads whole reduced shards"
    if group.controls.deterministic_reduction or group.config.mp_policy.wire_dtype is not None:
        return "its reduction is tree-ordered (set_deterministic_reduction or a wire_dtype)"
    if isinstance(group.config.offload_policy, CPUOffloadPolicy):
        return "it offloads its shards to the CPU"
    for fsdp_param in group.fsdp_params:
        if fsdp_param.is_tensor_parallel or fsdp_param.layout.shard_dim != 0:
            name = fsdp_param.fqn
            return f"its parameter {name} is not sharded on dim 0 alone (tensor parallel, or Shard(d>0))"
    return None


def slice_across_replicas(group: FSDPParamGroup, mesh: DeviceMesh | None) -> None:
    """Reduce-scatter ``group``'s gradients across replicas into slices on ``mesh`` (``None``: all-reduce)."""
    group.controls.update(replica_slices=mesh)


def replica_all_gather(group: FSDPParamGroup) -> Callable[[torch.Tensor, torch.Tensor, Any], None]:
    """The group's all-gather across replicas, ``(output, input, process group)`` (recorded like the rest)."""
    return group.comms.replica_all_gather
