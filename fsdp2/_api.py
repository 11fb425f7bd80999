"""User-facing configuration records.

Owns: ``MixedPrecisionPolicy``, ``OffloadPolicy`` and ``CPUOffloadPolicy``; plain frozen data, no
communication. Invariants: instances are immutable and hashable, so one policy may serve many calls.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    Sharded parameters and their gradients always keep the original dtype.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


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
