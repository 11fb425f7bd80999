"""One extension parameter's all-gather: the pre hook's inputs, the gathered outputs, the post hook.

Owns: ``ExtensionGather``, the per-parameter state of an all-gather that goes through the weight's
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` (see [Note: All-gather extension] in
``_extension``): the output buffers and the inner tensors the post hook allocated, freed at reshard and
re-allocated at the next unshard; and re-detecting the hooks at lazy init (``redetect``). It reads the
local tensor from the parameter's ``PaddedShard`` and hands the post hook's first result to its
``UnshardedParam``. Does not own: the hook protocol itself (``_extension``), the local shard or the
unsharded ``nn.Parameter`` (``_shard``, ``_unsharded``), issuing the collective (the group).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..base import MeshInfo, preserve_version_counter
from ..comm import contiguous_strides
from ._extension import (
    ExtensionRecord,
    call_post_all_gather,
    call_pre_all_gather,
    check_hooks_unchanged,
    defines_hooks,
    padded_rule_holds,
)
from ._layout import ShardLayout
from ._shard import PaddedShard
from ._unsharded import UnshardedParam

__all__ = ["ExtensionGather", "redetect"]


class ExtensionGather:
    """The all-gather of one parameter whose local tensor defines the all-gather hooks.

    Fields:
    - ``record``: the ``ExtensionRecord`` between the pre and the post hook: input sizes and dtypes,
      the pre hook's metadata, the inner tensors the post hook returned (they hold the unsharded data).
    - ``outputs``: 1-D, one per pre-hook input: ``W *`` that input's numel, its dtype, on the compute
      device. Allocated at the first all-gather; storage resized to 0 by :meth:`free` (reshard) and
      regrown by :meth:`all_gather_outputs`; the tensor objects stay.
    - ``nbytes``: the storage sizes of ``outputs``, then of the inner tensors (what regrowing restores).
    - ``rule_ok``: the last pre-hook call kept the padded-size rule (read by the group's check).
    - ``mp_policy``: the group's mixed-precision policy, passed to the pre hook (set at lazy init).
    """

    def __init__(self) -> None:
        self.record = ExtensionRecord()
        self.outputs: list[torch.Tensor] = []
        self.nbytes: list[int] = []
        self.rule_ok = True
        self.mp_policy: Any = None

    @property
    def inner_tensors(self) -> tuple[torch.Tensor, ...]:
        """The post hook's inner tensors (freed at reshard)."""
        return tuple(self.record.inner_tensors)

    def all_gather_inputs(
        self, shard: PaddedShard, layout: ShardLayout, mesh_info: MeshInfo, module: nn.Module, fqn: str
    ) -> list[torch.Tensor]:
        """The pre hook's outputs for ``shard``'s local tensor (on the compute device), flattened."""
        local = shard.local_tensor()
        check_hooks_unchanged(local, fqn, had_hooks=True)
        local = shard.on_device(local)
        mesh = mesh_info.mesh
        shard_mesh = mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[1]]  # type: ignore[index]  # reason: HSDP meshes have names
        size = layout.orig_size
        record = self.record
        inputs, record.metadata = call_pre_all_gather(
            local, shard_mesh, size, contiguous_strides(size), module, self.mp_policy, fqn
        )
        padded_rows = layout.padded_shard_numel // layout.row_numel if layout.row_numel else 0
        self.rule_ok = not layout.unevenly_sharded or padded_rule_holds(inputs, padded_rows)
        record.input_sizes = [t.size() for t in inputs]
        record.input_dtypes = [t.dtype for t in inputs]
        return [t.reshape(-1) for t in inputs]

    def all_gather_outputs(self, world: int, device: torch.device) -> list[torch.Tensor]:
        """The per-input output buffers (``world *`` each input's numel), allocated or re-allocated."""
        record = self.record
        if not self.outputs:
            self.outputs = [
                torch.empty(world * size.numel(), dtype=dtype, device=device)
                for size, dtype in zip(record.input_sizes, record.input_dtypes, strict=True)
            ]
            self.nbytes = [o.untyped_storage().nbytes() for o in self.outputs]
        for output, nbytes in zip(self.outputs, self.nbytes, strict=False):
            if output.untyped_storage().nbytes() == 0:
                output.untyped_storage().resize_(nbytes)
        return self.outputs

    def finish(self, shard: PaddedShard, unsharded: UnshardedParam) -> None:
        """Run the post hook on the gathered outputs.

        The first time (no unsharded parameter yet) the hook allocates; ``unsharded`` adopts an
        original-size view of its result as the parameter. Later calls re-allocate the inner tensors
        and let the hook fill that parameter in place (a refill: the version counter stays, as for
        plain parameters).
        """
        local = shard.local_tensor()
        outputs, record, out = self.outputs, self.record, unsharded.param
        if out is None:
            result = call_post_all_gather(local, outputs, record, unsharded.dtype, None)
            assert result is not None, "the post hook returned nothing"
            tensor, record.inner_tensors = result
            inner_nbytes = [t.untyped_storage().nbytes() for t in record.inner_tensors]
            self.nbytes = self.nbytes[: len(outputs)] + inner_nbytes
            unsharded.adopt_extension_output(tensor)
            return
        for inner, nbytes in zip(record.inner_tensors, self.nbytes[len(outputs) :], strict=True):
            if inner.untyped_storage().nbytes() == 0:
                inner.untyped_storage().resize_(nbytes)
        with preserve_version_counter(out):
            call_post_all_gather(local, outputs, record, unsharded.dtype, out)

    def tensors(self) -> list[torch.Tensor]:
        """The gathered outputs and inner tensors (some may be freed: size 0)."""
        return [*self.outputs, *self.record.inner_tensors]

    def free(self) -> None:
        """Release the outputs' and inner tensors' storage (the tensor objects stay)."""
        for tensor in (*self.outputs, *self.record.inner_tensors):
            tensor.untyped_storage().resize_(0)


def redetect(
    current: ExtensionGather | None, local: torch.Tensor, fqn: str, mp_policy: Any
) -> ExtensionGather | None:
    """Lazy init: the extension of a parameter whose local tensor is now ``local``.

    ``current`` if ``local`` still defines the hooks, a new one if it gained them, ``None`` without
    them. The one kept or made gets the group's mixed-precision policy for the pre hook.
    """
    if not defines_hooks(local, fqn):
        return None
    extension = current if current is not None else ExtensionGather()
    extension.mp_policy = mp_policy
    return extension
