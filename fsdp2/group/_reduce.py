"""Gradient reduction of one parameter group.

Owns: ``GradientReducer`` (and ``bucket_key``, what its group must share with others to join a
bucketed reduce-scatter): packing a group's unsharded gradients (one buffer per reduce dtype), the
reduce-scatter (and HSDP all-reduce, with partial accumulation while all-reduce is off), divisions,
the user's all-reduce hook, and assigning the sharded DTensor gradients (also from a slice of a
bucketed reduce-scatter's output); the one-rank identity (each unsharded gradient handed over as its
shard when there is nothing to average or cast); the divide-factor cache, the post-reduce event and
the CPU-offload copies in flight. Does not own: when to reduce (the group's
post-backward) or the shared reduce-scatter stream (``CommContext``).
Invariants: at most one post-reduce event is outstanding per group; partial HSDP outputs exist only
while ``all_reduce_grads`` is off.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import torch

from ..base import GroupControls, MeshInfo
from ..comm import (
    CommContext,
    DivideFactors,
    GroupComms,
    all_reduce_before_tail,
    comm_type,
    divide_factors,
    reduce_scatter,
    reduce_scatter_copy_in,
    run_all_reduce_hook,
    same_order_tail,
    view_out_shards,
)
from ..param import FSDPParam, accumulate_slice_grad
from ._ordered import OrderedReduction, divide_and_hook, ordered_reduce, rank_orders
from ._replica_reduce import reduce_across_replicas
from ._skip import Skip
from ._usage import UsageTail


class GradientReducer:
    """Reduce-scatters one group's gradients and assigns the sharded results."""

    def __init__(self, mesh_info: MeshInfo) -> None:
        self.mesh_info = mesh_info
        self._factors: dict[tuple[torch.dtype, float | None, bool], DivideFactors] = {}
        self._post_reduce_event: torch.Event | None = None
        # HSDP with all-reduce off: shard-reduced gradients waiting for a step that all-reduces
        self._partial_outputs: dict[torch.dtype, torch.Tensor] = {}
        self._offload_copies_in_flight = False  # CPU offload: device-to-host gradient copies pending
        self._identity = False  # resolved at lazy init: one rank, nothing to cast (see resolve)
        # The policy's wire_dtype (resolved at lazy init); whether the gradients being reduced are what
        # one backward computed (else they hold a sum of micro-batches, which the wire would round: see
        # take_grads); once used, the ordered reductions' facts, by the dtype they travel in
        self.wire_dtype: torch.dtype | None = None
        self._one_backward = True
        self._ordered: dict[torch.dtype | None, OrderedReduction] = {}
        # More than one rank: missing gradients become zeros and reductions carry a usage row (see
        # [Note: Unused parameters] in _usage.py); resolved at lazy init
        self._fill_unused = False
        self.usage = UsageTail()

    def divide_factors(self, dtype: torch.dtype, controls: GroupControls) -> DivideFactors:
        """How this group's gradients in ``dtype`` are averaged under ``controls`` (cached)."""
        key = (dtype, controls.gradient_divide_factor, controls.force_sum_reduction)
        factors = self._factors.get(key)
        if factors is None:
            info = self.mesh_info
            factors = divide_factors(info.shard_size * info.replicate_size, *key)
            outer = info.outer_data_parallel
            if outer > 1 and controls.gradient_divide_factor is None:
                # Data-parallel ranks outside this mesh (expert parallelism): one more division, after
                # the collectives average (or sum) over this mesh's ranks.
                factors = DivideFactors(factors.op, factors.predivide, (factors.postdivide or 1.0) * outer)
            self._factors[key] = factors
        return factors

    def take_grads(
        self,
        params: list[FSDPParam],
        unused_too: bool,
        reducing: bool = True,
        skip: Skip | None = None,
    ) -> tuple[list[FSDPParam], list[torch.Tensor]]:
        """Take the unsharded gradients autograd left: ``(parameters, gradients)`` to reduce.

        When this rank has a gradient for some of the group's parameters, a trainable parameter that got
        none gets zeros over several ranks, so every rank packs the same gradients (see [Note: Unused
        parameters] in ``_usage.py``). A group with no gradient at all is not reduced, as in torch (a
        backward that did not reach it, e.g. one chunk's of a chunked loss). With ``unused_too``
        (``set_reduce_scatter_unused_params``) every trainable parameter gets zeros, as in torch.
        ``reducing=False``: the gradients are being dropped. ``skip``: for a group ``_skip.py`` tracks,
        the parameters no rank used (agreed by every rank): left out, a gradient held for one stays held.
        """
        skipped: list[FSDPParam] = []
        if skip is not None and skip.unused and reducing and self._fill_unused:
            params, skipped = self.usage.leave_out(params, skip.unused)
        taken = [(p, p.unsharded.take_grad()) for p in params]
        # A gradient held for a parameter left out (a wrong prediction) must reach the others too
        some = any(g is not None for _, g in taken) or any(p.unsharded.holds_grad() for p in skipped)
        fill = reducing and (unused_too or (self._fill_unused and some))
        reduced: list[FSDPParam] = []
        grads: list[torch.Tensor] = []
        zero_filled: list[FSDPParam] = []
        for fsdp_param, grad in taken:
            if grad is None and fill and fsdp_param.sharded_param.requires_grad:
                grad = fsdp_param.zero_unsharded_grad()
                zero_filled.append(fsdp_param)
            if grad is not None:
                reduced.append(fsdp_param)
                grads.append(grad)
        if reducing and self._fill_unused:
            self.usage.note_taken(reduced, zero_filled, skipped, skip)
        if self.wire_dtype is not None:
            # A gradient in another dtype than the compute dtype is a reduce_dtype sum of no-sync
            # micro-batches: it travels in reduce_dtype, since the wire dtype would round it.
            self._one_backward = all(
                g.dtype == (p.param_dtype or p.orig_dtype) for p, g in zip(reduced, grads, strict=True)
            )
        return reduced, grads

    @staticmethod
    def stash_grads(params: list[FSDPParam]) -> bool:
        """No-sync backward: keep the unsharded gradients for the next synced one; whether any are held."""
        for fsdp_param in params:
            fsdp_param.unsharded.stash_grad()
        return any(p.unsharded.holds_grad() for p in params)

    def reduce(
        self,
        params: list[FSDPParam],
        grads: list[torch.Tensor],
        comm_ctx: CommContext | None,
        controls: GroupControls,
        comms: GroupComms,
    ) -> None:
        """One reduce-scatter per reduce dtype (normally exactly one), then assign sharded gradients.

        Empties ``grads`` as it packs them, so the unsharded gradients are freed early.
        """
        if self._identity and controls.all_reduce_hook is None and self._no_division(grads, controls):
            # One rank, nothing to average or cast: each unsharded gradient is its own shard.
            for fsdp_param, grad in zip(params, grads, strict=True):
                fsdp_param.local.accumulate_grad(grad)
            grads.clear()
            return
        # Custom collectives are not used for a single rank (nothing is communicated).
        comm = comms.reduce_scatter if self.mesh_info.shard_size > 1 else None
        for dtype, packed_params, buffer in self.pack(params, grads, comm_ctx, controls, comm):
            self.reduce_packed(buffer, packed_params, comm_ctx, controls, comms, dtype)
        self.assign_empty(params)

    def resolve(self, params: list[FSDPParam], wire_dtype: torch.dtype | None) -> None:
        """Lazy init: whether reducing ``params`` is the identity (one rank, no replicas, no cast).

        Not under CPU offload (its device-to-host copies are waited on through the reduce event).
        """
        info = self.mesh_info
        self.wire_dtype = wire_dtype
        self._ordered.clear()  # rebuilt with this wire dtype at the next ordered reduction
        self._fill_unused = info.shard_size > 1 or (
            info.replicate_group is not None and info.replicate_size > 1
        )
        self._identity = (
            info.shard_size == 1
            and info.replicate_group is None
            and all(not p.offload_to_cpu and p.reduce_dtype is None for p in params)
        )

    def _no_division(self, grads: list[torch.Tensor], controls: GroupControls) -> bool:
        """One rank divides by nothing unless a divide factor is set (the same for every dtype)."""
        factors = self.divide_factors(grads[0].dtype, controls)
        return factors.predivide is None and factors.postdivide is None

    def pack(
        self,
        params: list[FSDPParam],
        grads: list[torch.Tensor],
        comm_ctx: CommContext | None,
        controls: GroupControls,
        comm: Any,
    ) -> list[tuple[torch.dtype, list[FSDPParam], torch.Tensor]]:
        """Reduce-scatter inputs, one per reduce dtype: ``(dtype, params, buffer)``; empties ``grads``.

        Waits first until at most ``reduce_scatter_max_input_buffers - 1`` earlier inputs are alive.
        Each gradient is freed as soon as it is packed. Zero-element parameters are left out.
        """
        if comm_ctx is not None:
            comm_ctx.retire_reduce_scatters(keep=controls.reduce_scatter_max_input_buffers - 1)
        packed = []
        for dtype, (bucket_params, bucket_grads) in self.split_by_dtype(params, grads).items():
            shard_numel = sum(p.layout.padded_shard_numel for p in bucket_params)
            # With a wire dtype the gradients are packed in it directly (summed in dtype on arrival).
            packed_dtype = self.wire() or dtype
            world = self.mesh_info.shard_size
            if self._fill_unused:  # each row ends with the usage row ([Note: Unused parameters])
                first = bucket_grads[0]  # the copy-in casts every input (one dtype) to packed_dtype
                tail = self.tail_width(bucket_params, dtype)
                pad = tail - self.usage.width(bucket_params)
                if pad:  # zeros before the usage row keep torch's summation order (same_order_tail)
                    bucket_grads.append(torch.zeros(world, pad, dtype=first.dtype, device=first.device))
                bucket_grads.append(self.usage.row(bucket_params, first.dtype, first.device, world))
                shard_numel += tail
            buffer = reduce_scatter_copy_in(bucket_grads, world, packed_dtype, shard_numel, comm)
            bucket_grads.clear()
            packed.append((dtype, bucket_params, buffer))
        return packed

    def split_by_dtype(
        self, params: list[FSDPParam], grads: list[torch.Tensor]
    ) -> dict[torch.dtype, tuple[list[FSDPParam], list[torch.Tensor]]]:
        """The gradients to reduce, by reduce dtype, laid out on dim 0; empties ``grads``.

        Zero-element parameters are left out (``assign_empty`` gives them their empty gradient).
        """
        buckets: dict[torch.dtype, tuple[list[FSDPParam], list[torch.Tensor]]] = {}
        for fsdp_param, grad in zip(params, grads, strict=True):
            if fsdp_param.layout.padded_shard_numel == 0:
                continue  # a zero-element parameter: nothing to reduce, its gradient is empty
            dtype = fsdp_param.reduce_dtype or grad.dtype
            if fsdp_param.layout.shard_dim != 0:
                grad = fsdp_param.dim0_grad(grad)
            bucket = buckets.setdefault(dtype, ([], []))
            bucket[0].append(fsdp_param)
            bucket[1].append(grad)
        grads.clear()
        return buckets

    def reduce_packed(
        self,
        buffer: torch.Tensor,
        params: list[FSDPParam],
        comm_ctx: CommContext | None,
        controls: GroupControls,
        comms: GroupComms,
        dtype: torch.dtype,
    ) -> None:
        """Reduce-scatter one packed buffer of this group (a bucket of one) and assign the shards.

        ``dtype`` is the reduce dtype (the buffer's, unless packed in a wire dtype).
        """
        width = buffer.numel() // self.mesh_info.shard_size
        reduce_shared(buffer, [ReducePart(self, params, controls, width)], comm_ctx, comms, dtype)

    def assign_empty(self, params: list[FSDPParam]) -> None:
        """Give zero-element parameters their (empty) sharded gradient."""
        for fsdp_param in params:
            if fsdp_param.layout.padded_shard_numel == 0:
                fsdp_param.local.accumulate_grad(fsdp_param.empty_local_grad())

    def finish_reduce_scatter(
        self,
        output: torch.Tensor,
        params: list[FSDPParam],
        controls: GroupControls,
        comms: GroupComms,
        factors: DivideFactors,
        all_reduced: bool = False,
    ) -> None:
        """Finish this group's reduce-scattered shards (``output``, 1-D) and assign them.

        HSDP's replica all-reduce (or its partial sum while all-reduce is off), the user's all-reduce
        hook, then the sharded gradients. ``all_reduced``: a bucket of ``replicate`` groups already
        all-reduced ``output`` (with the partial sum, ``add_partial``).
        """
        info = self.mesh_info
        if info.replicate_group is not None and not all_reduced:
            partial = self._partial_outputs.pop(output.dtype, None)
            if not controls.all_reduce_grads:
                # HSDP without all-reduce: keep summing shard-reduced gradients until one that syncs.
                self._partial_outputs[output.dtype] = output if partial is None else partial.add_(output)
                return
            if partial is not None:
                output.add_(partial)
            if controls.replica_slices is not None and info.replicate_size > 1:
                self._finish_slices(output, params, controls, comms, factors)
                return
            if info.replicate_size > 1:
                tail = self.tail_width(params, output.dtype)
                all_reduce_before_tail(output, tail, info.replicate_group, factors.op, comms.all_reduce)
        if controls.all_reduce_hook is not None:
            grad_part = _without_usage_row(output, self.tail_width(params, output.dtype))
            run_all_reduce_hook(controls.all_reduce_hook, grad_part, controls.all_reduce_hook_stream)
        self.assign_reduced(output, params, controls)

    def add_partial(self, output: torch.Tensor) -> None:
        """Add to ``output`` the replicas' partial sum held while all-reduce was off, if any."""
        partial = self._partial_outputs.pop(output.dtype, None)
        if partial is not None:
            output.add_(partial)

    def _finish_slices(
        self,
        output: torch.Tensor,
        params: list[FSDPParam],
        controls: GroupControls,
        comms: GroupComms,
        factors: DivideFactors,
    ) -> None:
        """The optimizer sharded across replicas: reduce-scatter across them, assign the slices.

        See ``_replica_reduce.py``; the usage row is read as in ``_assign_views``.
        """
        tail = self.tail_width(params, output.dtype)
        summed, views = reduce_across_replicas(output, params, self.mesh_info, tail, factors, comms, controls)
        if self._fill_unused:
            width = self.usage.width(params)
            usage = summed.narrow(0, summed.numel() - width, width)
            self.usage.note_assigned(params, usage, controls.reduce_scatter_unused_params)
        for fsdp_param, view in zip(params, views, strict=True):
            accumulate_slice_grad(fsdp_param, view, controls.replica_slices, self.mesh_info)

    def tail_width(self, params: list[FSDPParam], dtype: torch.dtype) -> int:
        """Columns after ``params``' gradients in each row of a reduction: zeros, then the usage row.

        The zeros (none or one for buffers up to 2W MiB) keep every gradient element in the summation
        order torch's reduce-scatter, which has no usage row, gives it: see [Note: Ring summation
        order] in ``comm/_collectives.py``. ``dtype``: the reduce dtype (sized as in the buffer). None
        where the reductions carry no usage row (one rank, no replicas).
        """
        if not self._fill_unused:
            return 0
        width = sum(p.layout.padded_shard_numel for p in params)
        return same_order_tail(self.mesh_info.shard_size, width, self.usage.width(params), dtype.itemsize)

    def wire(self) -> torch.dtype | None:
        """The dtype the gradients being reduced travel in: ``wire_dtype``, unless they are sums.

        Gradients accumulated over no-sync micro-batches in ``reduce_dtype`` are not exact in the wire
        dtype, so that reduction travels in ``reduce_dtype`` (as without ``wire_dtype``).
        """
        return self.wire_dtype if self._one_backward else None

    def ordered(self, controls: GroupControls) -> OrderedReduction | None:
        """The tree-ordered reduction this group uses (``wire_dtype`` or deterministic), else ``None``."""
        wire = self.wire()
        if wire is None and not controls.deterministic_reduction:
            return None
        ordered = self._ordered.get(wire)
        if ordered is None:
            ordered = self._ordered[wire] = OrderedReduction(wire, *rank_orders(self.mesh_info))
        return ordered

    def finish_ordered(self, total: torch.Tensor, params: list[FSDPParam], controls: GroupControls) -> None:
        """Divide a tree-ordered sum (``total``, 1-D), run the hook, accumulate the gradients.

        One division by the gradient divide factor (default: every rank, shard x replicate), before the
        all-reduce hook, or after it with ``set_force_sum_reduction_for_comms`` (the hook sees sums).
        """
        info = self.mesh_info
        grad_part = _without_usage_row(total, self.tail_width(params, total.dtype))
        divide_and_hook(total, grad_part, controls, info.average_over)
        self._assign_views(total, params, controls)

    def assign_reduced(self, output: torch.Tensor, params: list[FSDPParam], controls: GroupControls) -> None:
        """Post-divide this group's reduced shards (``output``, 1-D) and accumulate them as gradients."""
        factors = self.divide_factors(output.dtype, controls)
        if factors.postdivide is not None:
            output.div_(factors.postdivide)
        self._assign_views(output, params, controls)

    def _assign_views(self, output: torch.Tensor, params: list[FSDPParam], controls: GroupControls) -> None:
        if self._fill_unused:
            width = self.usage.width(params)
            tail = output.narrow(0, output.numel() - width, width)
            self.usage.note_assigned(params, tail, controls.reduce_scatter_unused_params)
        views = view_out_shards(
            output,
            [p.layout.padded_shard_numel for p in params],
            [p.layout.local_shard_size for p in params],
        )
        for fsdp_param, view in zip(params, views, strict=True):
            if fsdp_param.local.accumulate_grad(view):
                self._offload_copies_in_flight = True

    def reduced_by(self, event: torch.Event | None) -> None:
        """A reduction shared with other groups (a bucket) assigned this group's gradients by ``event``."""
        if event is not None:
            self._post_reduce_event = event

    def finalize(self, device: torch.device) -> list[FSDPParam]:
        """End of the last backward: make ``device``'s current stream (and, for offload, the CPU) wait.

        Returns the parameters to reduce once more (left out, but some rank held a gradient for one).
        """
        event = self._post_reduce_event
        if event is not None:
            if self._offload_copies_in_flight:
                # Non-blocking copies of offloaded gradients: the CPU optimizer reads them next.
                event.synchronize()
            torch.cuda.current_stream(device).wait_event(event)
            self._post_reduce_event = None
        self._offload_copies_in_flight = False
        # Reads the usage rows: after the reductions (the stream waits above)
        return self.usage.finish() if self._fill_unused and self.usage.pending() else []

    def reset(self, device: torch.device) -> None:
        """Forget the reductions of an aborted iteration, HSDP partial sums included."""
        self.usage.forget()
        self.finalize(device)
        self._partial_outputs.clear()


class ReducePart(NamedTuple):
    """One group's columns of a reduce-scatter input (``width`` elements of every rank's row)."""

    reducer: GradientReducer
    params: list[FSDPParam]  # the parameters packed into those columns, in order
    controls: GroupControls
    width: int


def reduce_shared(
    buffer: torch.Tensor,
    parts: list[ReducePart],
    comm_ctx: CommContext | None,
    comms: GroupComms,
    dtype: torch.dtype,
) -> None:
    """The one reduce path: reduce-scatter ``buffer`` and assign each part its columns of the result.

    ``buffer`` is ``(W, sum of the parts' widths)`` flattened: a group alone is a bucket of one part
    (see [Note: Bucket layouts] in ``runtime/_bucket.py``). Parts share the process group, dtype,
    divide factors and collective (the bucket key), so the first part's reducer reduces for all. On
    the reduce-scatter stream where there is one (``CommContext.reduce_on_stream``).
    """

    def work() -> None:
        first = parts[0]
        info = first.reducer.mesh_info
        group = comms.reduce_scatter_group or info.shard_group
        ordered = first.reducer.ordered(first.controls)
        if ordered is not None:
            total = ordered_reduce(buffer, info, group, ordered, comms, dtype)
            for part, piece in zip(parts, _pieces(total, parts), strict=True):
                part.reducer.finish_ordered(piece, part.params, part.controls)
            return
        factors = first.reducer.divide_factors(buffer.dtype, first.controls)
        comm = comms.reduce_scatter if info.shard_size > 1 else None  # none for one rank
        output = reduce_scatter(buffer, group, info.shard_size, factors.op, factors.predivide, comm)
        pieces = _pieces(output, parts)
        shared = info.replicate_only and len(parts) > 1 and info.replicate_group is not None
        if shared and info.replicate_group is not None:  # replicate groups: one all-reduce of the
            # whole bucket (the pieces are views of it)
            for part, piece in zip(parts, pieces, strict=True):
                part.reducer.add_partial(piece)
            comms.all_reduce(output, info.replicate_group, factors.op)
        for part, piece in zip(parts, pieces, strict=True):
            part.reducer.finish_reduce_scatter(piece, part.params, part.controls, comms, factors, shared)

    if comm_ctx is None:
        work()
        return
    event = comm_ctx.reduce_on_stream(buffer, work)
    for part in parts:
        part.reducer.reduced_by(event)


def _pieces(output: torch.Tensor, parts: list[ReducePart]) -> list[torch.Tensor]:
    """Each part's consecutive piece of a reduced output (this rank's shard of every part)."""
    if len(parts) == 1:
        return [output]
    pieces, offset = [], 0
    for part in parts:
        pieces.append(output.narrow(0, offset, part.width))
        offset += part.width
    return pieces


def _without_usage_row(output: torch.Tensor, width: int) -> torch.Tensor:
    """``output`` without its usage row of ``width`` elements (what the all-reduce hook sees)."""
    return output.narrow(0, 0, output.numel() - width) if width else output


def bucket_key(
    reducer: GradientReducer,
    params: list[FSDPParam],
    grads: list[torch.Tensor],
    controls: GroupControls,
    comms: GroupComms,
    tensor_parallel: bool,
    device: torch.device,
) -> Hashable | None:
    """The key under which ``reducer``'s gradients may share a reduce-scatter; ``None``: alone.

    Alone: a single-rank shard group, HSDP (the replica all-reduce), an all-reduce hook, custom
    collectives, tensor-parallel parameters, or gradients in several reduce dtypes. ``replicate``'s
    groups (replicas only) share one all-reduce with each other, never with sharded groups; alone
    with all-reduce off or a rank-ordered reduction.
    """
    info = reducer.mesh_info
    replicas_only = info.replicate_only
    if (
        (info.shard_size == 1 and not replicas_only)
        or (info.replicate_group is not None and not replicas_only)
        or (replicas_only and (info.replicate_size == 1 or not controls.all_reduce_grads))
        or controls.all_reduce_hook is not None
        or comms.custom
        or tensor_parallel
    ):
        return None
    dtypes = {
        p.reduce_dtype or g.dtype for p, g in zip(params, grads, strict=True) if p.layout.padded_shard_numel
    }
    if len(dtypes) != 1:
        return None
    dtype = dtypes.pop()
    ordered = reducer.ordered(controls)
    if replicas_only and ordered is not None:
        return None  # rank-ordered replicas' sums: each group its own
    group = comms.reduce_scatter_group or info.shard_group
    return (
        id(group),
        replicas_only,
        dtype,
        reducer.divide_factors(dtype, controls),
        device,
        comm_type(comms.reduce_scatter),
        ordered,
    )
