"""Gradient reductions summed in a fixed tree order: fp32 sums of narrow wire bytes, reproducible sums.

Owns: ``OrderedReduction`` (one per group: the wire dtype, the order of the contributions' rows)
and ``ordered_reduce``, the collective path both features share (see [Note: Ordered reduction]).
Does not own: packing gradients into the ``(W, S)`` buffer, divisions, the all-reduce hook or
assigning the sharded gradients (``GradientReducer``); when it is used (the mixed precision policy's
``wire_dtype``, ``FSDPModule.set_deterministic_reduction``).

[Note: Ordered reduction]
A reduce-scatter sums the ranks' contributions inside the backend, in an order that depends on the
algorithm, the world size and where an element sits in the buffer, and in the dtype it was sent in.
Here each rank sums the contributions to its own shard itself, in a tree fixed by rank positions:

1. the packed buffer, ``(W, S)`` with row ``j`` what rank ``j`` of the shard group owns, packed in
   the wire dtype (in the reduce dtype without one), is sent with one ``all_to_all_single``: rank
   ``j`` receives row ``j`` of every rank, ``(W, S)``, row ``i`` being rank ``i``'s contribution;
2. the ``W`` rows, ordered by global rank, are summed in the reduce dtype by the pairwise tree
   (``tree_sum``): at each level neighbours ``(0, 1), (2, 3), ...`` are added, an odd last row is
   carried up unchanged. One tensor operation per level: ``ceil(log2 W)`` of them, in place in the
   received buffer; with a narrower wire dtype the first level (which promotes) writes into the
   packed buffer, sent by then (same bytes at an even ``W``), so memory is as with a reduce-scatter;
3. HSDP: the ``(S,)`` partial sum of each replica is cut into ``R`` chunks (padded to ``R * C``);
   one ``all_to_all_single`` over the replicate group gives every replica rank its chunk from every
   replica, ``(R, C)``; the same tree over the rows, ordered by the global rank of each replica's
   member, sums them; one all-gather over the replicate group puts the ``R`` chunks back together.
   This step travels in the reduce dtype (partial sums are not exact in a narrower wire dtype).

So an element's value is the pairwise tree over replicas of the pairwise trees over shard ranks,
whatever the bucketing, the element's place in the buffer, the run or the backend (nothing is summed
inside a collective). When ``W`` is a power of two and the mesh numbers its ranks replica-major
(``init_device_mesh``'s default), that is the pairwise tree over all ``R * W`` contributions in global
rank order, so FSDP on ``R * W`` ranks and HSDP on ``R x W`` give the same bits. With bf16 gradients,
``wire_dtype=bf16`` and ``reduce_dtype=fp32``, step 1 sends 2 bytes per element instead of 4 and
nothing is rounded: the cast to the wire is exact and every add is in fp32.
Per rank and reduction, ``S`` elements per shard: the all-to-all sends ``(W - 1) * S`` wire elements
(a ring reduce-scatter also sends ``(W - 1) * S``, in the reduce dtype); HSDP's all-to-all and
all-gather ``(R - 1) * C`` reduce-dtype elements each, ``C = ceil(S / R)``: as the default all-reduce's
``2 (R - 1) / R * S`` when ``R`` divides ``S``. Python work: ``O(log W + log R)`` tensor operations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..base import GroupControls, MeshInfo
from ..comm import GroupComms, run_all_reduce_hook

__all__ = ["OrderedReduction", "divide_and_hook", "ordered_reduce", "rank_orders", "tree_sum"]


@dataclass(frozen=True)
class OrderedReduction:
    """How one group's gradients are reduced in a fixed tree order.

    Attributes:
        wire_dtype: the dtype contributions travel in (the reducer packs them in it; part of the
            bucket key); ``None``: the reduce dtype.
        shard_order: the shard group's rows (mesh positions) sorted by global rank; ``None``: already.
        replica_order: likewise for the replicas' rows (this rank's shard position in each replica).
    """

    wire_dtype: torch.dtype | None
    shard_order: tuple[int, ...] | None = None
    replica_order: tuple[int, ...] | None = None


def _sorted_positions(ranks: torch.Tensor) -> tuple[int, ...] | None:
    """Positions of the 1-D ``ranks`` sorted by global rank; ``None`` when they are sorted already."""
    order = torch.argsort(ranks)
    if torch.equal(order, torch.arange(ranks.numel())):
        return None
    return tuple(order.tolist())


def rank_orders(info: MeshInfo) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """The shard group's and the replicas' row orders for this rank (see ``OrderedReduction``)."""
    mesh = info.mesh
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank is not in its own mesh"

    def along(dim: int | None) -> tuple[int, ...] | None:
        if dim is None or mesh.size(dim) == 1:
            return None
        index: list[int | slice] = list(coordinate)
        index[dim] = slice(None)
        return _sorted_positions(mesh.mesh[tuple(index)])

    shard_dim = None if info.replicate_only else info.shard_mesh_dim
    return along(shard_dim), along(info.replicate_mesh_dim)


def tree_sum(
    rows: torch.Tensor,
    dtype: torch.dtype,
    order: tuple[int, ...] | None = None,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """The pairwise tree sum in ``dtype`` of the ``(n, L)`` ``rows`` (taken in ``order``): ``(L,)``.

    Level by level, rows ``(0, 1), (2, 3), ...`` of what is left are added and an odd last row is
    carried up, one tensor operation per level. ``rows`` is overwritten when it is in ``dtype``
    already; else the first level (which also promotes) writes its ``ceil(n / 2)`` rows into
    ``scratch`` (a contiguous tensor that is no longer needed) when its bytes suffice, or into a new
    buffer. The result is a view of one of those buffers.
    """
    if order is not None:
        rows = rows[torch.tensor(order, device=rows.device)]  # a copy, in order
    count = rows.shape[0]
    if rows.dtype != dtype:  # the first level also promotes (exactly, for a narrower dtype)
        if count == 1:
            return rows[0].to(dtype, copy=True)
        pairs, carried = divmod(count, 2)
        work = _scratch_rows(scratch, pairs + carried, rows.shape[1], dtype)
        if work is None:
            work = torch.empty((pairs + carried, rows.shape[1]), dtype=dtype, device=rows.device)
        work[:pairs].copy_(rows[0 : 2 * pairs : 2]).add_(rows[1 : 2 * pairs : 2])  # added in dtype
        if carried:
            work[pairs].copy_(rows[count - 1])
        rows, count = work, pairs + carried
    step = 1
    while step < count:  # the rows left are 0, step, 2 * step, ...
        rows[0 : count - step : 2 * step].add_(rows[step : count : 2 * step])
        step *= 2
    return rows[0]


def _scratch_rows(
    scratch: torch.Tensor | None, count: int, width: int, dtype: torch.dtype
) -> torch.Tensor | None:
    """``scratch``'s memory as ``(count, width)`` of ``dtype``, or ``None`` where it does not fit."""
    if scratch is None or not scratch.is_contiguous():
        return None
    nbytes = scratch.numel() * scratch.element_size()
    itemsize = dtype.itemsize
    if nbytes < count * width * itemsize or nbytes % itemsize:
        return None
    return scratch.view(-1).view(dtype)[: count * width].view(count, width)


def ordered_reduce(
    buffer: torch.Tensor,
    info: MeshInfo,
    shard_group: dist.ProcessGroup,
    reduction: OrderedReduction,
    comms: GroupComms,
    sum_dtype: torch.dtype,
) -> torch.Tensor:
    """The fixed-order sum over every rank of their contributions to this rank's shard.

    ``buffer`` is the packed ``(W * S,)`` reduce-scatter input (in the wire dtype where there is one);
    returns a fresh ``(S,)`` in ``sum_dtype`` (the reduce dtype), not divided (see
    [Note: Ordered reduction]).
    """
    world = info.shard_size
    shard_numel = buffer.numel() // world
    if world > 1:  # buffer: packed in the wire dtype already (GradientReducer.pack)
        received = torch.empty_like(buffer)
        comms.all_to_all(received, buffer, shard_group)
        rows = received.view(world, shard_numel)
        # buffer: sent, so free to hold the first tree level (narrower wire dtype, even W)
        partial = tree_sum(rows, sum_dtype, reduction.shard_order, scratch=buffer)
    else:
        partial = buffer
    replicas = info.replicate_size if info.replicate_group is not None else 1
    if replicas == 1:
        storage = partial.untyped_storage()
        if (
            world > 1
            and storage.data_ptr() != buffer.untyped_storage().data_ptr()
            and storage.nbytes() == partial.numel() * partial.element_size()
        ):
            return partial  # a buffer of its own already (the tree's one row)
        return partial.to(sum_dtype, copy=True)  # not a view of the (W, S) or packed buffer
    assert info.replicate_group is not None
    chunk = -(-shard_numel // replicas)
    send = partial.new_zeros((replicas, chunk), dtype=sum_dtype)
    send.view(-1)[:shard_numel].copy_(partial)
    mine = torch.empty_like(send)
    comms.replica_all_to_all(mine, send, info.replicate_group)
    reduced = tree_sum(mine, sum_dtype, reduction.replica_order)
    gathered = send.view(-1)  # every chunk is overwritten by the gather
    comms.replica_all_gather(gathered, reduced, info.replicate_group)
    return gathered[:shard_numel]


def divide_and_hook(
    total: torch.Tensor, grad_part: torch.Tensor, controls: GroupControls, ranks: int
) -> None:
    """Divide a tree-ordered sum in place and run the all-reduce hook on ``grad_part`` (a view of it).

    One division by the gradient divide factor (default: ``ranks``, shard x replicate), before the
    hook, or after it with ``set_force_sum_reduction_for_comms`` (the hook then sees sums).
    """
    divisor = controls.gradient_divide_factor or float(ranks)
    force_sum = controls.force_sum_reduction
    if divisor != 1 and not force_sum:
        total.div_(divisor)
    if controls.all_reduce_hook is not None:
        run_all_reduce_hook(controls.all_reduce_hook, grad_part, controls.all_reduce_hook_stream)
    if divisor != 1 and force_sum:
        total.div_(divisor)
