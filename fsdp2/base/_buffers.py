"""Non-persistent buffers across ``to_empty``: their values kept, or marked as never set.

Owns: what ``to_empty`` on a ``fully_shard`` module does to the non-persistent buffers under it
(``KeptBuffers``), and the query a load asks before it trusts them (``unset_buffers``). Does not own:
rebuilding a buffer's value (a load asks the model's own initialisation, ``weights/_buffers.py``).

[Note: Non-persistent buffers and to_empty]
Checkpoints hold parameters and persistent buffers only. A non-persistent buffer (RoPE's
``inv_freq``, a causal mask) has the value its module computed when it was built, and nothing else
ever writes it; ``to_empty`` replaces it with uninitialised memory. So a ``fully_shard`` module's
``to_empty`` copies back the value of every non-persistent buffer that had one (built on a real
device), and marks each one that had none (built on ``meta``) with its version counter at that
moment. The mark lasts while that tensor is the buffer and nothing has written it: a ``copy_`` bumps
the version, an assignment replaces the tensor. A load that finds a marked buffer rebuilds it or
refuses to run, naming it: a forward over uninitialised memory gives a silently wrong result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch import nn

__all__ = ["KeptBuffers", "unset_buffers"]

T = TypeVar("T")
_MARK = "_fsdp2_unset_at_version"  # on a buffer tensor: its version when to_empty left it unset


def _non_persistent(module: nn.Module, recurse: bool) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    """``(qualified name, owner, name, tensor)`` of each non-persistent buffer, once per tensor."""
    seen: set[int] = set()
    modules = module.named_modules() if recurse else [("", module)]
    for prefix, owner in modules:
        for name in owner._non_persistent_buffers_set:  # noqa: SLF001 - nn.Module keeps no other record
            tensor = owner._buffers.get(name)  # noqa: SLF001
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            yield (f"{prefix}.{name}" if prefix else name), owner, name, tensor


class KeptBuffers:
    """The non-persistent buffers under a module, held across one ``to_empty``.

    Fields:
    - ``_values``: ``(owner, name, value)`` for each buffer that held values before (a copy of them).
    - ``_unset``: ``(owner, name)`` for each buffer that was on the meta device (no values to keep).
    """

    def __init__(self, module: nn.Module, recurse: bool) -> None:
        self._values: list[tuple[nn.Module, str, torch.Tensor]] = []
        self._unset: list[tuple[nn.Module, str]] = []
        for _, owner, name, tensor in _non_persistent(module, recurse):
            if tensor.is_meta or _is_unset(tensor):
                self._unset.append((owner, name))
            else:
                self._values.append((owner, name, tensor.detach().clone()))

    def around(self, to_empty: Callable[[], T]) -> T:
        """Run ``to_empty()`` (the module's own), then put the buffers back."""
        result = to_empty()
        self.put_back()
        return result

    def put_back(self) -> None:
        """After ``to_empty``: copy the kept values back and mark the rest as unset."""
        with torch.no_grad():
            for owner, name, value in self._values:
                tensor = owner._buffers.get(name)  # noqa: SLF001
                if tensor is not None and not tensor.is_meta:
                    tensor.copy_(value)
            for owner, name in self._unset:
                tensor = owner._buffers.get(name)  # noqa: SLF001
                if tensor is not None and not tensor.is_meta:
                    setattr(tensor, _MARK, tensor._version)  # noqa: SLF001 - no public API


def _is_unset(tensor: torch.Tensor) -> bool:
    return getattr(tensor, _MARK, None) == tensor._version  # noqa: SLF001 - no public API


def unset_buffers(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """``(qualified name, owner, name)`` of each non-persistent buffer ``to_empty`` left unset."""
    return [
        (qualified, owner, name)
        for qualified, owner, name, tensor in _non_persistent(model, recurse=True)
        if _is_unset(tensor)
    ]
