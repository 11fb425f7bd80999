"""Parameters registered under a sharded model after ``fully_shard``.

Owns: two global registration hooks (torch's module and parameter registration hooks) that note each
submodule or parameter registered on a module some ``fully_shard`` call manages, and the check at the
next iteration root's forward: a noted parameter that requires grad and is not a sharded DTensor
belongs to no group, so its gradient would never be averaged and the ranks' copies would drift apart
(torch's ``fully_shard`` lets it train so). Notes are per thread (ranks may be threads of one process).
Does not own: deciding what is managed at ``fully_shard`` (``_fully_shard``) or the forward hooks.
Cost: one dict lookup per registration anywhere in the process; nothing per forward unless a
registration was noted.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

_MANAGED = "_is_fsdp_managed_module"  # set by fully_shard on every module it manages
_local = threading.local()  # .pending: list of (weakref to the parent, attribute name); .quiet: bool
_hooks: list[Any] = []


class _Count:
    """Registrations noted and not yet checked, in every thread.

    The root's per-iteration check reads this one attribute (``if LATE.pending:``) before calling
    ``check_late_parameters``.
    """

    __slots__ = ("lock", "pending")

    def __init__(self) -> None:
        self.pending = 0
        self.lock = threading.Lock()


LATE = _Count()


def watch_registrations() -> None:
    """Install the registration hooks (once per process; called by ``fully_shard``)."""
    if not _hooks:
        _hooks.append(register_module_module_registration_hook(_on_registration))
        _hooks.append(register_module_parameter_registration_hook(_on_registration))


class quiet_registrations:  # noqa: N801 - used like a function: `with quiet_registrations():`
    """fsdp2's own registrations (sharded and unsharded parameters) are not the user's additions."""

    def __enter__(self) -> None:
        _local.quiet = True

    def __exit__(self, *exc: object) -> None:
        _local.quiet = False


class _Notes(list):  # type: ignore[type-arg]
    """One thread's noted registrations; a thread that ends with some unchecked stops counting them.

    (Threads as ranks end after their job: their notes must not make every later forward check.)
    """

    def __del__(self) -> None:
        if self:
            with LATE.lock:
                LATE.pending -= len(self)


def _on_registration(module: nn.Module, name: str, value: Any) -> None:
    if value is None or not module.__dict__.get(_MANAGED, False) or getattr(_local, "quiet", False):
        return
    pending = getattr(_local, "pending", None)
    if pending is None:
        pending = _local.pending = _Notes()
    pending.append((weakref.ref(module), name))
    with LATE.lock:
        LATE.pending += 1


def check_late_parameters() -> None:
    """Raise if a parameter registered after ``fully_shard`` trains under no group (root forward)."""
    pending = getattr(_local, "pending", None)
    if not pending:
        return
    items = list(pending)
    pending.clear()
    with LATE.lock:
        LATE.pending -= len(items)
    for ref, name in items:
        module = ref()
        if module is None:
            continue
        value: Any = module._modules.get(name) or module._parameters.get(name)  # noqa: SLF001 - as registered
        params: list[Any] = list(value.parameters()) if isinstance(value, nn.Module) else [value]
        for param in params:
            if isinstance(param, torch.Tensor) and param.requires_grad and not isinstance(param, DTensor):
                what = "submodule" if isinstance(value, nn.Module) else "parameter"
                raise RuntimeError(
                    f"The {what} {type(module).__name__}.{name} was added after fully_shard, and no "
                    "fully_shard group manages its parameters: their gradients would never be averaged "
                    "across ranks, so the ranks' copies would drift apart. Build the whole model before "
                    "sharding it, or call fully_shard on the new submodule before the root's first "
                    "forward (or set requires_grad=False on parameters that must not train)."
                )
