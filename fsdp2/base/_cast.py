"""Dtype casts of forward inputs and outputs for ``MixedPrecisionPolicy``.

Owns: casting the floating-point tensors nested in args/kwargs/outputs (tuples, lists, dicts,
namedtuples via pytree; dataclass instances, which pytree leaves whole, field by field in a shallow
copy, as torch's input casts do) and moving inputs to the compute device. Does not own: deciding
when to cast (``FSDPState``) or parameter dtypes (``FSDPParam``).
Invariants: integer, bool and complex tensors are never cast; tensors already in the dtype are
returned as they are (no copy, no autograd node).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
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
    return _map_tensors(lambda t: _cast_one(t, dtype), tree)


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """``tree`` with ``fn`` applied to every tensor, also inside dataclass instances (copied, not changed)."""

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return fn(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            clone = copy.copy(value)
            for field in dataclasses.fields(clone):
                # object.__setattr__: frozen dataclasses too (the copy is this function's own)
                object.__setattr__(clone, field.name, _map_tensors(fn, getattr(clone, field.name)))
            return clone
        return value

    return tree_map(leaf, tree)


def _cast_one(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if tensor.is_floating_point() and tensor.dtype != dtype:
        return tensor.to(dtype)
    return tensor


def move_to_device(tree: Any, device: torch.device) -> Any:
    """``tree`` with every tensor moved to ``device`` (non-blocking), as DDP does for inputs."""
    return _map_tensors(lambda t: t.to(device, non_blocking=True) if t.device != device else t, tree)
