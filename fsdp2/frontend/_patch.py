"""``patch_torch_fsdp()``: make fsdp2 the implementation behind torch's ``fully_shard`` name.

Owns: swapping the ``fully_shard`` attribute of the torch modules that export it (and putting it
back), for libraries that import torch's ``fully_shard`` themselves (accelerate, transformers,
torchtitan, torch's pipelining). Nothing else of torch is changed: fsdp2 modules are already
instances of ``torch.distributed.fsdp.FSDPModule``, torch's policies are accepted as they are, and
torch's ``register_fsdp_forward_method`` / ``share_comm_ctx`` work on fsdp2 modules.
Invariants: patching twice is a no-op; ``restore()`` puts back exactly what was there.
"""

from __future__ import annotations

import importlib
from types import TracebackType
from typing import Any

from ._fully_shard import fully_shard

# The modules through which torch 2.13 exports fully_shard publicly (the second is the path
# torchtitan and torch's own tests import from).
_EXPORTERS = (
    "torch.distributed.fsdp",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
)


class TorchPatch:
    """What :func:`patch_torch_fsdp` replaced; ``restore()`` (or leaving a ``with`` block) undoes it."""

    def __init__(self, saved: list[tuple[Any, Any]]) -> None:
        self._saved = saved

    def restore(self) -> None:
        """Put torch's own ``fully_shard`` back where it was replaced (idempotent)."""
        for module, original in reversed(self._saved):
            setattr(module, "fully_shard", original)  # noqa: B010 - a module object, not typed
        self._saved = []

    def __enter__(self) -> TorchPatch:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.restore()


def patch_torch_fsdp() -> TorchPatch:
    """Make ``torch.distributed.fsdp.fully_shard`` (and its ``_composable`` alias) fsdp2's.

    For libraries that call torch's ``fully_shard`` themselves. Code that imported the name before
    this call keeps torch's: call it before importing such a library (torchtitan imports it at module
    level; accelerate and transformers look it up when they shard). Modules sharded by fsdp2 are
    already ``torch.distributed.fsdp.FSDPModule`` instances, so no other name needs replacing.

    Returns:
        A :class:`TorchPatch`; ``restore()`` or a ``with`` block puts torch's functions back.

    Example:
        >>> import fsdp2  # doctest: +SKIP
        >>> fsdp2.patch_torch_fsdp()  # doctest: +SKIP
        >>> from torchtitan.distributed import fsdp  # its fully_shard is now fsdp2's  # doctest: +SKIP
    """
    saved: list[tuple[Any, Any]] = []
    for name in _EXPORTERS:
        module = importlib.import_module(name)
        # In the last module the name is both the submodule and its function; take the module object.
        original = getattr(module, "fully_shard", None)
        if original is not None and original is not fully_shard and callable(original):
            saved.append((module, original))
            setattr(module, "fully_shard", fully_shard)  # noqa: B010 - a module object, not typed
    return TorchPatch(saved)
