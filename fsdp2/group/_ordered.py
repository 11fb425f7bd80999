"""Gradient reductions summed in global rank order: fp32 sums of narrow wire bytes, reproducible sums.

Owns: ``OrderedReduction`` (one per group: the wire dtype, the order in which contributions are summed)
and ``ordered_reduce``, the collective path both features share (see [Note: Ordered reduction]).
Does not own: packing gradients into the ``(W, S)`` buffer, divisions, the all-reduce hook or
assigning the sharded gradients (``GradientReducer``); when it is used (the mixed precision policy's
``wire_dtype``, ``FSDPModule.set_deterministic_reduction``).

[Note: Ordered reduction]
A reduce-scatter sums the ranks' contributions inside the backend, in an order that depends on the
algorithm, the world size and where an element sits in the buffer, and in the dtype it was sent in.
Here every rank instead receives the contributions to its own shard and sums them itself:

1. the packed buffer, ``(W, S)`` with row ``j`` what rank ``j`` of the shard group owns, packed in
   the wire dtype (in the reduce dtype without one), is sent with one ``all_to_all_single``: rank
   ``j`` receives row ``j`` of every rank, ``(W, S)``, row ``i`` being rank ``i``'s contribution;
2. HSDP: one ``all_gather_into_tensor`` over the replicate group brings every replica's ``(W, S)``, so
   each rank holds all ``R * W`` contributions to its shard (sent in the wire dtype as well);
3. the contributions are summed one after another in global rank order, in the reduce dtype, into a
   fresh ``(S,)`` tensor. Nothing else divides or scales them before that.

So an element's value is ``((c_0 + c_1) + c_2) + ...`` in global rank order whatever the layout: the
same on 4 FSDP ranks and on 2 x 2 HSDP ranks, bucketed or not, run after run. With bf16 gradients,
``wire_dtype=bf16`` and ``reduce_dtype=fp32``, step 1 sends 2 bytes per element instead of 4 and
nothing is rounded: the cast to the wire is exact and the sum is the fp32 sum.
Bytes sent per rank, ``S`` elements per shard: the all-to-all ``(W - 1) * S`` wire elements (a ring
reduce-scatter also sends ``(W - 1) * S``, in the reduce dtype); HSDP's gather ``(R - 1) * W * S``
wire elements, against ``2 (R - 1) / R * S`` reduce-dtype elements for the default all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..base import GroupControls, MeshInfo
from ..comm import GroupComms, run_all_reduce_hook

__all__ = ["OrderedReduction", "divide_and_hook", "ordered_reduce", "rank_order"]


@dataclass(frozen=True)
class OrderedReduction:
    """How one group's gradients are reduced in rank order.

    Attributes:
        wire_dtype: the dtype contributions travel in (the reducer packs them in it; part of the
            bucket key); ``None``: the reduce dtype.
        order: indices into the ``R * W`` received contributions (replica-major), by global rank.
    """

    wire_dtype: torch.dtype | None
    order: tuple[int, ...]


def rank_order(info: MeshInfo) -> tuple[int, ...]:
    """Indices ``r * W + s`` (replica ``r``, shard rank ``s``) sorted by the ranks' global ranks."""
    mesh = info.mesh
    ranks = mesh.mesh
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank is not in its own mesh"
    index: list[int | slice] = list(coordinate)
    kept = [d for d in (info.replicate_mesh_dim, info.shard_mesh_dim) if d is not None]
    for dim in kept:
        index[dim] = slice(None)
    grid = ranks[tuple(index)]
    if info.replicate_mesh_dim is None:
        grid = grid.reshape(1, -1)
    elif info.shard_mesh_dim is not None and info.replicate_mesh_dim > info.shard_mesh_dim:
        grid = grid.transpose(0, 1)  # (replicate, shard)
    flat = grid.reshape(-1).tolist()
    return tuple(sorted(range(len(flat)), key=flat.__getitem__))


def ordered_reduce(
    buffer: torch.Tensor,
    info: MeshInfo,
    shard_group: dist.ProcessGroup,
    reduction: OrderedReduction,
    comms: GroupComms,
    sum_dtype: torch.dtype,
) -> torch.Tensor:
    """The sum over every rank of their contributions to this rank's shard, in global rank order.

    ``buffer`` is the packed ``(W * S,)`` reduce-scatter input (in the wire dtype where there is one);
    returns ``(S,)`` in ``sum_dtype`` (the reduce dtype), not divided (see [Note: Ordered reduction]).
    """
    world = info.shard_size
    shard_numel = buffer.numel() // world
    if world > 1:  # buffer: packed in the wire dtype already (GradientReducer.pack)
        received = torch.empty_like(buffer)
        comms.all_to_all(received, buffer, shard_group)
    else:
        received = buffer
    replicas = info.replicate_size if info.replicate_group is not None else 1
    if replicas > 1:
        gathered = received.new_empty((replicas * received.numel(),))
        assert info.replicate_group is not None
        comms.replica_all_gather(gathered, received, info.replicate_group)
        received = gathered
    rows = received.view(-1, shard_numel)
    order = reduction.order
    total = rows[order[0]].to(sum_dtype, copy=True)
    for index in order[1:]:
        total.add_(rows[index])  # promoted to the reduce dtype: exact for a narrower wire dtype
    return total


def divide_and_hook(
    total: torch.Tensor, grad_part: torch.Tensor, controls: GroupControls, ranks: int
) -> None:
    """Divide a rank-ordered sum in place and run the all-reduce hook on ``grad_part`` (a view of it).

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
