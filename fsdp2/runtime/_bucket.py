"""Bucketing the collectives of small groups (``FSDPModule.set_bucket_cap_mb``).

Owns: ``Bucketing`` (one per root: the two caps in bytes and the reduce-scatter queue), validating a
cap, the greedy split of an execution order into buckets (``split_into_buckets``), one all-gather for
the inputs of several groups (``all_gather_bucket``: each group gets an ``AllGatherResult`` naming its
own columns of the shared output), and ``ReduceScatterQueue``: the packed gradient buffers of
consecutive post-backwards, reduced by one collective once their bytes reach the cap or backward ends.
Also what a group offers a bucketed all-gather, read from its parts: its key (what groups sharing a
collective must agree on), the size a cap counts, whether it joins now, and its inputs. What a group
offers a shared reduce-scatter (its key, its gradients packed: ``PendingReduceScatter``) is the group
room's (``group/_pending.py``).
Does not own: when an execution order is known and the plan built (``Schedule``), or how shards
become gradients (``GradientReducer``).

[Note: Bucket layouts]
W ranks; groups ``A, B, ...`` of one bucket contribute ``a, b, ...`` elements per rank.
- all-gather: the flat output is ``[rank 0: A inputs | B inputs | ...][rank 1: A | B | ...]...``, so
  viewed as ``(W, a + b + ...)`` group ``A`` owns columns ``[0, a)``, ``B`` owns ``[a, a + b)``; each
  group copies out its own columns when it waits.
- reduce-scatter: every group first packs its own ``(W, s_g)`` buffer (row ``j``: chunk ``j`` of its
  gradients). The bucket input is their concatenation along dim 1, ``(W, s_A + s_B + ...)``: row ``j``
  (what rank ``j`` receives) is ``[A's chunk j | B's chunk j | ...]``, so this rank's output is
  ``[A's shards | B's shards | ...]`` and every element is reduced over the same ranks with the same
  op and divisions as in A's or B's own collective (bit-identical results unless the backend's
  summation order depends on an element's position in the buffer, as gloo's does beyond 2 ranks:
  [Note: Ring summation order] in ``comm/_collectives.py``; a group alone keeps torch's order).
Sizes compared with a cap are a collective's full buffer: ``W *`` the per-rank bytes (the all-gather
output, the reduce-scatter input).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable

import torch
import torch.distributed as dist

from ..base import ShardedState, TrainingState
from ..comm import (
    AllGatherResult,
    CommContext,
    CopyIn,
    all_gather_copy_in,
    issue_all_gather,
    serves_on_streams,
)
from ..group import FSDPParamGroup, PendingReduceScatter, ReducePart, reduce_shared
from ..trace import record, span_end, span_start, wait_end, watch_collective

MIB = 1024 * 1024


def cap_bytes(value: object, name: str) -> int | None:
    """Validate one numeric ``set_bucket_cap_mb`` argument (MiB, or ``None``) and return it in bytes.

    ``"auto"`` is read before, by ``_autocap.read_caps``.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"set_bucket_cap_mb: {name} must be a number of MiB, None (one collective per group) or "
            f"'auto' (measure the process group), got {type(value).__name__} {value!r}."
        )
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"set_bucket_cap_mb: {name} must be a positive, finite number of MiB, got {value!r}. Pass "
            "None to keep one collective per group."
        )
    return max(1, int(value * MIB))


def split_into_buckets(sizes: list[int], keys: list[Hashable | None], cap: int) -> list[list[int]]:
    """Greedy split of an execution order into buckets of consecutive positions.

    A bucket grows while its members share a key and their total size stays within ``cap``; a
    ``None`` key (not bucketable) always stands alone. Returns the positions of each bucket, in order.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    total = 0
    current_key: Hashable | None = None
    for i, (size, key) in enumerate(zip(sizes, keys, strict=True)):
        if current and (key is None or key != current_key or total + size > cap):
            buckets.append(current)
            current, total = [], 0
        current.append(i)
        total += size
        current_key = key
        if key is None:
            buckets.append(current)
            current, total = [], 0
    if current:
        buckets.append(current)
    return buckets


def all_gather_bucket(
    make_inputs: Callable[[], list[list[torch.Tensor]]],
    group: dist.ProcessGroup,
    world_size: int,
    rank: int,
    dtype: torch.dtype,
    comm: object,
    comm_ctx: CommContext | None,
) -> list[AllGatherResult]:
    """One all-gather for several groups' inputs; one result per group (see [Note: Bucket layouts]).

    ``make_inputs`` returns each group's 1-D inputs; it runs on the copy-in stream when there is one
    (host-to-device copies under CPU offload are made there, as for a single group).
    """

    def copy_in() -> tuple[list[list[torch.Tensor]], CopyIn]:
        per_group = make_inputs()
        flat = [t for inputs in per_group for t in inputs]
        return per_group, all_gather_copy_in(flat, world_size, rank, dtype, comm)

    def issue(staged: tuple[list[list[torch.Tensor]], CopyIn]) -> None:
        output, local, _ = staged[1]
        issue_all_gather(output, local, group, world_size, False, comm)

    event: torch.Event | None = None
    if (
        comm_ctx is not None and comm_ctx.use_streams and serves_on_streams(False, True)
    ):  # a forward or backward use
        staged, event = comm_ctx.all_gather_on_streams(copy_in, issue)
    else:
        staged = copy_in()
        issue(staged)
    per_group, (output, _, splits) = staged
    results = []
    index = column = 0
    for inputs in per_group:
        group_splits = splits[index : index + len(inputs)]
        width = sum(group_splits)
        results.append(AllGatherResult(output, group_splits, world_size, event, None, (column, width)))
        index += len(inputs)
        column += width
    return results


class ReduceScatterQueue:
    """Packed gradients of consecutive post-backwards, reduced together (see [Note: Bucket layouts]).

    Entries share one key (process group, dtype, divide factors, collective implementation); a
    different key, a cap that would be exceeded, or the end of backward reduces what is queued.
    """

    def __init__(self) -> None:
        self.pending: list[PendingReduceScatter] = []
        self._key: Hashable | None = None
        self._nbytes = 0

    def add(self, entry: PendingReduceScatter, key: Hashable, cap: int, comm_ctx: CommContext | None) -> None:
        """Queue ``entry``; reduce the queue first if ``entry`` cannot join it, and after if it is full."""
        nbytes = entry.buffer.numel() * entry.buffer.element_size()
        if self.pending and (key != self._key or self._nbytes + nbytes > cap):
            self.flush(comm_ctx)
        self.pending.append(entry)
        self._key = key
        self._nbytes += nbytes
        if self._nbytes >= cap:
            self.flush(comm_ctx)

    def flush(self, comm_ctx: CommContext | None) -> None:
        """Reduce everything queued: one group as on its own, several with one collective."""
        pending = self.pending
        if not pending:
            return
        self.pending = []
        self._key = None
        self._nbytes = 0
        waited = span_start(pending[0].scope)  # the thread blocks on the reduction from here
        if len(pending) == 1:
            entry = pending[0]
            with watch_collective("reduce-scatter", entry.module_fqn, entry.state):
                entry.reducer.reduce_packed(
                    entry.buffer, entry.reduced_params, comm_ctx, entry.controls, entry.comms, entry.dtype
                )
            _finish_entry(entry, waited)
            return
        names = "; ".join(e.module_fqn or "<root>" for e in pending)
        sizes = [e.buffer.numel() * e.buffer.element_size() for e in pending]
        with watch_collective("reduce-scatter (bucket)", names, pending[0].state):
            _reduce_bucket(pending, comm_ctx)
        _finish_bucket(pending, waited, sizes)

    def reset(self) -> None:
        """Drop queued gradients (an aborted iteration)."""
        self.pending = []
        self._key = None
        self._nbytes = 0


def _finish_entry(entry: PendingReduceScatter, waited: float | None) -> None:
    entry.reducer.assign_empty(entry.params)
    span_end(entry.start, "reduce-scatter", entry.module_fqn, entry.state, entry.scope, waited)


def _finish_bucket(pending: list[PendingReduceScatter], waited: float | None, sizes: list[int]) -> None:
    """Finish every entry of a shared reduce-scatter; its wait is divided among them by bytes.

    Each entry's share is a consecutive piece of the wait, so the pieces add up to it exactly and
    a timeline shows them side by side rather than several times over.
    """
    end = time.perf_counter() * 1e6 if waited is not None else 0.0
    for entry in pending:
        entry.reducer.assign_empty(entry.params)
        span_end(entry.start, "reduce-scatter", entry.module_fqn, entry.state, entry.scope)
    if waited is None:
        return
    total, offset = sum(sizes) or 1, 0
    for entry, size in zip(pending, sizes, strict=True):
        piece_start = waited + (end - waited) * offset / total
        offset += size
        piece_end = waited + (end - waited) * offset / total
        wait_end(piece_start, "reduce-scatter", entry.module_fqn, entry.state, entry.scope, piece_end)


def _reduce_bucket(pending: list[PendingReduceScatter], comm_ctx: CommContext | None) -> None:
    """Pack every entry's rows side by side into one buffer and reduce it (the one reduce path)."""
    first = pending[0]
    world = first.reducer.mesh_info.shard_size
    widths = [e.buffer.numel() // world for e in pending]
    buffer: torch.Tensor = first.comms.reduce_scatter.allocate(
        (world * sum(widths),), dtype=first.buffer.dtype, device=first.buffer.device
    )
    # Row j of the bucket is row j of every group's buffer, side by side.
    torch.cat([e.buffer.view(world, -1) for e in pending], dim=1, out=buffer.view(world, -1))
    for entry in pending:
        entry.buffer = buffer  # drop the per-group buffers once packed into the bucket
    parts = [
        ReducePart(e.reducer, e.reduced_params, e.controls, w) for e, w in zip(pending, widths, strict=True)
    ]
    reduce_shared(buffer, parts, comm_ctx, first.comms, first.dtype)


class Bucketing:
    """The bucketing settings and in-flight reduce-scatters of one root (shared by its groups).

    Attributes:
        all_gather_cap: bytes of one bucketed all-gather's output; ``None``: one per group.
        reduce_scatter_cap: bytes of one bucketed reduce-scatter's input; ``None``: one per group.
        queue: the reduce-scatters deferred until the cap or the end of backward.
    """

    def __init__(self) -> None:
        self.all_gather_cap: int | None = None
        self.reduce_scatter_cap: int | None = None
        self.queue = ReduceScatterQueue()

    @property
    def enabled(self) -> bool:
        return self.all_gather_cap is not None or self.reduce_scatter_cap is not None


# ---- what a group offers a bucket: its keys, sizes, inputs and packed gradients --------------------
# Each reads the group's parts (the all-gatherer, the reducer) and never a sibling.


def all_gather_key(group: FSDPParamGroup) -> Hashable | None:
    """What groups sharing one all-gather must agree on; ``None``: ``group`` gathers alone."""
    if not group.lazy_initialized:
        return None
    return group.gatherer.bucket_key(group.comms, group.tensor_parallel, group.post_forward_mesh_info)


def joins_bucket(group: FSDPParamGroup, state: TrainingState, key: Hashable) -> bool:
    """Whether ``group`` joins a bucketed all-gather for ``state`` now (it needs one, same key)."""
    return (
        group.gatherer.result is None
        and group.sharded_state is ShardedState.SHARDED
        and (state is TrainingState.FORWARD or group.controls.unshard_in_backward)
        and all_gather_key(group) == key
    )


def bucket_inputs(group: FSDPParamGroup, state: TrainingState) -> list[torch.Tensor]:
    """``group``'s all-gather inputs for a bucket issued for ``state`` (records its unshard)."""
    scope = group.event_scope
    record("unshard", group.module_fqn, state, scope)
    group.gatherer.span = (span_start(scope), state)
    return group.gatherer.inputs(False)


__all__ = [
    "MIB",
    "Bucketing",
    "ReduceScatterQueue",
    "all_gather_bucket",
    "all_gather_key",
    "bucket_inputs",
    "cap_bytes",
    "joins_bucket",
    "split_into_buckets",
]
