"""One managed parameter: its identity and dtypes, which form is registered, and its parts.

Owns: ``FSDPParam``: a parameter's identity (name, owner modules, source), its dtypes, which of its
forms is registered on the owner modules, and the steps that span parts (all-gather inputs and
outputs of extension parameters, registration). The tensors, and the work on them, belong to its
parts, public fields that callers call directly (``fsdp_param.unsharded.take_grad()``), each in its
own module:

- ``ShardLayout`` (``_layout``): the sizes of the sharding (chunk rows, padding, this rank's piece);
- ``PaddedShard`` (``_shard``): the padded local shard, the sharded DTensor parameter and its gradient;
- ``UnshardedParam`` (``_unsharded``): the all-gather output, the unsharded parameter and its
  gradient (no-sync accumulation included), the post-forward slice;
- ``ExtensionGather`` (``_extension_gather``): an all-gather extension parameter's gathered tensors;
- ``TPLayout`` (``_tp``): the DTensor layouts a tensor-parallel parameter adds.

Data flows down only: ``FSDPParam`` calls its parts, the parts never call it. Does not own:
communication (``_collectives``) or deciding when to swap forms (``FSDPParamGroup``).

[Note: FSDP tensors]
- *original parameter*: the ``nn.Parameter`` on the module when ``fully_shard`` is called.
- *local shard* (``PaddedShard.shard``): a 1-D tensor of ``padded_shard_numel`` elements holding this
  rank's rows of the original parameter, ``torch.chunk`` style, zero-padded to the size of chunk 0.
  Every rank therefore contributes the same number of elements to the all-gather. Usually a slot of
  the group's packed buffer (``shard_slot``; see [Note: Packed shards] in ``group/_gather.py``), else a
  tensor of its own.
- *sharded parameter* (``PaddedShard.param``): an ``nn.Parameter`` DTensor (``Shard(0)``) whose local
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
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..base import CPUOffloadPolicy, MeshInfo, OffloadPolicy, ParamSpec
from ._dtensor import local_of, spec_of, wrap_local
from ._extension import check_hooks_unchanged, defines_hooks, may_gain_hooks
from ._extension_gather import ExtensionGather, redetect
from ._late_params import quiet_registrations
from ._layout import ShardLayout, chunk_rows, padded_shard_numel
from ._shard import PaddedShard, is_managed, mark_managed
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
    - ``orig_dtype`` / ``param_dtype`` / ``reduce_dtype``: the sharded dtype and mixed precision
      (resolved by :meth:`init_dtypes` at lazy init; ``None``: no cast).
    - ``from_meta``: materialised from meta since the group's last first-unshard check.
    - ``sharded_param`` / ``_local_shard``: the ``PaddedShard``'s parameter and padded shard, cached
      for per-step reads; refreshed whenever a call into the ``PaddedShard`` may have replaced them.

    Parts (declared below; callers call the part that does the work, e.g.
    ``fsdp_param.unsharded.take_grad()``, ``fsdp_param.local.accumulate_grad(view)``,
    ``fsdp_param.layout.padded_shard_numel``):
    - ``layout`` (``ShardLayout``): the sizes of the sharding (fixed);
    - ``local`` (``PaddedShard``): the padded local shard, the sharded parameter and its gradient;
    - ``unsharded`` (``UnshardedParam``): the all-gather output, the unsharded parameter and its
      gradient, the post-forward slice;
    - ``tp`` (``TPLayout`` or ``None``): a tensor-parallel parameter's DTensor layouts (fixed);
    - ``extension`` (``ExtensionGather`` or ``None``): an all-gather extension's gathered tensors
      (re-detected at lazy init).
    """

    layout: ShardLayout
    local: PaddedShard
    unsharded: UnshardedParam
    tp: TPLayout | None
    extension: ExtensionGather | None

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
        self.tp = TPLayout(spec_of(param), spec.dp_dims) if isinstance(param, DTensor) else None
        shard_spec = sharded_spec(spec, self.tp, mesh_info, param.dtype)
        if isinstance(param, DTensor):
            param = nn.Parameter(local_of(param), requires_grad=param.requires_grad)
        self.layout = layout = ShardLayout.of(
            param, spec.shard_dim, mesh_info.shard_size, mesh_info.shard_rank
        )
        pin = offload_to_cpu and can_pin(offload)
        self.local = shard = PaddedShard(param, layout, shard_spec, device, offload_to_cpu, pin, shard_slot)
        self.unsharded = UnshardedParam(shard, layout, device, self.tp)
        local = shard.view
        # all-gather extension (see [Note: All-gather extension]); re-detected at lazy init
        self.extension = ExtensionGather() if defines_hooks(local, self.fqn) else None
        self._may_gain_hooks = may_gain_hooks(local)  # a weight subclass: checked at every all-gather
        self.orig_dtype = param.dtype
        self.param_dtype: torch.dtype | None = None
        self.reduce_dtype: torch.dtype | None = None
        self.from_meta = False  # see _init.warn_if_repeated_shards
        self._sharded_changed()
        self._register(self.sharded_param)

    # ---- set-up --------------------------------------------------------------------------------

    def init_dtypes(self, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> None:
        """Resolve mixed precision against the current sharded dtype (lazy init).

        A ``grad_dtype`` on the sharded parameter (other than its dtype) is the reduce dtype when the
        policy sets none: the policy's ``reduce_dtype`` wins where both are set. The sharded gradient
        is in ``grad_dtype`` either way (``PaddedShard.accumulate_grad``).
        """
        self.orig_dtype = self.local.settle_dtype()
        if reduce_dtype is None:
            reduce_dtype = self.local.grad_dtype
        if param_dtype == self.orig_dtype or not self.orig_dtype.is_floating_point:
            param_dtype = None
        self.param_dtype = param_dtype
        self.reduce_dtype = None if reduce_dtype == (param_dtype or self.orig_dtype) else reduce_dtype
        self.unsharded.use_dtypes(self.unsharded_dtype, self.reduce_dtype)

    def init_extension(self, mp_policy: Any) -> None:
        """Re-detect the all-gather extension on the local tensor (lazy init); keep the policy for it."""
        local = self.local.local_tensor()
        self.extension = redetect(self.extension, local, self.fqn, mp_policy)
        self._may_gain_hooks = may_gain_hooks(local)

    @property
    def unsharded_param(self) -> nn.Parameter | None:
        """The unsharded parameter (original shape), or ``None`` before the first unshard."""
        return self.unsharded.param

    @property
    def is_tensor_parallel(self) -> bool:
        return self.tp is not None

    @property
    def has_extension(self) -> bool:
        return self.extension is not None

    @property
    def extension_rule_ok(self) -> bool:
        """The last pre-hook call kept the padded-size rule (always, without an extension)."""
        return self.extension is None or self.extension.rule_ok

    @property
    def _extension_outputs(self) -> list[torch.Tensor]:  # read by tests
        return self.extension.outputs if self.extension is not None else []

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
        self.from_meta = self.local.readopt(param) or self.from_meta
        self._sharded_changed()
        self._register(param)

    def placeholder(self) -> nn.Parameter:
        """A meta stand-in for the original parameter (full shape; a TP DTensor for a TP parameter).

        ``fully_shard`` on it builds this parameter's layout again (used to deep-copy a model).
        """
        return self.local.placeholder(self.tp)

    def local_shard_copy(self) -> torch.Tensor:
        """A copy of the padded local shard (for a deep copy of the model)."""
        return self.local.copy()

    def can_move_shard(self) -> bool:
        """Whether :meth:`move_shard_into` can re-point the sharded parameter (see ``PaddedShard``)."""
        return self.local.can_move()

    def move_shard_into(self, view: torch.Tensor) -> None:
        """Move the padded local shard into ``view`` (part of a group's packed buffer); same parameter."""
        self.local.move_into(view)
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
        self.local.adopt(shard)
        self._sharded_changed()
        self._register(self.sharded_param)

    def detached_sharded(self) -> DTensor:
        """The sharded parameter detached, as ``state_dict()`` gives it, sharing its version counter.

        ``DTensor.detach()`` gives a local tensor with a version counter of its own, so an in-place
        write through it (a load into ``state_dict()``'s tensors) would go unseen by a kept copy's
        check (see [Note: A kept copy] in ``group/_unshard_buffer.py``); this one's writes are seen.
        """
        param = cast(DTensor, self.sharded_param)
        return wrap_local(local_of(param).detach(), spec_of(param))

    def shard_full_tensor(self, full: torch.Tensor) -> DTensor:
        """This rank's shard of ``full`` (the whole parameter; the caller checks :attr:`global_size`)."""
        return self.local.shard_full_tensor(full, self.tp)

    # ---- all-gather inputs and outputs -------------------------------------------------------------

    def all_gather_input(self, post_forward: bool) -> torch.Tensor:
        """The 1-D tensor this rank contributes (cast to the unsharded dtype by the copy-in)."""
        if self._may_gain_hooks:
            check_hooks_unchanged(self.local.local_tensor(), self.fqn, had_hooks=False)
        if post_forward:
            piece = self.unsharded.post_forward_slice
            assert piece is not None, f"{self.fqn}: no post-forward slice to gather"
            return piece
        return self.local.all_gather_input() if self.offload_to_cpu else self._local_shard

    def all_gather_inputs(self, post_forward: bool) -> list[torch.Tensor]:
        """The 1-D tensors this rank contributes: the shard, or an extension's pre-hook outputs."""
        extension = self.extension
        if extension is None:
            return [self.all_gather_input(post_forward)]
        module = self.owners[0][0]
        return extension.all_gather_inputs(self.local, self.layout, self.mesh_info, module, self.fqn)

    def all_gather_outputs(self) -> list[torch.Tensor]:
        """The per-input output buffers (``W *`` each input's numel), allocated or re-allocated."""
        if self.extension is None:
            return [self.unsharded.all_gather_output()]
        return self.extension.all_gather_outputs(self.mesh_info.shard_size, self.device)

    def bind_unsharded_storage(self, flat: torch.Tensor, data: torch.Tensor) -> None:
        """Use ``flat`` (1-D, ``W * padded_shard_numel``, a view into a group's buffer) as the output.

        ``data`` is ``flat``'s ``.data`` alias. The group allocates and frees that storage for all its
        parameters at once; this parameter never resizes it. ``Shard(0)`` without extension only.
        """
        assert self.extension is None, f"{self.fqn}: an extension parameter cannot share a group buffer"
        self.unsharded.bind(flat, data)

    def finish_unshard(self) -> None:
        """After copy-out: run the extension's post hook, or (``Shard(d > 0)``) concatenate rank blocks."""
        if self.extension is None:
            self.unsharded.finish()
        else:
            self.extension.finish(self.local, self.unsharded)

    def drop_unsharded(self) -> None:
        """Forget the unsharded buffers and parameter (sharded state only): the next unshard rebuilds them.

        For a change of the unsharded dtype or layout between steps (``model.double()``).
        """
        self.unsharded.drop()

    def unsharded_tensors(self) -> list[torch.Tensor]:
        """The tensors this parameter keeps for its unsharded forms (some may be freed: size 0)."""
        held = self.unsharded.tensors()
        if self.extension is not None:
            held += self.extension.tensors()
        return held

    def free_unsharded(self) -> None:
        if self.extension is not None:
            self.extension.free()
        self.unsharded.free()

    # ---- registered-state transitions -------------------------------------------------------------

    def to_sharded(self, free: bool = True) -> None:
        """Register the sharded parameter; ``free=False`` keeps the unsharded storage (a kept copy)."""
        self._register(self.sharded_param)
        if not free:
            return
        if self.extension is not None:
            self.extension.free()
        self.unsharded.release()

    def to_unsharded(self) -> None:
        unsharded = self.unsharded
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
        self._register(nn.Parameter(self.unsharded.post_forward(info), requires_grad=False))
        self.free_unsharded()

    def registration_slots(self, unsharded: bool) -> list[tuple[dict[str, Any], str, torch.Tensor]] | None:
        """``(module._parameters, name, tensor)`` entries registering the sharded or unsharded form.

        ``None`` where an owner customises ``__setattr__`` (then register one by one).
        """
        if not self._fast_register:
            return None
        tensor = self.unsharded.param if unsharded else self.sharded_param
        assert tensor is not None, f"{self.fqn}: no unsharded parameter yet"
        return [(module._parameters, name, tensor) for module, name in self.owners]  # noqa: SLF001 - see _register

    def _sharded_changed(self) -> None:
        """Cache the ``PaddedShard``'s parameter and shard again (both are read per step)."""
        self.sharded_param = self.local.param
        self._local_shard = self.local.shard

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

    # ---- gradients (taking, stashing and accumulating them: ``unsharded`` and ``local`` do it) -------

    def zero_unsharded_grad(self) -> torch.Tensor:
        """A zero gradient of the unsharded shape (a parameter this rank did not use in backward)."""
        return torch.zeros(self.layout.orig_size, dtype=self.unsharded_dtype, device=self.device)

    def empty_local_grad(self) -> torch.Tensor:
        """The (zero-element) local gradient of a parameter whose shard holds no elements."""
        return torch.zeros(self.layout.local_shard_size, dtype=self.orig_dtype, device=self.device)

    def dim0_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """``Shard(d > 0)``: the gradient rearranged so rank ``j``'s piece is the ``j``-th dim-0 chunk."""
        return torch.stack(grad.chunk(self.mesh_info.shard_size, dim=self.layout.shard_dim))


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
