"""A group's local shards packed into one buffer: the all-gather input.

Owns: ``PackedShards``. Does not own: the shards' contents or their sharded DTensors (each
``FSDPParam``), the all-gather itself (``AllGatherer``).

[Note: Packed shards]
At ``fully_shard`` each parameter's padded local shard is built in its own slot of one zeroed buffer,
in parameter order, so the slots are exactly the all-gather input layout and an unshard reads the
buffer itself (no copy-in with the built-in all-gather, one copy for a cast, one host-to-device copy
under CPU offload, nothing to gather for a one-rank shard group). Groups with all-gather extensions, or
with shards of several dtypes or devices, keep one buffer per parameter. Conversions and loads that
install new local tensors (``to_empty``, ``.double()``, ``load_state_dict(assign=True)``, a deep copy)
are packed again at the next lazy init; the sharded parameters keep their Python identity
(``_dtensor.rebase_local``), so an optimizer built before keeps training them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..param._extension import has_extension

if TYPE_CHECKING:
    from ..base._config import ParamSpec
    from ..param._param import FSDPParam

__all__ = ["PackedShards", "slots_of", "zeroed_shards"]


class PackedShards:
    """The local shards of one group as slots of one 1-D buffer.

    Fields:
    - ``flat``: 1-D, ``sum(splits)`` elements, the shards' dtype, on the shards' device (the CPU,
      pinned where possible, under CPU offload; meta until materialised); ``None`` where the group
      cannot pack. Zero in every padding element.
    - ``splits``: each parameter's padded shard numel, in parameter order (fixed at ``fully_shard``).
    - ``views``: each parameter's 1-D slot of ``flat``: its local shard while packing is intact.
    - ``usable``: resolved at lazy init: the next all-gather reads ``flat`` directly.
    """

    def __init__(self, splits: list[int], flat: torch.Tensor | None, offload: bool, pin: bool) -> None:
        self.splits = splits
        self.flat = flat
        self.views: tuple[torch.Tensor, ...] = slots_of(flat, splits) if flat is not None else ()
        self.usable = False
        self._offload = offload
        self._pin = pin

    @staticmethod
    def can_pack(specs: Sequence[ParamSpec], locals_: Sequence[torch.Tensor]) -> bool:
        """Whether these shards can share one buffer: no extensions, one dtype, one device."""
        if not locals_ or any(has_extension(t, s.owners[0][1]) for t, s in zip(locals_, specs, strict=True)):
            return False
        return len({t.dtype for t in locals_}) == 1 and len({t.device for t in locals_}) == 1

    def slots(self, count: int) -> Sequence[torch.Tensor | None]:
        """The slot of each of ``count`` parameters, or ``None`` each where the group does not pack."""
        return self.views if self.flat is not None else (None,) * count

    def intact(self, params: Sequence[FSDPParam]) -> bool:
        """Every parameter's local shard is still its slot of the buffer."""
        views = self.views
        return bool(views) and all(p.holds_shard(v) for p, v in zip(params, views, strict=True))

    def repack(self, params: Sequence[FSDPParam]) -> None:
        """Unless packing is intact: move the local shards into a fresh buffer, one padded slot each.

        Only where the group allows it: not for extensions (their inputs come from a hook), shards of
        several dtypes or devices, or a sharded parameter that is part of an autograd graph now: those
        keep per-parameter shards.
        """
        if self.intact(params) or not params or any(p.has_extension for p in params):
            return
        if len({p.shard_dtype for p in params}) != 1 or len({p.shard_device for p in params}) != 1:
            return
        if not all(p.can_move_shard() for p in params):
            return
        dtype, device = params[0].shard_dtype, params[0].shard_device
        flat = zeroed_shards(sum(self.splits), dtype, device, self._offload, self._pin)
        views = slots_of(flat, self.splits)
        for fsdp_param, view in zip(params, views, strict=True):
            fsdp_param.move_shard_into(view)
        self.flat, self.views = flat, views

    def gather_input(self, device: torch.device) -> torch.Tensor | None:
        """The packed shards as this rank's all-gather input on ``device``, if usable."""
        flat = self.flat
        if not self.usable or flat is None:
            return None
        if self._offload and device.type != "cpu":
            return flat.to(device, non_blocking=flat.is_pinned())
        return flat


def zeroed_shards(
    numel: int, dtype: torch.dtype, device: torch.device, offload: bool, pin: bool
) -> torch.Tensor:
    """A zeroed 1-D buffer for packed shards: on the CPU (pinned where ``pin``) under offload."""
    if offload and device.type != "meta":
        return torch.zeros(numel, dtype=dtype, device="cpu", pin_memory=pin)
    return torch.zeros(numel, dtype=dtype, device=device)


def slots_of(
    flat: torch.Tensor, sizes: Sequence[int], strides: Sequence[int] | None = None
) -> tuple[torch.Tensor, ...]:
    """1-D views of ``flat`` of ``sizes`` elements, each starting ``strides[i]`` after the previous.

    Plain ``narrow`` views, not ``split``'s: autograd and torch.compile treat views made by one
    multi-output op specially (no in-place updates through them, no view replay when fakified).
    """
    views = []
    offset = 0
    for size, stride in zip(sizes, sizes if strides is None else strides, strict=True):
        views.append(flat.narrow(0, offset, size))
        offset += stride
    return tuple(views)
