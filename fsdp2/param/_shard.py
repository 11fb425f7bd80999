"""One parameter's sharded form: its padded local shard and the sharded DTensor parameter over it.

Owns: ``PaddedShard`` (building the shard from the original parameter, re-adopting it after a module
conversion or a load, moving it into a slot of the group's packed buffer, offloading and pinning it,
the all-gather input it gives, a full tensor's shard as a DTensor, a meta stand-in, and setting or
adding to the sharded parameter's gradient after a reduction), and the tag that marks sharded
parameters as fsdp2's (``mark_managed`` / ``is_managed``). See [Note: FSDP tensors] in ``_param``.
Does not own: the sizes (``ShardLayout``), the DTensor specs (``_tp``), the unsharded form and its
gradient (``_unsharded``), registration on modules or dtype policy (``FSDPParam``).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ._dtensor import (
    DTensorSpec,
    local_of,
    make_spec,
    rebase_local,
    set_local,
    sole_reference,
    spec_of,
    wrap_local,
)
from ._extension import may_gain_hooks
from ._layout import ShardLayout, chunk_rows
from ._tp import TPLayout

__all__ = ["PaddedShard", "is_managed", "mark_managed"]


class PaddedShard:
    """One parameter's padded local shard and the sharded DTensor ``nn.Parameter`` that views it.

    Fields:
    - ``layout``: the parameter's ``ShardLayout`` (fixed).
    - ``device``: the compute device (fixed): where the all-gather input goes, and where a shard
      materialised from meta lives without CPU offload.
    - ``offload`` / ``pin``: CPU offload: the shard lives on the CPU (pinned where ``pin``) and is
      copied to ``device`` for each all-gather (fixed).
    - ``shard``: 1-D, ``layout.padded_shard_numel`` elements, the parameter's dtype (of its tensor
      subclass for an extension weight, built with its own ops: ``subclass_shard``), on ``device`` or
      the CPU (offload), meta until materialised.
      This rank's ``torch.chunk`` piece, flattened, then zeros. A slot of the group's packed buffer
      (see [Note: Packed shards] in ``group/_gather.py``) or a tensor of its own. Built at
      ``fully_shard``; replaced by :meth:`readopt`, :meth:`adopt` and :meth:`move_into`; never freed
      while the module lives.
    - ``view``: ND, ``layout.local_shard_size``, the leading ``layout.local_numel`` elements of
      ``shard``: the sharded parameter's local tensor as fsdp2 made it.
    - ``spec``: the sharded DTensor's spec (global shape and stride, dtype, placements; see ``_tp``).
    - ``param``: the sharded ``nn.Parameter`` DTensor over ``view`` (or over whatever local tensor a
      conversion installed until :meth:`readopt` re-pads it). What the user and the optimizer see.
      Its ``.grad`` (a DTensor like it, on the shard's device) is set or added to by
      :meth:`accumulate_grad` after each reduction.
    - ``dtype``: the sharded dtype as of the last lazy init (:meth:`settle_dtype`).
    - ``grad_dtype``: the sharded parameter's ``grad_dtype`` where it differs from ``dtype`` (read
      at lazy init; copied from the original parameter at ``fully_shard``), else ``None``: gradients
      are cast to ``grad_dtype or dtype``.
    """

    def __init__(
        self,
        param: nn.Parameter,
        layout: ShardLayout,
        spec: DTensorSpec,
        device: torch.device,
        offload: bool,
        pin: bool,
        slot: torch.Tensor | None,
    ) -> None:
        """Copy this rank's piece of ``param`` (the tensor FSDP shards) into a padded shard.

        ``slot``: a zeroed 1-D buffer of ``layout.padded_shard_numel`` elements to hold the shard (a
        slot of the group's packed buffer, on the shard's device); ``None``: a tensor of its own.
        """
        self.layout, self.device, self.offload, self.pin = layout, device, offload, pin
        source = param.detach()
        if slot is None and layout.shard_dim == 0 and may_gain_hooks(source):
            # A tensor subclass (a quantized weight: NF4, float8) implements the few ops torch's
            # fully_shard uses on it, on its own shape: chunk, new_zeros, narrow, copy_, view(-1).
            shard, view = subclass_shard(source, layout)
        else:
            shard = self._plain_shard(source, slot)
            view = shard[: layout.local_numel]
        self.shard = shard
        self.view = view.view(layout.local_shard_size)
        self.spec = spec
        self.param = nn.Parameter(wrap_local(self.view, spec), requires_grad=param.requires_grad)
        mark_managed(self.param)
        self.dtype = param.dtype
        grad_dtype = param.grad_dtype
        self.grad_dtype = grad_dtype if grad_dtype not in (None, param.dtype) else None
        if self.grad_dtype is not None:  # the unsharded model's .grad dtype, kept by the shard
            self.param.grad_dtype = self.grad_dtype

    def _plain_shard(self, source: torch.Tensor, slot: torch.Tensor | None) -> torch.Tensor:
        """The padded 1-D shard of ``source``: in ``slot`` (a packed slot) or a tensor of its own."""
        layout = self.layout
        # new_zeros keeps a tensor subclass (an all-gather extension's weight type) for the local shard.
        if slot is not None:
            assert slot.numel() == layout.padded_shard_numel, "a shard slot of the wrong size"
            shard = slot
        else:
            shard = source.new_zeros(layout.padded_shard_numel)
        if source.device.type != "meta":
            if layout.shard_dim == 0:
                flat = source.reshape(-1)
                first = layout.start_row * layout.row_numel
                shard[: layout.local_numel].copy_(flat[first : first + layout.local_numel])
            else:
                piece = source.chunk(layout.world, dim=layout.shard_dim)[layout.rank]
                shard.view(layout.local_shard_size).copy_(piece)
        if self.offload and not shard.is_meta and slot is None:
            # A meta shard stays meta until materialized; readopt offloads it then.
            shard = self._offloaded(shard)
        return shard

    def settle_dtype(self) -> torch.dtype:
        """Take the sharded parameter's current dtype and ``grad_dtype`` (lazy init); return the dtype."""
        self.dtype = self.param.dtype
        grad_dtype = self.param.grad_dtype
        self.grad_dtype = grad_dtype if grad_dtype not in (None, self.dtype) else None
        return self.dtype

    def local_tensor(self) -> torch.Tensor:
        """The sharded parameter's local tensor (``view`` unless a conversion installed another)."""
        return local_of(cast(DTensor, self.param))

    def readopt(self, param: nn.Parameter) -> bool:
        """Adopt ``param`` (a DTensor), the registered sharded parameter after a module conversion.

        For ``_apply`` (``.to()``, ``.double()``, ``to_empty``) or ``load_state_dict(assign=True)``:
        re-pads its local tensor into a fresh shard when it no longer views ours. Returns whether the
        conversion materialised the shard from meta.
        """
        self.param = param
        mark_managed(param)
        self.spec = spec_of(cast(DTensor, param))
        local = local_of(cast(DTensor, param))
        layout = self.layout
        materialised = self.shard.is_meta and not local.is_meta
        to_host = self.offload and local.device.type != "cpu"
        if local is self.view and not to_host:
            pass  # still the local tensor fsdp2 made (updated in place, e.g. by an optimizer)
        elif local.is_meta:
            self.shard = local.new_zeros(layout.padded_shard_numel)
        elif not _same_memory(local, self.view) or local.dtype != self.shard.dtype or to_host:
            shard = local.detach().new_zeros(layout.padded_shard_numel)
            shard[: layout.local_numel].copy_(local.reshape(-1))
            if self.offload:  # e.g. materialized with to_empty(device="cuda"): shards live on the CPU
                shard = self._offloaded(shard)
            self.shard = shard
            self.view = shard[: layout.local_numel].view(layout.local_shard_size)
            set_local(cast(DTensor, param), self.view)
        return materialised

    def adopt(self, shard: torch.Tensor) -> None:
        """Make ``shard`` (a padded shard of this layout) the data of a new sharded parameter."""
        layout = self.layout
        assert shard.numel() == layout.padded_shard_numel, "a local shard of another layout"
        self.shard = shard
        self.view = shard[: layout.local_numel].view(layout.local_shard_size)
        self.param = nn.Parameter(wrap_local(self.view, self.spec), requires_grad=self.param.requires_grad)
        mark_managed(self.param)

    def can_move(self) -> bool:
        """Whether :meth:`move_into` can re-point the sharded parameter (see ``rebase_local``).

        Never for a shard of a tensor subclass: a packed slot would lose its class (and the all-gather
        hooks it may define by the first forward).
        """
        return not may_gain_hooks(self.local_tensor()) and sole_reference(self.param)

    def move_into(self, slot: torch.Tensor) -> None:
        """Move the shard into ``slot`` (part of a group's packed buffer); the same parameter object.

        The sharded parameter now views ``slot``, so optimizers and references taken before keep
        working; in-place updates land in the packed buffer.
        """
        layout = self.layout
        assert slot.numel() == layout.padded_shard_numel, "a packed slot of the wrong size"
        view = slot[: layout.local_numel].view(layout.local_shard_size)
        if not slot.is_meta:
            with torch.no_grad():
                slot.copy_(self.shard)
        moved = rebase_local(cast(DTensor, self.param), view)
        assert moved, "moved a shard that can_move() refused"
        self.shard = slot
        self.view = view

    def all_gather_input(self) -> torch.Tensor:
        """The shard on the compute device: a host-to-device copy under CPU offload."""
        return self.on_device(self.shard)

    def on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (the shard or its local tensor) copied to the compute device under CPU offload."""
        if self.offload and self.device.type != "cpu":
            return tensor.to(self.device, non_blocking=self.pin)
        return tensor

    def copy(self) -> torch.Tensor:
        """A copy of the padded shard (for a deep copy of the model)."""
        with torch.no_grad():
            return self.shard.detach().clone()

    def placeholder(self, tp: TPLayout | None) -> nn.Parameter:
        """A meta stand-in for the original parameter (full shape; a TP DTensor for a TP parameter)."""
        requires_grad = self.param.requires_grad
        dtype = self.param.dtype
        if tp is None:
            return nn.Parameter(torch.empty(self.param.size(), dtype=dtype, device="meta"), requires_grad)
        return tp.placeholder(self.layout.orig_size, dtype, requires_grad)

    def shard_full_tensor(self, full: torch.Tensor, tp: TPLayout | None) -> DTensor:
        """This rank's shard of ``full`` (the whole parameter) as a DTensor laid out like the parameter.

        No communication: every rank holds ``full`` and keeps its own chunk (after its TP chunk under
        tensor parallelism).
        """
        layout = self.layout
        with torch.no_grad():
            local = full.detach()
            if tp is not None:
                local = tp.local_part(local)
            if layout.shard_dim == 0:
                _, start, rows = chunk_rows(local.size(0), layout.world, layout.rank)
                local = local.narrow(0, start, rows)
            else:
                local = local.chunk(layout.world, dim=layout.shard_dim)[layout.rank]
            local = local.to(self._load_device()).contiguous()
        spec = self.spec
        meta = spec.tensor_meta
        assert meta is not None, "a sharded spec without tensor metadata"
        return wrap_local(local, make_spec(spec.mesh, spec.placements, meta.shape, meta.stride, full.dtype))

    def accumulate_grad(self, local_grad: torch.Tensor) -> bool:
        """Set, or add in place into, the sharded DTensor gradient; then run post-accumulate hooks.

        Returns whether a non-blocking device-to-host copy is still in flight (CPU offload): the caller
        must synchronize before the optimizer reads the gradient.
        """
        param = self.param
        dtype = self.grad_dtype or self.dtype
        if local_grad.dtype != dtype:
            local_grad = local_grad.to(dtype)
        hooks = param._post_accumulate_grad_hooks  # noqa: SLF001 - no public accessor
        in_flight = False
        if self.offload and local_grad.device.type != "cpu":
            # Only a fresh gradient without hooks may arrive asynchronously: an in-place add or a
            # hook would read the host copy before it lands.
            in_flight = self.pin and param.grad is None and not hooks
            local_grad = local_grad.to("cpu", non_blocking=in_flight)
        grad = param.grad
        if grad is None:
            param.grad = wrap_local(local_grad, self.spec)
        else:
            local_of(cast(DTensor, grad)).add_(local_grad)
        # Autograd never accumulates into the sharded parameter, so its hooks are ours to run.
        if hooks:
            for hook in tuple(hooks.values()):
                hook(param)
        return in_flight

    def _load_device(self) -> torch.device:
        """Where a loaded shard goes: the current shard's device, or for a meta shard where it will live."""
        device = self.param.device
        if device.type != "meta":
            return device
        return torch.device("cpu") if self.offload else self.device

    def _offloaded(self, shard: torch.Tensor) -> torch.Tensor:
        """``shard`` on the CPU, pinned where pinning is possible and asked for."""
        shard = shard.cpu()
        return shard.pin_memory() if self.pin and not shard.is_pinned() else shard


_MANAGED = "_fsdp2_managed"


def mark_managed(param: torch.Tensor) -> None:
    """Tag a sharded parameter fsdp2 registered (an attribute: tensors cannot be weak-set members)."""
    param.__dict__[_MANAGED] = True


def is_managed(param: torch.Tensor) -> bool:
    """Whether ``fully_shard`` sharded this parameter (rooms above the engine ask, e.g. local steps)."""
    return param.__dict__.get(_MANAGED, False) is True


def subclass_shard(source: torch.Tensor, layout: ShardLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """``(shard, local)`` of a tensor subclass sharded on dim 0, built with its own ops.

    ``shard``: the padded shard flattened (``view(-1)``), the all-gather source; ``local``: its
    leading rows at this rank's shape. The ops are those torch's ``fully_shard`` calls on a weight
    subclass (``chunk``, ``new_zeros`` of the padded rows, ``narrow``, ``copy_``, ``view(-1)``), so a
    weight type written for it (torchao's ``NF4Tensor``) shards here too; one that lacks an op
    raises ``NotImplementedError`` or its own error, which ``fully_shard`` names.
    """
    padded_rows = layout.padded_shard_numel // layout.row_numel if layout.row_numel else 0
    rows = layout.local_shard_size[0]
    padded = source.new_zeros((padded_rows, *layout.orig_size[1:]))
    if source.device.type != "meta" and rows:
        piece = source.chunk(layout.world, dim=0)[layout.rank]
        with torch.no_grad():
            (padded if rows == padded_rows else padded.narrow(0, 0, rows)).copy_(piece)
    local = padded if rows == padded_rows else padded.narrow(0, 0, rows)
    return padded.view(-1), local


def check_subclass_shardable(param: torch.Tensor, name: str, world: int, rank: int) -> None:
    """Refuse, before ``fully_shard`` changes anything, a weight subclass it cannot shard on dim 0.

    Builds (and drops) this rank's shard with the subclass's own ops, as ``PaddedShard`` will.

    Raises:
        NotImplementedError: an op the subclass lacks for this shape, naming the parameter.
    """
    source = param.detach()
    if source.device.type == "meta" or not may_gain_hooks(source):
        return
    layout = ShardLayout.of(source, 0, world, rank)
    try:
        subclass_shard(source, layout)
    except Exception as error:  # the subclass's own error type: NotImplementedError, AssertionError...
        kind = type(source).__name__
        raise NotImplementedError(
            f"fully_shard cannot shard parameter {name}: its {kind} of shape {tuple(source.shape)} failed "
            f"an op of sharding over {world} ranks ({type(error).__name__}: {error}). fully_shard builds "
            f"each rank's dim-0 shard with the tensor's own ops, as torch's fully_shard does: chunk, "
            f"new_zeros, narrow, copy_ and view(-1). Give the weight a shape {kind} supports for them "
            "(e.g. rows divisible by the shard world size, in whole quantization blocks), implement the "
            "missing op, or keep the parameter out of sharding (ignored_params)."
        ) from error


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` view the same elements of the same storage (aliases of each other).

    Not merely the same storage: a group's packed shards share one storage, one region per parameter.
    """
    return (
        a.device == b.device
        and _storage_key(a) == _storage_key(b)
        and a.storage_offset() == b.storage_offset()
        and a.size() == b.size()
        and a.stride() == b.stride()
    )


def _storage_key(tensor: torch.Tensor) -> int:
    """Identity of ``tensor``'s storage (not its data pointer: fake tensors have none).

    A wrapper subclass answers with its first inner tensor.
    """
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return _storage_key(getattr(tensor, names[0]))
    return int(tensor.untyped_storage()._cdata)  # noqa: SLF001 - the StorageImpl's address
