"""torchtitan 0.3.0 on CPU: the stand-in for its Triton kernels, shared by the client tests.

Its model package imports its expert-parallel Triton kernels at import time; on a CPU-only machine a
stand-in module takes their place (the kernels are never called: the "standard" all-to-all
dispatcher does not use them).
"""

from __future__ import annotations

import sys
import types
from typing import Any

_TRITON_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
_KERNEL_NAMES = (
    "copy_full_counts_to_peers_kernel",
    "copy_rows_to_peers_kernel",
    "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel",
    "fill_dispatch_metadata_kernel",
    "invert_flat_indices_kernel",
    "reduce_topk_slots_kernel",
    "topk_scores_grad_kernel",
)


def stand_in_for_triton_kernels() -> None:
    """Put a module whose kernels raise in place of torchtitan's Triton kernels (before importing it)."""
    module = types.ModuleType(_TRITON_KERNELS)

    def unavailable(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("torchtitan's Triton kernels are not available on CPU")

    for name in _KERNEL_NAMES:
        setattr(module, name, unavailable)
    sys.modules[_TRITON_KERNELS] = module
