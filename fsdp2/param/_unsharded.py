"""One parameter's unsharded form: the all-gather output, the unsharded parameter, the post-forward slice.

Owns: ``UnshardedParam``: allocating, freeing and regrowing the 1-D all-gather output (or binding it
to a part of the group's unsharded buffer), the ``Shard(d > 0)`` parameter storage and the
concatenation of rank blocks into it, the unsharded ``nn.Parameter`` object over that storage, the
post-forward slice kept between forward and backward, and the unsharded gradient (taking it for the
reduce-scatter, accumulating it across no-sync steps). See [Note: FSDP tensors] in ``_param``. Does
not own: the sharded form (``_shard``), an extension parameter's gathered tensors
(``_extension_gather``), registration on modules or dtype policy (``FSDPParam``), when to unshard or
reshard (the group).

[Note: Storage resize instead of reallocation]
Resharding frees the unsharded parameter's memory by resizing its storage to zero bytes; unsharding
resizes it back and refills it (the group does so for its whole buffer where its parameters share
one). Tensor objects, views and autograd's saved references stay valid, and the refill goes through a
``.data`` alias so the version counter does not move (a saved parameter refilled for backward would
otherwise fail autograd's in-place check).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..base import MeshInfo
from ..comm import contiguous_strides
from ._dtensor import make_spec, wrap_local
from ._layout import ShardLayout, chunk_rows
from ._shard import PaddedShard
from ._tp import TPLayout

__all__ = ["UnshardedParam"]


class UnshardedParam:
    """The unsharded storage and ``nn.Parameter`` of one parameter (one rank's view of all shards).

    Fields:
    - ``layout`` / ``device`` / ``tp``: the parameter's ``ShardLayout``, compute device and TP layout
      (``None`` without tensor parallelism); fixed.
    - ``shard``: the parameter's ``PaddedShard``, read only: a new unsharded parameter starts with the
      sharded parameter's ``requires_grad`` (and ``dtype`` starts as its dtype).
    - ``dtype`` / ``reduce_dtype``: the unsharded (compute) dtype, and the dtype gradients are
      accumulated in across no-sync steps (``None``: theirs); set by :meth:`use_dtypes` at lazy init.
    - ``flat``: the all-gather output: 1-D, ``layout.unsharded_numel`` elements (rank blocks in
      order), ``dtype``, on ``device``. A part of the group's unsharded buffer (:meth:`bind`; the
      group allocates and frees that storage, ``shared``), else allocated here at the first
      :meth:`all_gather_output`, storage resized to 0 by :meth:`free` and regrown by the next
      :meth:`all_gather_output`. ``None`` before the first unshard and after :meth:`drop`.
    - ``data``: ``flat``'s ``.data`` alias: refills through it keep the version counter (see [Note:
      Storage resize instead of reallocation]). What the all-gather copies out into.
    - ``full``: ``Shard(d > 0)`` only: ND, ``layout.orig_size``, ``dtype``, on ``device``: the
      parameter's storage, which :meth:`finish` concatenates the rank blocks of ``flat`` into; freed
      and regrown with ``flat``. ``None`` otherwise.
    - ``param``: the unsharded ``nn.Parameter``: ND, ``layout.orig_size``, viewing the front of
      ``flat`` (``Shard(0)``) or ``full``, or the post hook's tensor for an extension parameter
      (:meth:`adopt_extension_output`); a TP DTensor under TP. Created at the first unshard and kept
      until :meth:`drop`, because autograd may have saved it.
    - ``post_forward_slice``: 1-D, ``(W / k) * layout.padded_shard_numel`` elements of ``flat``,
      cloned: this rank's part of the post-forward (``reshard_after_forward=k``) shard, the all-gather
      input of the backward unshard. Only between such a reshard and the next registration.
    - ``accumulated_grad``: ND, ``layout.orig_size`` (TP-local), ``reduce_dtype``, on ``device``: the
      sum of the gradients of no-sync steps, from the first such backward to the next reduction.
    """

    def __init__(
        self, shard: PaddedShard, layout: ShardLayout, device: torch.device, tp: TPLayout | None
    ) -> None:
        self.layout = layout
        self.device = device
        self.tp = tp
        self.shard = shard
        self.dtype = shard.param.dtype
        self.reduce_dtype: torch.dtype | None = None
        self.flat: torch.Tensor | None = None
        self.data: torch.Tensor | None = None
        self.full: torch.Tensor | None = None
        self.shared = False
        self._nbytes = 0  # storage sizes to regrow ``flat`` and ``full`` to
        self._full_nbytes = 0
        self.param: nn.Parameter | None = None
        self.post_forward_slice: torch.Tensor | None = None
        self.accumulated_grad: torch.Tensor | None = None

    def use_dtypes(self, dtype: torch.dtype, reduce_dtype: torch.dtype | None) -> None:
        """Set the dtypes (lazy init); storage of another unsharded dtype is dropped for a rebuild."""
        self.dtype = dtype
        self.reduce_dtype = reduce_dtype
        if self.flat is not None and self.flat.dtype != dtype:
            self.drop()  # converted since the last unshard (e.g. model.double()): rebuild

    def all_gather_output(self) -> torch.Tensor:
        """The 1-D output buffer (``data``), allocated or re-allocated as needed.

        For ``Shard(0)`` it is the unsharded parameter's own storage (rank blocks are consecutive
        rows); for ``Shard(d > 0)`` it is a staging buffer that :meth:`finish` rearranges.
        """
        data = self.data
        if data is None:
            flat = torch.empty(self.layout.unsharded_numel, dtype=self.dtype, device=self.device)
            data = flat.data
            self._adopt_flat(flat, data)
            self._nbytes = flat.untyped_storage().nbytes()
        elif not self.shared and data.untyped_storage().nbytes() == 0:
            data.untyped_storage().resize_(self._nbytes)
            if self.full is not None:
                self.full.untyped_storage().resize_(self._full_nbytes)
        return data

    def bind(self, flat: torch.Tensor, data: torch.Tensor) -> None:
        """Use ``flat`` (1-D, ``layout.unsharded_numel``, part of a group's buffer) as the output.

        ``data`` is ``flat``'s ``.data`` alias. The group allocates and frees that storage for all its
        parameters at once; this parameter never resizes it. ``Shard(0)`` without extension only.
        """
        assert self.layout.shard_dim == 0, "a Shard(d > 0) parameter cannot share a group buffer"
        assert flat.numel() == self.layout.unsharded_numel, "a group buffer part of the wrong size"
        self._adopt_flat(flat, data)
        self.shared = True

    def _adopt_flat(self, flat: torch.Tensor, data: torch.Tensor) -> None:
        """Make ``flat`` the all-gather output and build the unsharded parameter over it."""
        self.flat = flat
        self.data = data
        layout = self.layout
        if layout.shard_dim == 0:
            view = flat[: layout.orig_numel].view(layout.orig_size)
        else:
            full = torch.empty(layout.orig_size, dtype=self.dtype, device=self.device)
            self.full = full
            self._full_nbytes = full.untyped_storage().nbytes()
            view = full
        if self.tp is not None:
            view = wrap_local(view, self.tp.unsharded_spec(self.dtype))
        self.param = nn.Parameter(view, requires_grad=self.shard.param.requires_grad)

    def adopt_extension_output(self, unsharded: torch.Tensor) -> None:
        """Make an original-size view of ``unsharded`` (an extension's post-hook result) the parameter."""
        size = self.layout.orig_size
        view = torch.as_strided(unsharded, size, contiguous_strides(size), 0)
        self.param = nn.Parameter(view, requires_grad=self.shard.param.requires_grad)

    def finish(self) -> None:
        """``Shard(d > 0)``: concatenate the gathered rank blocks along the shard dim into ``full``."""
        staging, full = self.data, self.full
        assert staging is not None, "finish_unshard before an all-gather"
        assert full is not None, "finish_unshard on a dim-0 sharded parameter"
        layout = self.layout
        blocks = staging.view(layout.world, *layout.local_shard_size).unbind(0)
        torch.cat(blocks, dim=layout.shard_dim, out=full.data)

    def post_forward(self, info: MeshInfo) -> DTensor:
        """Keep this rank's ``1/k`` slice of ``flat`` for the post-forward mesh ``info``.

        Returns the placeholder DTensor over it (``(Replicate, Shard(0))`` on ``info``'s mesh).
        """
        flat = self.flat
        assert flat is not None, "post-forward reshard before any unshard"
        layout = self.layout
        per_rank = (layout.world // info.shard_size) * layout.padded_shard_numel
        start = info.shard_rank * per_rank
        self.post_forward_slice = piece = flat.detach()[start : start + per_rank].clone()
        _, _, rows = chunk_rows(layout.orig_size[0], info.shard_size, info.shard_rank)
        local = piece[: rows * layout.row_numel].view(rows, *layout.orig_size[1:])
        placements = (Replicate(), Shard(0))
        spec = make_spec(info.mesh, placements, layout.orig_size, layout.orig_stride, self.dtype)
        return wrap_local(local, spec)

    def drop_post_forward_slice(self) -> None:
        """The unsharded parameter is registered again: the slice is no longer an all-gather input."""
        self.post_forward_slice = None

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held for the unsharded forms (some may be freed: size 0)."""
        held = [self.data, self.full, self.post_forward_slice]
        return [t for t in held if t is not None]

    def free(self) -> None:
        """Release the storage this parameter allocated (a shared group buffer is the group's)."""
        if self.data is not None and not self.shared:
            self.data.untyped_storage().resize_(0)
        if self.full is not None:
            self.full.untyped_storage().resize_(0)

    def release(self) -> None:
        """A full reshard: :meth:`free`, and the post-forward slice goes too (inlined: per step)."""
        if self.data is not None and not self.shared:
            self.data.untyped_storage().resize_(0)
        if self.full is not None:
            self.full.untyped_storage().resize_(0)
        self.post_forward_slice = None

    def drop(self) -> None:
        """Forget the storage and the parameter (sharded state only): the next unshard rebuilds them.

        For a change of the unsharded dtype or layout between steps (``model.double()``).
        """
        self.flat = self.data = self.full = None
        self.param = None
        self.shared = False
        self.post_forward_slice = None

    # ---- gradients ---------------------------------------------------------------------------------

    def _tp_local_grad(self, grad: DTensor) -> torch.Tensor:
        """A DTensor gradient's local tensor laid out like the TP parameter (see ``TPLayout``)."""
        assert self.tp is not None, "a DTensor gradient on a parameter that is not tensor parallel"
        return self.tp.local_grad(grad)

    def take_grad(self) -> torch.Tensor | None:
        """Detach and return this step's unsharded gradient, including no-sync accumulation."""
        param = self.param
        if param is None:
            return None
        grad = param.grad
        if grad is not None:
            param.grad = None
            if isinstance(grad, DTensor):
                grad = self._tp_local_grad(grad)
        accumulated = self.accumulated_grad
        if accumulated is None:
            return grad
        self.accumulated_grad = None
        if grad is not None:
            accumulated.add_(grad)
        return accumulated

    def held_grads(self) -> list[torch.Tensor]:
        """The gradients waiting here for a reduction (the accumulator and the parameter's ``.grad``)."""
        param = self.param
        held = [] if self.accumulated_grad is None else [self.accumulated_grad]
        if param is not None and param.grad is not None:
            held.append(param.grad)
        return held

    def holds_grad(self) -> bool:
        """Whether a gradient waits here for a reduction (no-sync accumulation)."""
        param = self.param
        return self.accumulated_grad is not None or (param is not None and param.grad is not None)

    def stash_grad(self) -> None:
        """No-sync step: move the gradient into a ``reduce_dtype`` accumulator when one is set."""
        param = self.param
        reduce_dtype = self.reduce_dtype
        if param is None or reduce_dtype is None or param.grad is None or param.grad.dtype == reduce_dtype:
            return
        grad = param.grad
        param.grad = None
        if isinstance(grad, DTensor):
            grad = self._tp_local_grad(grad)
        if self.accumulated_grad is None:
            self.accumulated_grad = grad.to(reduce_dtype)
        else:
            self.accumulated_grad.add_(grad)
