"""One managed parameter and the tensors FSDP keeps for it.

Owns: the dim-0 chunk and padding math, the padded local shard, the sharded DTensor parameter, the
unsharded parameter and its all-gather output storage, the post-forward slice, and swapping which of
them is registered on the owning modules. Does not own: communication (``_collectives``) or deciding
when to swap (``FSDPParamGroup``).

[Note: FSDP tensors]
- *original parameter*: the ``nn.Parameter`` on the module when ``fully_shard`` is called.
- *local shard*: a 1-D tensor of ``padded_shard_numel`` elements holding this rank's rows of the
  original parameter, ``torch.chunk`` style, zero-padded to the size of chunk 0. Every rank therefore
  contributes the same number of elements to the all-gather. Usually a slot of the group's packed
  buffer (``shard_slot``; see [Note: Packed shards] in ``_param_group``), else a tensor of its own.
- *sharded parameter*: an ``nn.Parameter`` DTensor (``Shard(0)``) whose local tensor is a view of the
  leading, unpadded part of the local shard. In-place updates (optimizer steps, ``load_state_dict``)
  write straight into the all-gather source.
- *all-gather input / output*: the group's packed buffer itself, or the local shard (or post-forward
  slice) copied into one flat buffer per group / ``unsharded_flat``, ``world_size *
  padded_shard_numel`` elements: a part of the group's unsharded buffer (``bind_unsharded_storage``)
  or, for ``Shard(d > 0)`` and extension parameters, a buffer of its own.
- *unsharded parameter*: a plain ``nn.Parameter`` viewing the front of ``unsharded_flat`` at the original
  shape. Created once and kept for the life of the module, because autograd may have saved it.

[Note: Storage resize instead of reallocation]
Resharding frees the unsharded parameter's memory by resizing its storage to zero bytes; unsharding
resizes it back and refills it (the group does so for its whole buffer where its parameters share
one). Tensor objects, views and autograd's saved references stay valid, and the refill goes through a
``.data`` alias so the version counter does not move (a saved parameter refilled for backward would
otherwise fail autograd's in-place check).
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ._api import CPUOffloadPolicy, OffloadPolicy
from ._autograd import preserve_version_counter
from ._collectives import contiguous_strides
from ._config import ParamSpec
from ._dtensor import (
    local_of,
    make_spec,
    spec_of,
    wrap_local,
)
from ._extension import (
    ExtensionRecord,
    call_post_all_gather,
    call_pre_all_gather,
    check_hooks_unchanged,
    defines_hooks,
    may_gain_hooks,
    padded_rule_holds,
)
from ._late_params import quiet_registrations
from ._layout import ShardLayout, chunk_rows, padded_shard_numel
from ._mesh import MeshInfo
from ._shard import LocalShard, is_managed, mark_managed
from ._tp import TPLayout, sharded_spec

__all__ = ["FSDPParam", "can_pin", "chunk_rows", "is_managed", "mark_managed", "padded_shard_numel"]


class FSDPParam:
    """One parameter sharded on dim 0 across ``mesh_info.shard_size`` ranks. See [Note: FSDP tensors]."""

    def __init__(
        self,
        spec: ParamSpec,
        mesh_info: MeshInfo,
        post_forward_mesh_info: MeshInfo | None,
        device: torch.device,
        offload: OffloadPolicy | None = None,
        shard_slot: torch.Tensor | None = None,
    ) -> None:
        """Lay out ``spec``'s parameter as a local shard and register the sharded DTensor.

        ``shard_slot``: a zeroed 1-D buffer of :func:`padded_shard_numel` elements where the local
        shard lives (a slot of the group's packed buffer, on the shard's device); ``None``: its own.
        """
        param, owners, shard_dim = spec.param, spec.owners, spec.shard_dim
        self.owners = owners  # every (module, attribute) the parameter is registered under
        self.source_id = _source_id(param)  # identifies the original tensor across fully_shard calls
        self.fqn = owners[0][1]  # replaced by the root-relative name at lazy init
        self.mesh_info = mesh_info
        self.post_forward_mesh_info = post_forward_mesh_info
        # Tensor parallel: the parameter is a DTensor on a TP mesh; FSDP shards its local tensor, and the
        # unsharded parameter is a DTensor with the TP spec again. See [Note: Tensor parallel].
        self._tp = TPLayout(spec_of(param), spec.dp_dims) if isinstance(param, DTensor) else None
        spec_ = sharded_spec(spec, self._tp, mesh_info, param.dtype)
        if isinstance(param, DTensor):
            param = nn.Parameter(local_of(param), requires_grad=param.requires_grad)
        world, rank = mesh_info.shard_size, mesh_info.shard_rank
        layout = ShardLayout.of(param, shard_dim, world, rank)
        self._layout = layout
        self.orig_size = layout.orig_size  # of the tensor FSDP shards: the TP-local tensor under TP
        self.orig_numel = layout.orig_numel
        self.orig_stride = layout.orig_stride
        self.row_numel = layout.row_numel
        self.padded_shard_numel = layout.padded_shard_numel
        self.local_shard_size = layout.local_shard_size
        self.local_numel = layout.local_numel
        self.unevenly_sharded = layout.unevenly_sharded  # some rank's dim-0 shard is padded
        self.smallest_shard_numel = layout.smallest_shard_numel  # the fewest real elements of any rank
        self._fast_register = all(type(m).__setattr__ is nn.Module.__setattr__ for m, _ in owners)
        self.device = device  # compute device: where all-gather outputs and unsharded params live
        self.shard_dim = shard_dim
        self.offload_to_cpu = isinstance(offload, CPUOffloadPolicy)
        self._pin_memory = self.offload_to_cpu and can_pin(offload)
        self._shard = LocalShard(
            param, layout, spec_, device, self.offload_to_cpu, self._pin_memory, shard_slot
        )
        local = self._shard.view
        # all-gather extension (see [Note: All-gather extension]); re-detected at lazy init
        self._extension = ExtensionRecord() if defines_hooks(local, self.fqn) else None
        self._may_gain_hooks = may_gain_hooks(local)  # a weight subclass: checked at every all-gather
        self._mp_policy: Any = None
        self._extension_outputs: list[torch.Tensor] = []  # 1D, one per all-gather input
        self._extension_nbytes: list[int] = []  # storage sizes of those outputs, then of inner tensors
        self.extension_rule_ok = True  # the last pre-hook call kept the padded-size rule
        self.orig_dtype = param.dtype
        self.param_dtype: torch.dtype | None = None  # set by init_dtypes at lazy init
        self.reduce_dtype: torch.dtype | None = None
        # 1D, world_size * padded_shard_numel, unsharded dtype; allocated at the first unshard
        self._unsharded_flat: torch.Tensor | None = None
        self._unsharded_flat_data: torch.Tensor | None = None  # .data alias: refills keep the version
        self._unsharded_nbytes = 0
        self._unsharded_full: torch.Tensor | None = None  # ND, Shard(d > 0) only: the parameter storage
        self._unsharded_full_nbytes = 0
        self._shared_storage = False  # _unsharded_flat views a group buffer that the group resizes
        self.unsharded_param: nn.Parameter | None = None  # ND, original shape, reused every step
        self._accumulated_grad: torch.Tensor | None = None  # ND, reduce_dtype, no-sync accumulation
        # 1D, (shard_size / k) * padded_shard_numel; only between forward and backward with an int k
        self._post_forward_slice: torch.Tensor | None = None
        # Materialised from meta since the last first-unshard check (see _init.warn_if_repeated_shards).
        self.from_meta = False
        self._register(self._shard.param)

    # ---- set-up --------------------------------------------------------------------------------

    def init_dtypes(self, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> None:
        """Resolve mixed precision against the current sharded dtype (lazy init)."""
        self.orig_dtype = self.sharded_param.dtype
        if param_dtype == self.orig_dtype or not self.orig_dtype.is_floating_point:
            param_dtype = None
        self.param_dtype = param_dtype
        self.reduce_dtype = None if reduce_dtype == (param_dtype or self.orig_dtype) else reduce_dtype
        flat = self._unsharded_flat
        if flat is not None and flat.dtype != self.unsharded_dtype:
            self.drop_unsharded()  # converted since the last unshard (e.g. model.double()): rebuild

    def init_extension(self, mp_policy: Any) -> None:
        """Re-detect the all-gather extension on the local tensor (lazy init); keep the policy for it."""
        local = self._sharded_local()
        found = defines_hooks(local, self.fqn)
        self._may_gain_hooks = may_gain_hooks(local)
        if found and self._extension is None:
            self._extension = ExtensionRecord()
        elif not found:
            self._extension = None
        self._mp_policy = mp_policy

    def _sharded_local(self) -> torch.Tensor:
        return self._shard.local_tensor()

    @property
    def sharded_param(self) -> nn.Parameter:
        """The sharded DTensor parameter (the one registered between steps)."""
        return self._shard.param

    @property
    def is_tensor_parallel(self) -> bool:
        return self._tp is not None

    @property
    def has_extension(self) -> bool:
        return self._extension is not None

    @property
    def unsharded_dtype(self) -> torch.dtype:
        return self.param_dtype or self.orig_dtype

    def reset_sharded_param(self) -> None:
        """Re-adopt the registered sharded parameter after ``_apply``/``load_state_dict(assign=True)``.

        Re-pads its local tensor into a fresh local shard when it no longer views ours.
        """
        module, name = self.owners[0]
        param = module._parameters[name]  # noqa: SLF001 - the registered object, whatever its type
        if not isinstance(param, DTensor):
            raise RuntimeError(
                f"Parameter {self.fqn} is no longer a DTensor after a module conversion: expected the "
                f"sharded DTensor, got {type(param).__name__}. Load sharded (DTensor) state dicts into "
                "fully_shard modules, or use torch.distributed.checkpoint.state_dict helpers."
            )
        self.from_meta = self._shard.readopt(param) or self.from_meta
        self._register(param)

    def placeholder(self) -> nn.Parameter:
        """A meta stand-in for the original parameter (full shape; a TP DTensor for a TP parameter).

        ``fully_shard`` on it builds this parameter's layout again (used to deep-copy a model).
        """
        return self._shard.placeholder(self._tp)

    def local_shard_copy(self) -> torch.Tensor:
        """A copy of the padded local shard (for a deep copy of the model)."""
        return self._shard.copy()

    def can_move_shard(self) -> bool:
        """Whether :meth:`move_shard_into` can re-point the sharded parameter (see ``rebase_local``).

        Never for a shard of a tensor subclass: a packed slot would lose its class (and the all-gather
        hooks it may define by the first forward).
        """
        return self._shard.can_move()

    def move_shard_into(self, view: torch.Tensor) -> None:
        """Move the padded local shard into ``view`` (part of a group's packed buffer); same parameter.

        The sharded parameter stays the same object and now views ``view``, so optimizers and
        references taken before keep working; in-place updates land in the packed buffer.
        """
        self._shard.move_into(view)

    def holds_shard(self, view: torch.Tensor) -> bool:
        """Whether ``view`` is (still) this parameter's padded local shard."""
        return self._shard.shard is view

    @property
    def shard_dtype(self) -> torch.dtype:
        return self._shard.shard.dtype

    @property
    def shard_device(self) -> torch.device:
        return self._shard.shard.device

    def adopt_local_shard(self, shard: torch.Tensor) -> None:
        """Make ``shard`` (a padded local shard of this parameter's layout) the sharded parameter's data."""
        self._shard.adopt(shard)
        self._register(self._shard.param)

    @property
    def global_size(self) -> torch.Size:
        """The parameter's full (unsharded, un-tensor-parallel) shape: what a full state dict holds."""
        return self._shard.param.size()

    def shard_full_tensor(self, full: torch.Tensor) -> DTensor:
        """This rank's shard of ``full`` (the whole parameter) as a DTensor laid out like the parameter.

        No communication: every rank holds ``full`` and keeps its own chunk (after its TP chunk under
        tensor parallelism). The caller checks that ``full`` has :attr:`global_size`.
        """
        return self._shard.shard_full_tensor(full, self._tp)

    # ---- all-gather inputs and outputs -------------------------------------------------------------

    def all_gather_inputs(self, post_forward: bool) -> list[torch.Tensor]:
        """The 1-D tensors this rank contributes: the shard, or an extension's pre-hook outputs."""
        record = self._extension
        if record is None:
            return [self.all_gather_input(post_forward)]
        local = self._sharded_local()
        check_hooks_unchanged(local, self.fqn, had_hooks=True)
        local = self._shard.on_device(local)
        info = self.mesh_info
        shard_mesh = info.mesh if info.mesh.ndim == 1 else info.mesh[info.mesh.mesh_dim_names[1]]  # type: ignore[index]  # reason: HSDP meshes have names
        inputs, record.metadata = call_pre_all_gather(
            local,
            shard_mesh,
            self.orig_size,
            contiguous_strides(self.orig_size),
            self.owners[0][0],
            self._mp_policy,
            self.fqn,
        )
        padded_rows = self.padded_shard_numel // self.row_numel if self.row_numel else 0
        self.extension_rule_ok = not self.unevenly_sharded or padded_rule_holds(inputs, padded_rows)
        record.input_sizes = [t.size() for t in inputs]
        record.input_dtypes = [t.dtype for t in inputs]
        return [t.reshape(-1) for t in inputs]

    def all_gather_outputs(self) -> list[torch.Tensor]:
        """The per-input output buffers (``W *`` each input's numel), allocated or re-allocated."""
        record = self._extension
        if record is None:
            return [self.all_gather_output()]
        if not self._extension_outputs:
            world = self.mesh_info.shard_size
            self._extension_outputs = [
                torch.empty(world * size.numel(), dtype=dtype, device=self.device)
                for size, dtype in zip(record.input_sizes, record.input_dtypes, strict=True)
            ]
            self._extension_nbytes = [o.untyped_storage().nbytes() for o in self._extension_outputs]
        for output, nbytes in zip(self._extension_outputs, self._extension_nbytes, strict=False):
            if output.untyped_storage().nbytes() == 0:
                output.untyped_storage().resize_(nbytes)
        return self._extension_outputs

    def all_gather_input(self, post_forward: bool) -> torch.Tensor:
        """The 1-D tensor this rank contributes (cast to the unsharded dtype by the copy-in)."""
        if self._may_gain_hooks:
            check_hooks_unchanged(self._sharded_local(), self.fqn, had_hooks=False)
        if post_forward:
            assert self._post_forward_slice is not None, f"{self.fqn}: no post-forward slice to gather"
            return self._post_forward_slice
        shard = self._shard
        return shard.all_gather_input() if self.offload_to_cpu else shard.shard

    def all_gather_output(self) -> torch.Tensor:
        """The per-parameter output buffer, allocated or re-allocated as needed (``.data`` alias).

        For ``Shard(0)`` it is the unsharded parameter's own storage (rank blocks are consecutive
        rows); for ``Shard(d > 0)`` it is a staging buffer that ``finish_unshard`` rearranges.
        """
        data = self._unsharded_flat_data
        if data is None:
            numel = self.mesh_info.shard_size * self.padded_shard_numel
            flat = torch.empty(numel, dtype=self.unsharded_dtype, device=self.device)
            data = flat.data
            self._adopt_unsharded_flat(flat, data)
            self._unsharded_nbytes = flat.untyped_storage().nbytes()
        elif not self._shared_storage and data.untyped_storage().nbytes() == 0:
            data.untyped_storage().resize_(self._unsharded_nbytes)
            if self._unsharded_full is not None:
                self._unsharded_full.untyped_storage().resize_(self._unsharded_full_nbytes)
        return data

    def bind_unsharded_storage(self, flat: torch.Tensor, data: torch.Tensor) -> None:
        """Use ``flat`` (1-D, ``W * padded_shard_numel``, a view into a group's buffer) as the output.

        ``data`` is ``flat``'s ``.data`` alias. The group allocates and frees that storage for all its
        parameters at once; this parameter never resizes it. ``Shard(0)`` without extension only.
        """
        assert self.shard_dim == 0, f"{self.fqn}: a Shard(d > 0) parameter cannot share a group buffer"
        assert self._extension is None, f"{self.fqn}: an extension parameter cannot share a group buffer"
        assert flat.numel() == self.mesh_info.shard_size * self.padded_shard_numel, f"{self.fqn}: wrong size"
        self._adopt_unsharded_flat(flat, data)
        self._shared_storage = True

    def _adopt_unsharded_flat(self, flat: torch.Tensor, data: torch.Tensor) -> None:
        """Make ``flat`` the all-gather output and build the unsharded parameter over it."""
        self._unsharded_flat = flat
        self._unsharded_flat_data = data
        if self.shard_dim == 0:
            view = flat[: self.orig_numel].view(self.orig_size)
        else:
            full = torch.empty(self.orig_size, dtype=self.unsharded_dtype, device=self.device)
            self._unsharded_full = full
            self._unsharded_full_nbytes = full.untyped_storage().nbytes()
            view = full
        if self._tp is not None:
            view = wrap_local(view, self._tp.unsharded_spec(self.unsharded_dtype))
        self.unsharded_param = nn.Parameter(view, requires_grad=self.sharded_param.requires_grad)

    def drop_unsharded(self) -> None:
        """Forget the unsharded buffers and parameter (sharded state only): the next unshard rebuilds them.

        For a change of the unsharded dtype or layout between steps (``model.double()``).
        """
        self._unsharded_flat = self._unsharded_flat_data = self._unsharded_full = None
        self.unsharded_param = None
        self._shared_storage = False
        self._post_forward_slice = None

    def registration_slots(self, unsharded: bool) -> list[tuple[dict[str, Any], str, torch.Tensor]] | None:
        """``(module._parameters, name, tensor)`` entries registering the sharded or unsharded form.

        ``None`` where an owner customises ``__setattr__`` (then register one by one).
        """
        if not self._fast_register:
            return None
        tensor = self.unsharded_param if unsharded else self.sharded_param
        assert tensor is not None, f"{self.fqn}: no unsharded parameter yet"
        return [(module._parameters, name, tensor) for module, name in self.owners]  # noqa: SLF001 - see _register

    def finish_unshard(self) -> None:
        """After copy-out: run the extension's post hook, or (``Shard(d > 0)``) concatenate rank blocks."""
        if self._extension is not None:
            self._finish_extension_unshard(self._extension)
            return
        staging, full = self._unsharded_flat_data, self._unsharded_full
        assert staging is not None, f"{self.fqn}: finish_unshard before an all-gather"
        assert full is not None, f"{self.fqn}: finish_unshard on a dim-0 sharded parameter"
        blocks = staging.view(self.mesh_info.shard_size, *self.local_shard_size).unbind(0)
        torch.cat(blocks, dim=self.shard_dim, out=full.data)

    def _finish_extension_unshard(self, record: ExtensionRecord) -> None:
        local = self._sharded_local()
        outputs = self._extension_outputs
        param = self.unsharded_param
        if param is None:
            result = call_post_all_gather(local, outputs, record, self.unsharded_dtype, None)
            assert result is not None, f"{self.fqn}: the post hook returned nothing"
            unsharded, record.inner_tensors = result
            self._extension_nbytes = self._extension_nbytes[: len(outputs)] + [
                t.untyped_storage().nbytes() for t in record.inner_tensors
            ]
            view = torch.as_strided(unsharded, self.orig_size, contiguous_strides(self.orig_size), 0)
            self.unsharded_param = nn.Parameter(view, requires_grad=self.sharded_param.requires_grad)
            return
        for tensor, nbytes in zip(record.inner_tensors, self._extension_nbytes[len(outputs) :], strict=True):
            if tensor.untyped_storage().nbytes() == 0:
                tensor.untyped_storage().resize_(nbytes)
        with preserve_version_counter(param):  # a refill, as for plain parameters
            call_post_all_gather(local, outputs, record, self.unsharded_dtype, param)

    def zero_unsharded_grad(self) -> torch.Tensor:
        """A zero gradient of the unsharded shape (a parameter this rank did not use in backward)."""
        return torch.zeros(self.orig_size, dtype=self.unsharded_dtype, device=self.device)

    def empty_local_grad(self) -> torch.Tensor:
        """The (zero-element) local gradient of a parameter whose shard holds no elements."""
        return torch.zeros(self.local_shard_size, dtype=self.orig_dtype, device=self.device)

    def dim0_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """``Shard(d > 0)``: the gradient rearranged so rank ``j``'s piece is the ``j``-th dim-0 chunk."""
        return torch.stack(grad.chunk(self.mesh_info.shard_size, dim=self.shard_dim))

    # ---- registered-state transitions -------------------------------------------------------------

    def to_sharded(self) -> None:
        self._register(self.sharded_param)
        self.free_unsharded()
        self._post_forward_slice = None

    def to_unsharded(self) -> None:
        param = self.unsharded_param
        assert param is not None, f"{self.fqn}: to_unsharded before any all-gather"
        requires_grad = self.sharded_param.requires_grad
        if param.requires_grad != requires_grad:
            param.requires_grad_(requires_grad)
        self._register(param)
        self._post_forward_slice = None

    def to_sharded_post_forward(self) -> None:
        """Keep this rank's 1/k slice of the padded unsharded data; register a placeholder DTensor."""
        info = self.post_forward_mesh_info
        assert info is not None, f"{self.fqn}: no post-forward mesh"
        assert self._unsharded_flat is not None, f"{self.fqn}: post-forward reshard before any unshard"
        per_rank = (self.mesh_info.shard_size // info.shard_size) * self.padded_shard_numel
        start = info.shard_rank * per_rank
        self._post_forward_slice = self._unsharded_flat.detach()[start : start + per_rank].clone()
        _, _, rows = chunk_rows(self.orig_size[0], info.shard_size, info.shard_rank)
        local = self._post_forward_slice[: rows * self.row_numel].view(rows, *self.orig_size[1:])
        spec = make_spec(
            info.mesh, (Replicate(), Shard(0)), self.orig_size, self.orig_stride, self.unsharded_dtype
        )
        self._register(nn.Parameter(wrap_local(local, spec), requires_grad=False))
        self.free_unsharded()

    def unsharded_tensors(self) -> list[torch.Tensor]:
        """The tensors this parameter keeps for its unsharded forms (some may be freed: size 0)."""
        held = [self._unsharded_flat_data, self._unsharded_full, self._post_forward_slice]
        if self._extension is not None:
            held += [*self._extension_outputs, *self._extension.inner_tensors]
        return [t for t in held if t is not None]

    def free_unsharded(self) -> None:
        if self._extension is not None:
            for tensor in (*self._extension_outputs, *self._extension.inner_tensors):
                tensor.untyped_storage().resize_(0)
        if self._unsharded_flat_data is not None and not self._shared_storage:
            self._unsharded_flat_data.untyped_storage().resize_(0)
        if self._unsharded_full is not None:
            self._unsharded_full.untyped_storage().resize_(0)

    def _register(self, tensor: torch.Tensor) -> None:
        if self._fast_register:
            # Hot path: nn.Module.__setattr__ re-checks types and dicts on every call (several µs);
            # for modules that do not customise it, writing the dict entry is the same operation.
            for module, name in self.owners:
                module._parameters[name] = tensor  # type: ignore[assignment]  # noqa: SLF001 - Parameter or DTensor
        else:
            with quiet_registrations():
                for module, name in self.owners:
                    setattr(module, name, tensor)

    # ---- gradients ---------------------------------------------------------------------------------

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """Detach and return this step's unsharded gradient, including no-sync accumulation."""
        param = self.unsharded_param
        if param is None:
            return None
        grad = param.grad
        if grad is not None:
            param.grad = None
            if isinstance(grad, DTensor):
                tp = self._tp
                assert tp is not None, f"{self.fqn}: a DTensor gradient, not tensor parallel"
                grad = tp.local_grad(grad)
        accumulated = self._accumulated_grad
        if accumulated is None:
            return grad
        self._accumulated_grad = None
        if grad is not None:
            accumulated.add_(grad)
        return accumulated

    def holds_unsharded_grad(self) -> bool:
        """Whether a gradient waits here for a reduction (no-sync accumulation)."""
        param = self.unsharded_param
        return self._accumulated_grad is not None or (param is not None and param.grad is not None)

    def stash_unsharded_grad(self) -> None:
        """No-sync step: move the gradient into a ``reduce_dtype`` accumulator when one is set."""
        param = self.unsharded_param
        reduce_dtype = self.reduce_dtype
        if param is None or reduce_dtype is None or param.grad is None or param.grad.dtype == reduce_dtype:
            return
        grad = param.grad
        param.grad = None
        if isinstance(grad, DTensor):
            tp = self._tp
            assert tp is not None, f"{self.fqn}: a DTensor gradient, not tensor parallel"
            grad = tp.local_grad(grad)
        if self._accumulated_grad is None:
            self._accumulated_grad = grad.to(reduce_dtype)
        else:
            self._accumulated_grad.add_(grad)

    def accumulate_sharded_grad(self, local_grad: torch.Tensor) -> bool:
        """Set, or add in place into, the sharded DTensor gradient; then run post-accumulate hooks.

        Returns whether a non-blocking device-to-host copy is still in flight (CPU offload): the caller
        must synchronize before the optimizer reads the gradient.
        """
        param = self._shard.param
        if local_grad.dtype != self.orig_dtype:
            local_grad = local_grad.to(self.orig_dtype)
        hooks = param._post_accumulate_grad_hooks  # noqa: SLF001 - no public accessor
        in_flight = False
        if self.offload_to_cpu and local_grad.device.type != "cpu":
            # Only a fresh gradient without hooks may arrive asynchronously: an in-place add or a
            # hook would read the host copy before it lands.
            in_flight = self._pin_memory and param.grad is None and not hooks
            local_grad = local_grad.to("cpu", non_blocking=in_flight)
        grad = param.grad
        if grad is None:
            param.grad = wrap_local(local_grad, self._shard.spec)
        else:
            local_of(cast(DTensor, grad)).add_(local_grad)
        # Autograd never accumulates into the sharded parameter, so its hooks are ours to run.
        if hooks:
            for hook in tuple(hooks.values()):
                hook(param)
        return in_flight


_warned_no_pinning = False


def can_pin(policy: OffloadPolicy | None) -> bool:
    """Whether to pin offloaded shards: asked for, and possible (pinning needs an accelerator)."""
    global _warned_no_pinning
    if not getattr(policy, "pin_memory", False):
        return False
    if torch.cuda.is_available():
        return True
    if not _warned_no_pinning:
        _warned_no_pinning = True
        warnings.warn(
            "CPUOffloadPolicy(pin_memory=True): this machine has no accelerator, so there is no pinned "
            "memory; fsdp2 keeps the offloaded shards in ordinary CPU memory. Pass pin_memory=False to "
            "silence this warning.",
            stacklevel=5,
        )
    return False


_source_ids = itertools.count()


def _source_id(param: nn.Parameter) -> int:
    """A process-unique id stamped on the original parameter (``id()`` may be reused after free)."""
    source: int | None = param.__dict__.get("_fsdp2_source_id")
    if source is None:
        source = param.__dict__["_fsdp2_source_id"] = next(_source_ids)
    return source
