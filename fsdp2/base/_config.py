"""Configuration records handed down from ``fully_shard`` to groups and parameters.

Owns: ``ParamSpec`` (one parameter to manage: where it is registered, which dim to shard),
``GroupConfig`` (what one ``fully_shard`` call fixed for its group) and ``GroupControls`` (the knobs the
``FSDPModule`` setters turn at run time). Plain data: no communication, no module state.
Invariants: ``ParamSpec`` and ``GroupConfig`` never change after construction; ``GroupControls`` changes
only through ``FSDPModule`` setters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ._api import MixedPrecisionPolicy, OffloadPolicy
from ._mesh import MeshInfo, SpmdDims


@dataclass(frozen=True)
class ParamSpec:
    """One parameter for a group to manage.

    Attributes:
        param: the original parameter.
        owners: every ``(module, attribute name)`` it is registered under (several when tied).
        shard_dim: the dim to shard on (``shard_placement_fn``); 0 by default.
        spmd_mesh: for a tensor-parallel (DTensor) parameter, the data-parallel mesh dims followed by
            its TP mesh dims, one mesh (the sharded parameter's DTensor mesh); ``None`` otherwise.
        dp_dims: with ``DataParallelMeshDims``, its dims resolved against the parameter's own (full SPMD)
            mesh; ``None`` otherwise.
    """

    param: nn.Parameter
    owners: tuple[tuple[nn.Module, str], ...]
    shard_dim: int = 0
    spmd_mesh: DeviceMesh | None = None
    dp_dims: SpmdDims | None = None


@dataclass(frozen=True)
class GroupConfig:
    """What one ``fully_shard`` call fixed for its group: mesh, policies and compute device."""

    mesh_info: MeshInfo
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy
    device: torch.device


@dataclass
class GroupControls:
    """Run-time controls of one group, set by the ``FSDPModule`` setters.

    Attributes:
        reduce_grads: reduce-scatter gradients after backward (``set_requires_gradient_sync``).
        all_reduce_grads: HSDP: all-reduce across replicas too (``set_requires_all_reduce``).
        reshard_after_backward: free unsharded parameters after backward.
        unshard_in_backward: all-gather in backward (``set_unshard_in_backward``).
        reshard_after_no_grad_forward: fully reshard after a forward under ``no_grad``; ``False`` only
            when the user asked for ``reshard_after_forward=False`` (eval loops keep parameters).
        gradient_divide_factor: divide summed gradients by this instead of the rank count.
        force_sum_reduction: SUM collectives only, dividing afterwards.
        all_reduce_hook: called on each reduced gradient buffer.
        all_reduce_hook_stream: the stream the hook runs on on an accelerator (``None``: the reduce-scatter
            stream; on the CPU the hook runs in place).
        reduce_scatter_unused_params: reduce zero gradients for parameters that got none in this
            backward, so ranks whose control flow skipped a parameter still issue the same collective.
        reduce_scatter_max_input_buffers: reduce-scatter input buffers kept in flight (CUDA; >= 1).
        unshard_async_op: the pre-forward and pre-backward all-gathers run as async ops on the current
            stream instead of the all-gather streams (``_set_unshard_async_op``).
        deterministic_reduction: sum gradients in a fixed tree order (``set_deterministic_reduction``).
        keep_gathered: once gathered, the parameters stay unsharded (``fsdp2.keep_frozen_gathered``);
            the schedule gathers them again when a shard changed in place since.
        replica_slices: HSDP or replicate with the optimizer sharded across replicas
            (``fsdp2.shard_optimizer_across_replicas``): the mesh of the replica slices; gradients are
            reduce-scattered across replicas instead of all-reduced, each rank getting its slice
            (see [Note: Replica slices] in ``param/_replica_slices.py``). ``None``: all-reduced.
    """

    reduce_grads: bool = True
    all_reduce_grads: bool = True
    reshard_after_backward: bool = True
    unshard_in_backward: bool = True
    reshard_after_no_grad_forward: bool = True
    gradient_divide_factor: float | None = None
    force_sum_reduction: bool = False
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    all_reduce_hook_stream: torch.Stream | None = None
    reduce_scatter_unused_params: bool = False
    reduce_scatter_max_input_buffers: int = 1
    unshard_async_op: bool = False
    deterministic_reduction: bool = False
    keep_gathered: bool = False
    replica_slices: Any = None  # a DeviceMesh, or None

    def update(self, **values: Any) -> None:
        """Set the named controls (the one way setters change them); an unknown name is a bug."""
        unknown = sorted(set(values) - _CONTROL_NAMES)
        assert not unknown, f"GroupControls has no {unknown}"
        for name, value in values.items():
            setattr(self, name, value)


_CONTROL_NAMES = frozenset(f.name for f in fields(GroupControls))
