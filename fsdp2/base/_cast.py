"""Dtype casts of forward inputs and outputs for ``MixedPrecisionPolicy``.

Owns: casting the floating-point tensors nested in args/kwargs/outputs (tuples, lists, dicts,
namedtuples, dataclasses via pytree) and moving inputs to the compute device. Does not own: deciding
when to cast (``FSDPState``) or parameter dtypes (``FSDPParam``).
Invariants: integer, bool and complex tensors are never cast; tensors already in the dtype are
returned as they are (no copy, no autograd node).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor of another dtype cast to ``dtype``."""
    if type(tree) is torch.Tensor:
        return _cast_one(tree, dtype)
    if type(tree) is tuple and all(type(t) is torch.Tensor for t in tree):
        # Hot path: positional tensors only, no pytree walk.
        return tuple(_cast_one(t, dtype) for t in tree)
    return tree_map(lambda t: _cast_one(t, dtype) if isinstance(t, torch.Tensor) else t, tree)


def _cast_one(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if tensor.is_floating_point() and tensor.dtype != dtype:
        return tensor.to(dtype)
    return tensor


def move_to_device(tree: Any, device: torch.device) -> Any:
    """``tree`` with every tensor moved to ``device`` (non-blocking), as DDP does for inputs."""
    return tree_map(
        lambda t: (
            t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) and t.device != device else t
        ),
        tree,
    )
