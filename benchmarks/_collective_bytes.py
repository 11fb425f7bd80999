"""What each c10d collective a rank dispatches moves, by kind: shared by the benchmarks that count it.

``CollectiveBytes`` is a dispatch mode over torch's c10d and functional-collective ops: per kind
(all-gather, reduce-scatter, all-reduce, all-to-all, broadcast) the calls and the bytes, an
all-gather's output (what the rank gathers: the unsharded size), the others' input (what it sends).
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_KINDS = {
    "allgather": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "alltoall": "all_to_all",
    "all_to_all": "all_to_all",
    "allreduce": "all_reduce",
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
}
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")


class CollectiveBytes(TorchDispatchMode):
    """Calls and bytes of each c10d collective this rank dispatches, by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()
        self.bytes: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        namespace = func.namespace
        if namespace in ("c10d", "_c10d_functional"):
            name = func.name().split("::")[-1]
            kind = next((k for key, k in _KINDS.items() if key in name), None)
            if kind is not None:
                if kind == "all_gather":
                    moved = args[0] if namespace == "c10d" else out
                elif namespace == "c10d" and kind in ("reduce_scatter", "all_to_all"):
                    moved = args[1]  # (output, input, ...)
                else:
                    moved = args[0]
                self.calls[kind] += 1
                self.bytes[kind] += _nbytes(moved)
        return out


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0
