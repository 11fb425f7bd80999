"""One managed parameter: the facade over the tensors FSDP keeps for it.

Owns: ``FSDPParam``: a parameter's identity (name, owner modules, source), its sizes and dtypes,
which of its forms is registered on the owner modules, and the interface the group and the reducer
call (all-gather inputs and outputs, gradient hand-off). The tensors, and the work on them, belong to
its parts, each in its own module:

- ``ShardLayout`` (``_layout``): the sizes of the sharding (chunk rows, padding, this rank's piece);
- ``LocalShard`` (``_shard``): the padded local shard, the sharded DTensor parameter and its gradient;
- ``UnshardedParam`` (``_unsharded``): the all-gather output, the unsharded parameter and its
  gradient (no-sync accumulation included), the post-forward slice;
- ``ExtensionGather`` (``_extension_gather``): an all-gather extension parameter's gathered tensors;
- ``TPLayout`` (``_tp``): the DTensor layouts a tensor-parallel parameter adds.

Data flows down only: ``FSDPParam`` calls its parts, the parts never call it. Does not own:
communication (``_collectives``) or deciding when to swap forms (``FSDPParamGroup``).

[Note: FSDP tensors]
- *original parameter*: the ``nn.Parameter`` on the module when ``fully_shard`` is called.
- *local shard* (``LocalShard.shard``): a 1-D tensor of ``padded_shard_numel`` elements holding this
  rank's rows of the original parameter, ``torch.chunk`` style, zero-padded to the size of chunk 0.
  Every rank therefore contributes the same number of elements to the all-gather. Usually a slot of
  the group's packed buffer (``shard_slot``; see [Note: Packed shards] in ``group/_gather.py``), else a
  tensor of its own.
- *sharded parameter* (``LocalShard.param``): an ``nn.Parameter`` DTensor (``Shard(0)``) whose local
  tensor is a view of the leading, unpadded part of the local shard. In-place updates (optimizer
  steps, ``load_state_dict``) write straight into the all-gather source.
- *all-gather input / output*: the group's packed buffer itself, or the local shard (or post-forward
  slice) copied into one flat buffer per group / ``UnshardedParam.flat``, ``world_size *
  padded_shard_numel`` elements: a part of the group's unsharded buffer (``bind_unsharded_storage``)
  or, for ``Shard(d > 0)`` and extension parameters, a buffer of its own (``ExtensionGather.outputs``
  for an extension parameter).
- *unsharded parameter* (``UnshardedParam.param``): a plain ``nn.Parameter`` viewing the front of
  ``UnshardedParam.flat`` at the original shape. Created once and kept for the life of the module,
  because autograd may have saved it. Its storage is freed and regrown in place (see [Note: Storage
  resize instead of reallocation] in ``_unsharded``).
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..base._api import CPUOffloadPolicy, OffloadPolicy
from ..base._config import ParamSpec
from ..base._mesh import MeshInfo
from ._dtensor import local_of, spec_of
from ._extension import check_hooks_unchanged, defines_hooks, may_gain_hooks
from ._extension_gather import ExtensionGather, redetect
from ._late_params import quiet_registrations
from ._layout import ShardLayout, chunk_rows, padded_shard_numel
from ._shard import LocalShard, is_managed, mark_managed
from ._tp import TPLayout, sharded_spec
from ._unsharded import UnshardedParam

__all__ = ["FSDPParam", "can_pin", "chunk_rows", "is_managed", "mark_managed", "padded_shard_numel"]


class FSDPParam:
    """One parameter sharded across ``mesh_info.shard_size`` ranks. See [Note: FSDP tensors].

    Fields:
    - ``owners``: every ``(module, attribute)`` the parameter is registered under (fixed).
    - ``source_id``: identifies the original tensor across ``fully_shard`` calls (fixed).
    - ``fqn``: the parameter's name; the root-relative name from lazy init on.
    - ``mesh_info`` / ``post_forward_mesh_info``: the shard mesh, and the mesh of the post-forward
      reshard (``reshard_after_forward=k``; set by the group).
    - ``device``: the compute device (where all-gather outputs and unsharded parameters live).
    - ``offload_to_cpu``: CPU offload: shards and their gradients live on the CPU.
    - sizes, plain copies of the ``ShardLayout``'s (fixed; read per step): ``shard_dim``,
      ``orig_size``, ``orig_stride``, ``orig_numel``, ``row_numel``, ``padded_shard_numel``,
      ``local_shard_size``, ``local_numel``, ``unevenly_sharded``, ``smallest_shard_numel``.
    - ``orig_dtype`` / ``param_dtype`` / ``reduce_dtype``: the sharded dtype and mixed precision
      (resolved by :meth:`init_dtypes` at lazy init; ``None``: no cast).
    - ``from_meta``: materialised from meta since the group's last first-unshard check.
    - per-step methods bound to the part that does the work (no call layer per step):
      ``all_gather_output``, ``take_unsharded_grad``, ``stash_unsharded_grad``,
      ``holds_unsharded_grad`` (``UnshardedParam``), ``accumulate_sharded_grad`` (``LocalShard``).
    - ``sharded_param`` / ``_local_shard``: the ``LocalShard``'s parameter and padded shard, cached
      for per-step reads; refreshed whenever a call into the ``LocalShard`` may have replaced them.
    - parts: ``_shard`` (``LocalShard``), ``_unsharded`` (``UnshardedParam``), ``_tp`` (``TPLayout``
      or ``None``), ``_extension`` (``ExtensionGather`` or ``None``; re-detected at lazy init).
    """

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
        param, owners = spec.param, spec.owners
        self.owners = owners
        self.source_id = _source_id(param)
        self.fqn = owners[0][1]
        self.mesh_info = mesh_info
        self.post_forward_mesh_info = post_forward_mesh_info
        self.device = device
        self.offload_to_cpu = offload_to_cpu = isinstance(offload, CPUOffloadPolicy)
        self._fast_register = all(type(m).__setattr__ is nn.Module.__setattr__ for m, _ in owners)
        # Tensor parallel: FSDP shards the DTensor's local tensor. See [Note: Tensor parallel].
        self._tp = TPLayout(spec_of(param), spec.dp_dims) if isinstance(param, DTensor) else None
        shard_spec = sharded_spec(spec, self._tp, mesh_info, param.dtype)
        if isinstance(param, DTensor):
            param = nn.Parameter(local_of(param), requires_grad=param.requires_grad)
        layout = ShardLayout.of(param, spec.shard_dim, mesh_info.shard_size, mesh_info.shard_rank)
        self._layout = layout
        self.shard_dim, self.orig_size = layout.shard_dim, layout.orig_size
        self.orig_stride, self.orig_numel = layout.orig_stride, layout.orig_numel
        self.row_numel = layout.row_numel
        self.padded_shard_numel, self.local_numel = layout.padded_shard_numel, layout.local_numel
        self.local_shard_size = layout.local_shard_size
        self.unevenly_sharded = layout.unevenly_sharded
        self.smallest_shard_numel = layout.smallest_shard_numel
        pin = offload_to_cpu and can_pin(offload)
        self._shard = shard = LocalShard(param, layout, shard_spec, device, offload_to_cpu, pin, shard_slot)
        self._unsharded = unsharded = UnshardedParam(shard, layout, device, self._tp)
        # Per-step members bound to the part that does the work (no call layer on the hot path).
        self.all_gather_output = unsharded.all_gather_output
        self.take_unsharded_grad = unsharded.take_grad
        self.stash_unsharded_grad = unsharded.stash_grad
        self.holds_unsharded_grad = unsharded.holds_grad
        self.held_unsharded_grads = unsharded.held_grads
        self.accumulate_sharded_grad = shard.accumulate_grad
        local = shard.view
        # all-gather extension (see [Note: All-gather extension]); re-detected at lazy init
        self._extension = ExtensionGather() if defines_hooks(local, self.fqn) else None
        self._may_gain_hooks = may_gain_hooks(local)  # a weight subclass: checked at every all-gather
        self.orig_dtype = param.dtype
        self.param_dtype: torch.dtype | None = None
        self.reduce_dtype: torch.dtype | None = None
        self.from_meta = False  # see _init.warn_if_repeated_shards
        self._sharded_changed()
        self._register(self.sharded_param)

    # ---- set-up --------------------------------------------------------------------------------

    def init_dtypes(self, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> None:
        """Resolve mixed precision against the current sharded dtype (lazy init)."""
        self.orig_dtype = self._shard.settle_dtype()
        if param_dtype == self.orig_dtype or not self.orig_dtype.is_floating_point:
            param_dtype = None
        self.param_dtype = param_dtype
        self.reduce_dtype = None if reduce_dtype == (param_dtype or self.orig_dtype) else reduce_dtype
        self._unsharded.use_dtypes(self.unsharded_dtype, self.reduce_dtype)

    def init_extension(self, mp_policy: Any) -> None:
        """Re-detect the all-gather extension on the local tensor (lazy init); keep the policy for it."""
        local = self._shard.local_tensor()
        self._extension = redetect(self._extension, local, self.fqn, mp_policy)
        self._may_gain_hooks = may_gain_hooks(local)

    @property
    def unsharded_param(self) -> nn.Parameter | None:
        """The unsharded parameter (original shape), or ``None`` before the first unshard."""
        return self._unsharded.param

    @property
    def is_tensor_parallel(self) -> bool:
        return self._tp is not None

    @property
    def has_extension(self) -> bool:
        return self._extension is not None

    @property
    def extension_rule_ok(self) -> bool:
        """The last pre-hook call kept the padded-size rule (always, without an extension)."""
        return self._extension is None or self._extension.rule_ok

    @property
    def _extension_outputs(self) -> list[torch.Tensor]:  # read by tests
        return self._extension.outputs if self._extension is not None else []

    @property
    def unsharded_dtype(self) -> torch.dtype:
        return self.param_dtype or self.orig_dtype

    @property
    def global_size(self) -> torch.Size:
        """The parameter's full (unsharded, un-tensor-parallel) shape: what a full state dict holds."""
        return self.sharded_param.size()

    # ---- the sharded form ------------------------------------------------------------------------

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
        self._sharded_changed()
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
        """Whether :meth:`move_shard_into` can re-point the sharded parameter (see ``LocalShard``)."""
        return self._shard.can_move()

    def move_shard_into(self, view: torch.Tensor) -> None:
        """Move the padded local shard into ``view`` (part of a group's packed buffer); same parameter."""
        self._shard.move_into(view)
        self._sharded_changed()

    def holds_shard(self, view: torch.Tensor) -> bool:
        """Whether ``view`` is (still) this parameter's padded local shard."""
        return self._local_shard is view

    @property
    def shard_dtype(self) -> torch.dtype:
        return self._local_shard.dtype

    @property
    def shard_device(self) -> torch.device:
        return self._local_shard.device

    def adopt_local_shard(self, shard: torch.Tensor) -> None:
        """Make ``shard`` (a padded local shard of this parameter's layout) the sharded parameter's data."""
        self._shard.adopt(shard)
        self._sharded_changed()
        self._register(self.sharded_param)

    def shard_full_tensor(self, full: torch.Tensor) -> DTensor:
        """This rank's shard of ``full`` (the whole parameter; the caller checks :attr:`global_size`)."""
        return self._shard.shard_full_tensor(full, self._tp)

    # ---- all-gather inputs and outputs -------------------------------------------------------------

    def all_gather_input(self, post_forward: bool) -> torch.Tensor:
        """The 1-D tensor this rank contributes (cast to the unsharded dtype by the copy-in)."""
        if self._may_gain_hooks:
            check_hooks_unchanged(self._shard.local_tensor(), self.fqn, had_hooks=False)
        if post_forward:
            piece = self._unsharded.post_forward_slice
            assert piece is not None, f"{self.fqn}: no post-forward slice to gather"
            return piece
        return self._shard.all_gather_input() if self.offload_to_cpu else self._local_shard

    def all_gather_inputs(self, post_forward: bool) -> list[torch.Tensor]:
        """The 1-D tensors this rank contributes: the shard, or an extension's pre-hook outputs."""
        extension = self._extension
        if extension is None:
            return [self.all_gather_input(post_forward)]
        module = self.owners[0][0]
        return extension.all_gather_inputs(self._shard, self._layout, self.mesh_info, module, self.fqn)

    def all_gather_outputs(self) -> list[torch.Tensor]:
        """The per-input output buffers (``W *`` each input's numel), allocated or re-allocated."""
        if self._extension is None:
            return [self.all_gather_output()]
        return self._extension.all_gather_outputs(self.mesh_info.shard_size, self.device)

    def bind_unsharded_storage(self, flat: torch.Tensor, data: torch.Tensor) -> None:
        """Use ``flat`` (1-D, ``W * padded_shard_numel``, a view into a group's buffer) as the output.

        ``data`` is ``flat``'s ``.data`` alias. The group allocates and frees that storage for all its
        parameters at once; this parameter never resizes it. ``Shard(0)`` without extension only.
        """
        assert self._extension is None, f"{self.fqn}: an extension parameter cannot share a group buffer"
        self._unsharded.bind(flat, data)

    def finish_unshard(self) -> None:
        """After copy-out: run the extension's post hook, or (``Shard(d > 0)``) concatenate rank blocks."""
        if self._extension is None:
            self._unsharded.finish()
        else:
            self._extension.finish(self._shard, self._unsharded)

    def drop_unsharded(self) -> None:
        """Forget the unsharded buffers and parameter (sharded state only): the next unshard rebuilds them.

        For a change of the unsharded dtype or layout between steps (``model.double()``).
        """
        self._unsharded.drop()

    def unsharded_tensors(self) -> list[torch.Tensor]:
        """The tensors this parameter keeps for its unsharded forms (some may be freed: size 0)."""
        held = self._unsharded.tensors()
        if self._extension is not None:
            held += self._extension.tensors()
        return held

    def free_unsharded(self) -> None:
        if self._extension is not None:
            self._extension.free()
        self._unsharded.free()

    # ---- registered-state transitions -------------------------------------------------------------

    def to_sharded(self) -> None:
        self._register(self.sharded_param)
        if self._extension is not None:
            self._extension.free()
        self._unsharded.release()

    def to_unsharded(self) -> None:
        unsharded = self._unsharded
        param = unsharded.param
        assert param is not None, f"{self.fqn}: to_unsharded before any all-gather"
        requires_grad = self.sharded_param.requires_grad
        if param.requires_grad != requires_grad:
            param.requires_grad_(requires_grad)
        self._register(param)
        if unsharded.post_forward_slice is not None:
            unsharded.drop_post_forward_slice()

    def to_sharded_post_forward(self) -> None:
        """Keep this rank's 1/k slice of the padded unsharded data; register a placeholder DTensor."""
        info = self.post_forward_mesh_info
        assert info is not None, f"{self.fqn}: no post-forward mesh"
        self._register(nn.Parameter(self._unsharded.post_forward(info), requires_grad=False))
        self.free_unsharded()

    def registration_slots(self, unsharded: bool) -> list[tuple[dict[str, Any], str, torch.Tensor]] | None:
        """``(module._parameters, name, tensor)`` entries registering the sharded or unsharded form.

        ``None`` where an owner customises ``__setattr__`` (then register one by one).
        """
        if not self._fast_register:
            return None
        tensor = self._unsharded.param if unsharded else self.sharded_param
        assert tensor is not None, f"{self.fqn}: no unsharded parameter yet"
        return [(module._parameters, name, tensor) for module, name in self.owners]  # noqa: SLF001 - see _register

    def _sharded_changed(self) -> None:
        """Cache the ``LocalShard``'s parameter and shard again (both are read per step)."""
        self.sharded_param = self._shard.param
        self._local_shard = self._shard.shard

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

    # ---- gradients (taking, stashing and accumulating them: bound to the parts in __init__) --------

    def zero_unsharded_grad(self) -> torch.Tensor:
        """A zero gradient of the unsharded shape (a parameter this rank did not use in backward)."""
        return torch.zeros(self.orig_size, dtype=self.unsharded_dtype, device=self.device)

    def empty_local_grad(self) -> torch.Tensor:
        """The (zero-element) local gradient of a parameter whose shard holds no elements."""
        return torch.zeros(self.local_shard_size, dtype=self.orig_dtype, device=self.device)

    def dim0_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """``Shard(d > 0)``: the gradient rearranged so rank ``j``'s piece is the ``j``-th dim-0 chunk."""
        return torch.stack(grad.chunk(self.mesh_info.shard_size, dim=self.shard_dim))


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
