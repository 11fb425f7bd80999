"""A group's unsharded parameters: where the all-gather's output lands, and their registration.

Owns: ``UnshardedBuffer``. Does not own: issuing or waiting for the all-gather (``AllGatherer``), the
parameters' unsharded ``nn.Parameter`` objects (each ``FSDPParam``).

[Note: One unsharded buffer per group]
For ``Shard(0)`` groups without extensions and with one gathered dtype, every parameter's all-gather
output (``W`` padded shards, rank blocks in order) is a slot of one group buffer, so unsharding grows
one storage and resharding frees it; the copy-out views into it are built once per world size. For
one rank the gathered layout is the buffer's own and copy-out is a single copy. Other groups keep one
output per parameter (each ``FSDPParam`` allocates its own). Registering the unsharded and the sharded
parameters on their modules is a list of dict writes resolved once (``_build_slots``) instead of a
method call per parameter.

[Note: A kept copy]
A group kept gathered (``fsdp2.keep_frozen_gathered``) reshards as any group does: its sharded
parameters are registered again after backward, after a no-grad forward and at ``state_dict()``, so
``model.parameters()``, an optimizer, a state dict, ``check_replicas`` and ``WeightSync`` see the
sharded DTensors, never a stale unsharded tensor. Only its storage is not freed: the gathered values
stay, with the version counters of the shards they came from (``held``). The next unshard registers
them again without a collective while every counter is unchanged; any in-place write to a shard since
(an optimizer step after unfreezing, ``load_state_dict``, ``init_like_unsharded``, a load into
``state_dict()``'s tensors, whose local tensors share the parameters' counters: see
``FSDPParam.detached_sharded``) changes one, and the group gathers again. ``model.reshard()`` and
conversions free the copy (``release``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..comm import AllGatherResult, copy_out_2d
from ._gather import slots_of

if TYPE_CHECKING:
    from ..param import FSDPParam

__all__ = ["UnshardedBuffer"]

_ALIGN_BYTES = 64  # where each parameter's part of a group's unsharded buffer starts
_Slot = tuple[dict[str, Any], str, torch.Tensor]  # (module._parameters, name, tensor to register)


class UnshardedBuffer:
    """The unsharded storage of one group's parameters and the entries that register them.

    Fields:
    - ``shares``: resolved at lazy init: the parameters' outputs are slots of ``data`` (``Shard(0)``,
      no extension, one gathered dtype); otherwise each parameter owns its output.
    - ``data``: ``.data`` alias of the 1-D group buffer (gathered dtype, compute device), every
      parameter's part starting on a 64-byte boundary; allocated at the first unshard, its storage
      resized to 0 at reshard and regrown at the next unshard. ``None`` before, or when not shared.
    - ``_one_copy``: one rank and no alignment gaps: the gathered layout, copy-out is one copy.
    - ``_targets``: world size -> each output viewed ``(W, split)`` (the copy-out destinations).
    - ``_unsharded`` / ``_sharded``: registration entries of every parameter's unsharded / sharded
      form; ``None`` until built (or where an owner module customises ``__setattr__``).
    - ``_requires_grad``: (sharded, unsharded) parameter pairs whose ``requires_grad`` must agree.
    """

    def __init__(self) -> None:
        self.shares = False
        self.data: torch.Tensor | None = None
        self._nbytes = 0
        self._one_copy: torch.Tensor | None = None
        self._targets: dict[int, list[torch.Tensor]] = {}
        self._unsharded: list[_Slot] | None = None
        self._sharded: list[_Slot] | None = None
        self._requires_grad: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.held: tuple[int, ...] | None = None  # a kept copy: its shards' versions (see the Note)

    def resolve(self, params: Sequence[FSDPParam], shares: bool, dtype: torch.dtype, sharded: bool) -> None:
        """Lazy init: share one buffer or not; drop a buffer a conversion made stale (``.double()``)."""
        if sharded and self.data is not None and (not shares or self.data.dtype != dtype):
            for fsdp_param in params:
                fsdp_param.drop_unsharded()
            self.data = self._one_copy = None
        self.shares = shares
        self.held = None  # dtypes or layouts may have changed: gather again
        self._targets.clear()
        self.forget_slots()

    def forget_slots(self) -> None:
        """Rebuild the registration entries at the next unshard (parameters or modules changed)."""
        self._unsharded = self._sharded = None
        self._requires_grad = []

    # ---- storage ---------------------------------------------------------------------------------

    def fill(
        self,
        result: AllGatherResult,
        params: Sequence[FSDPParam],
        dtype: torch.dtype,
        as_bytes: bool,
        keep: bool = False,
    ) -> None:
        """Allocate (or regrow) the outputs and copy this group's part of ``result`` into them.

        ``keep``: hold them across reshards as a kept copy (see [Note: A kept copy]).
        """
        self.held = _shard_versions(params) if keep else None
        if self.shares:
            self._grow(params, dtype, result.world_size)
        else:
            for fsdp_param in params:
                fsdp_param.all_gather_outputs()  # (re)allocates their storage
        # Hot path: the (W, split) views survive storage resizes, so build them once per world size.
        targets = self._targets.get(result.world_size)
        if targets is None:
            outputs = [o for p in params for o in p.all_gather_outputs()]
            if as_bytes:
                outputs = [o.view(torch.uint8) for o in outputs]
            targets = [o.view(result.world_size, -1) for o in outputs]
            self._targets[result.world_size] = targets
        one_copy = self._one_copy if self.shares else None
        if one_copy is not None:
            one_copy.copy_(result.output)  # one rank: no buckets, no post-forward mesh
        else:
            copy_out_2d(result, targets)

    def _grow(self, params: Sequence[FSDPParam], dtype: torch.dtype, world: int) -> None:
        """Allocate the group buffer (binding every parameter to its part), or regrow its storage."""
        data = self.data
        if data is None:
            sizes = [world * p.layout.padded_shard_numel for p in params]
            # Every parameter starts on a 64-byte boundary, as a tensor of its own would: vectorized
            # kernels and cuBLAS pick slower paths for misaligned operands.
            align = max(1, _ALIGN_BYTES // dtype.itemsize)
            aligned = [-(-size // align) * align for size in sizes]
            flat = torch.empty(sum(aligned), dtype=dtype, device=params[0].device)
            self.data = data = flat.data
            self._nbytes = data.untyped_storage().nbytes()
            gapless = world == 1 and aligned[:-1] == sizes[:-1]
            self._one_copy = data.narrow(0, 0, sum(sizes)) if gapless else None
            views = slots_of(flat, sizes, aligned)
            data_views = slots_of(data, sizes, aligned)
            for fsdp_param, view, alias in zip(params, views, data_views, strict=True):
                fsdp_param.bind_unsharded_storage(view, alias)
            self._targets.clear()
            self.forget_slots()
        elif data.untyped_storage().nbytes() == 0:
            data.untyped_storage().resize_(self._nbytes)

    def free(self) -> None:
        """Release the group buffer's storage (the views and parameter objects stay)."""
        if self.data is not None:
            self.data.untyped_storage().resize_(0)

    # ---- a kept copy (see [Note: A kept copy]) ----------------------------------------------------

    def current(self, params: Sequence[FSDPParam]) -> bool:
        """Whether a kept copy holds the values of ``params``' shards as they are now."""
        return self.held is not None and self.held == _shard_versions(params)

    def release(self, params: Sequence[FSDPParam]) -> None:
        """Free a kept copy (sharded state only); the next unshard gathers again."""
        if self.held is None:
            return
        self.held = None
        self.free()
        for fsdp_param in params:
            fsdp_param.free_unsharded()

    # ---- registration ----------------------------------------------------------------------------

    def register_unsharded(self, params: Sequence[FSDPParam], sync_requires_grad: bool, batch: bool) -> None:
        """Register every parameter's unsharded form (batched once the entries are known).

        ``sync_requires_grad``: carry a freeze or unfreeze of a sharded parameter over (forward only:
        backward re-gathers for the graph forward recorded). ``batch``: the entries may be batched.
        """
        slots = self._unsharded
        if slots is None:
            for fsdp_param in params:
                fsdp_param.to_unsharded()
            if batch:
                self._build_slots(params)
            return
        if sync_requires_grad:
            for sharded, unsharded in self._requires_grad:
                if sharded.requires_grad is not unsharded.requires_grad:
                    unsharded.requires_grad_(sharded.requires_grad)
        for registry, name, tensor in slots:
            registry[name] = tensor

    def register_sharded(self, params: Sequence[FSDPParam], from_unsharded: bool) -> None:
        """Register every parameter's sharded form again (batched from the unsharded state).

        The unsharded storage is freed, unless a kept copy is held.
        """
        keep = self.held is not None
        slots = self._sharded
        if slots is not None and from_unsharded:
            for registry, name, tensor in slots:
                registry[name] = tensor
        else:
            for fsdp_param in params:
                fsdp_param.to_sharded(free=not keep)
        if not keep:
            self.free()

    def _build_slots(self, params: Sequence[FSDPParam]) -> None:
        """Resolve the batched registrations, where every owner module allows them."""
        unsharded: list[_Slot] = []
        sharded: list[_Slot] = []
        for fsdp_param in params:
            entries = fsdp_param.registration_slots(unsharded=True)
            back = fsdp_param.registration_slots(unsharded=False)
            if entries is None or back is None:
                return
            unsharded.extend(entries)
            sharded.extend(back)
        self._requires_grad = [
            (p.sharded_param, p.unsharded_param)  # type: ignore[misc]  # reason: unsharded after to_unsharded
            for p in params
        ]
        self._unsharded, self._sharded = unsharded, sharded


def _shard_versions(params: Sequence[FSDPParam]) -> tuple[int, ...]:
    """The version counters of ``params``' sharded parameters and of their local tensors.

    An in-place op on the DTensor (an optimizer step, ``load_state_dict``'s copy) bumps the
    DTensor's counter only; a write to its local tensor (``init_like_unsharded``, ``to_local()``, a
    local-shard optimizer step) bumps the local's. Together they change at every in-place write.
    """
    versions = []
    for fsdp_param in params:
        versions.append(fsdp_param.sharded_param._version)  # noqa: SLF001 - no public API
        versions.append(fsdp_param.local.local_tensor()._version)  # noqa: SLF001
    return tuple(versions)
