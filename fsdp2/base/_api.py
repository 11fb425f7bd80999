"""User-facing configuration records.

Owns: ``MixedPrecisionPolicy``, ``OffloadPolicy`` and ``CPUOffloadPolicy``; plain frozen data, no
communication, validated when constructed; ``as_fsdp2_policy``, which accepts torch's own policy
objects (same fields, same meaning) without importing torch's FSDP package.
Invariants: instances are immutable and hashable, so one policy may serve many calls.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from typing import Any

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes used for compute, gradient reduction and outputs.

    Args:
        param_dtype: dtype of the unsharded parameters, hence of the all-gather and of forward and
            backward compute. ``None`` keeps each parameter's own dtype.
        reduce_dtype: dtype of the gradient reduce-scatter. ``None`` reduces in the gradient's dtype.
        output_dtype: floating-point forward outputs are cast to this dtype. ``None`` leaves them.
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype``.
        wire_dtype (fsdp2 only): gradients travel in this dtype and are summed in ``reduce_dtype`` (or
            the gradients' dtype) where they arrive, by a pairwise tree over global rank order (an
            all-to-all and local sums instead of a reduce-scatter). With bf16 gradients,
            ``wire_dtype=torch.bfloat16`` and ``reduce_dtype=torch.float32`` nothing is lost: the
            sharded gradient is the fp32 sum of the bf16 gradients, for half the bytes of an fp32
            reduce-scatter. A reduction of gradients held over no-sync micro-batches (their
            ``reduce_dtype`` sum) travels in ``reduce_dtype``.
            ``None``: the backend's reduce-scatter in ``reduce_dtype``. See docs/precision.md.

    Sharded parameters and their gradients always keep the original dtype.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    wire_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype", "wire_dtype"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, torch.dtype):
                hint = f" (pass torch.{value})" if isinstance(value, str) and hasattr(torch, value) else ""
                raise TypeError(
                    f"MixedPrecisionPolicy({name}=...) expects a torch.dtype or None, got "
                    f"{type(value).__name__} {value!r}{hint}."
                )
            if not value.is_floating_point:
                raise ValueError(
                    f"MixedPrecisionPolicy({name}={value}) must be a floating-point dtype (e.g. "
                    "torch.bfloat16, torch.float16, torch.float32) or None."
                )
        wire, reduce = self.wire_dtype, self.reduce_dtype
        if wire is not None and reduce is not None and wire.itemsize > reduce.itemsize:
            raise ValueError(
                f"MixedPrecisionPolicy(wire_dtype={wire}, reduce_dtype={reduce}): the wire dtype is wider "
                "than the dtype gradients are summed in, so it would send more bytes than it keeps. Use a "
                "wire_dtype no wider than reduce_dtype (e.g. wire_dtype=torch.bfloat16, "
                "reduce_dtype=torch.float32), or leave wire_dtype None."
            )
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(
                "MixedPrecisionPolicy(cast_forward_inputs=...) expects a bool, got "
                f"{type(self.cast_forward_inputs).__name__} {self.cast_forward_inputs!r}."
            )


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters and gradients stay on the mesh's device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and hence optimizer state on the CPU.

    Args:
        pin_memory: pin the CPU copies so host-device copies can run without blocking. On a machine
            without an accelerator pinning does not exist; fsdp2 then skips it and warns once.
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise TypeError(
                f"CPUOffloadPolicy(pin_memory=...) expects a bool, got {type(self.pin_memory).__name__} "
                f"{self.pin_memory!r}."
            )


@dataclass(frozen=True)
class DataParallelMeshDims:
    """Which named dims of a full SPMD mesh are data parallel (parameters already DTensors on it).

    Pass it as ``fully_shard(module, mesh=spmd_mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))``
    when parameters are DTensors on the whole mesh with ``Replicate()`` on the data-parallel dims.

    Args:
        shard: the dim name FSDP shards parameters over, or several adjacent ones in mesh order (e.g.
            ``("dp_shard", "cp")``), flattened into one shard dim as torch does; ``None``: no
            sharding (with ``replicate``: data parallel like DDP, gradients all-reduced).
        replicate: the dim name replicas live on (HSDP, or DDP without ``shard``), several (flattened
            into one), or ``None``.
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("DataParallelMeshDims needs shard, replicate or both set to mesh dim names.")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


# Where torch defines the policy classes; looked up in sys.modules only (an object of one of them means
# the user already imported it), so fsdp2 itself never imports torch's FSDP package.
_TORCH_POLICY_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_api"


def as_fsdp2_policy(policy: Any) -> Any:
    """``policy`` itself, or the fsdp2 equivalent of one of torch's policy objects.

    torch's ``MixedPrecisionPolicy`` / ``OffloadPolicy`` / ``CPUOffloadPolicy`` become fsdp2's with the
    same fields; anything else is returned unchanged for the caller to refuse.
    """
    if isinstance(policy, (MixedPrecisionPolicy, OffloadPolicy, DataParallelMeshDims)):
        return policy
    torch_api = sys.modules.get(_TORCH_POLICY_MODULE)
    if torch_api is None:
        return policy
    for name, ours in (
        ("DataParallelMeshDims", DataParallelMeshDims),
        ("MixedPrecisionPolicy", MixedPrecisionPolicy),
        ("CPUOffloadPolicy", CPUOffloadPolicy),
        ("OffloadPolicy", OffloadPolicy),
    ):
        theirs = getattr(torch_api, name, None)
        if isinstance(theirs, type) and isinstance(policy, theirs):
            return ours(**{f.name: getattr(policy, f.name) for f in fields(ours) if hasattr(policy, f.name)})
    return policy
