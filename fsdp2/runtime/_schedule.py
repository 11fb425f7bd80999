"""Work across the groups of one root: the one caller of gathers and reductions.

Owns: ``Schedule``, one per root (created with the root's shared context): the entry for every
all-gather and every reduction a step runs (``unshard``, ``use``, ``prefetch``, ``reduce``: a group
alone is a bucket of one), the execution orders of the current iteration (pre-forward order for the
forward bucket plan, post-forward order for the default backward prefetch, see [Note: Prefetch order]
in ``_state.py``), the all-gather bucket plan (which groups gather together in forward and in
backward, see [Note: Bucket plan]), and the bucketing caps with the reduce-scatter queue
(``_bucket.Bucketing``). The state's hooks ask the schedule; the schedule issues a shared all-gather
(each group then waits for and copies out its own part) or the group's own, and queues packed
gradients or has the group reduce them. Groups never call the schedule, a sibling, or their root.
Does not own: a group's own all-gather, copy-out or reduction (``FSDPParamGroup`` and its parts),
hooks or root discovery (``FSDPState``, ``RootContext``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import torch

from ..base import ShardedState, TrainingState
from ..group import FSDPParamGroup, pack_gradients, reduce_scatter_key
from ..trace import wait_end, watch_collective
from ._bucket import (
    Bucketing,
    all_gather_bucket,
    all_gather_key,
    bucket_inputs,
    joins_bucket,
    split_into_buckets,
)

if TYPE_CHECKING:
    from ..param import FSDPParam

__all__ = ["Schedule"]


class StateLike(Protocol):
    """What the schedule reads of a ``fully_shard`` state (``_state.FSDPState``): its groups."""

    @property
    def groups(self) -> Sequence[FSDPParamGroup]: ...


_State = TypeVar("_State", bound=StateLike)


_FORWARD = TrainingState.FORWARD
_PRE_BACKWARD = TrainingState.PRE_BACKWARD
_SHARDED = ShardedState.SHARDED


class Schedule(Generic[_State]):
    """The cross-group order and bucketing of one root.

    Fields:
    - ``bucketing``: the two caps in bytes (``None``: one collective per group) and the queue of
      packed gradients waiting for a shared reduce-scatter.
    - ``pre_forward_order``: states in the order their pre-forward ran this iteration (recorded only
      with an all-gather cap: the forward bucket plan follows it).
    - ``post_forward_order``: states (with a group) in the order their post-forward ran, one entry per
      use, across the backwards of one step; ``iteration_start`` is where this iteration's begin.
    - ``_forward`` / ``_backward``: ``id(group)`` -> the groups it all-gathers with (this plan).
    - ``bucket_gathers`` / ``bucket_reduces``: a cap of each kind is set (read per step by groups).
    """

    def __init__(self) -> None:
        self.bucketing = Bucketing()
        self.bucket_gathers = False  # an all-gather cap is set (groups ask ``gather``)
        self.bucket_reduces = False  # a reduce-scatter cap is set (groups ask ``reduce``)
        self.pre_forward_order: list[_State] = []
        self.post_forward_order: list[_State] = []
        self.iteration_start = 0
        self._forward: dict[int, list[FSDPParamGroup]] = {}
        self._backward: dict[int, list[FSDPParamGroup]] = {}
        # kept groups (``keep_gathered``): id -> their sharded parameters' requires_grad when last used
        self._kept: dict[int, tuple[bool, ...]] = {}

    def set_caps(self, all_gather: int | None, reduce_scatter: int | None) -> None:
        self.bucketing.all_gather_cap = all_gather
        self.bucketing.reduce_scatter_cap = reduce_scatter
        self.bucket_gathers, self.bucket_reduces = all_gather is not None, reduce_scatter is not None
        if all_gather is None:
            self._forward.clear()
            self._backward.clear()

    # ---- orders ----------------------------------------------------------------------------------

    def begin_iteration(self) -> None:
        self.pre_forward_order.clear()
        self.iteration_start = len(self.post_forward_order)

    def record_pre_forward(self, state: _State) -> None:
        """Append ``state``'s first pre-forward of this pass (callers check ``bucket_gathers`` first)."""
        self.pre_forward_order.append(state)

    def record_post_forward(self, state: _State) -> int:
        """Append a forward use of ``state``; returns its position (for the backward prefetch)."""
        self.post_forward_order.append(state)
        return len(self.post_forward_order) - 1

    def ran_before(self, index: int) -> _State | None:
        """The state whose forward ran just before the use at ``index`` (``None`` for the first)."""
        return self.post_forward_order[index - 1] if index > 0 else None

    def abandon_iteration(self) -> int:
        """Forget this iteration's forward uses (its forward raised); returns where they began."""
        start = self.iteration_start
        del self.post_forward_order[start:]
        self.pre_forward_order.clear()
        return start

    def end_step(self) -> None:
        self.post_forward_order.clear()

    def reset(self) -> None:
        self.post_forward_order.clear()
        self.pre_forward_order.clear()
        self.bucketing.queue.reset()

    # ---- the one entry for unsharding a group ----------------------------------------------------

    def unshard(
        self, group: FSDPParamGroup, async_op: bool = False, as_state: TrainingState | None = None
    ) -> None:
        """Issue ``group``'s all-gather: with its bucket where the plan has one, else its own.

        A group alone is a bucket of one. Nothing while one is pending or the group is unsharded.

        ``as_state``: the phase the all-gather serves (a prefetch's), default the group's own state.
        """
        if not group.needs_gather():
            return
        if self.bucket_gathers and not async_op and group.sharded_state is _SHARDED:
            group.ready_to_gather()  # its bucket key is known after lazy init
            state = group.training_state if as_state is None else as_state
            if self.gather(group, state):
                # Its wait (from its span's start, see ``bucket_inputs``) is this group's.
                wait_end(group.gatherer.span[0], "all-gather", group.module_fqn, state, group.event_scope)
                return
        group.unshard(async_op, as_state)

    def use(self, group: FSDPParamGroup) -> None:
        """Make ``group``'s unsharded parameters ready for the forward or backward it just entered."""
        controls = group.controls
        if group.training_state is not _PRE_BACKWARD or controls.unshard_in_backward:
            self.unshard(group, controls.unshard_async_op)
        group.wait_for_unshard()
        if controls.keep_gathered:
            flags = tuple(p.sharded_param.requires_grad for p in group.fsdp_params)
            self._kept[id(group)] = flags

    def refresh(self, group: FSDPParamGroup) -> None:
        """Before a kept group (``keep_gathered``) enters forward: nothing stale, no lost unfreezing.

        Only while it is still unsharded (a forward with gradients and no backward since). A shard
        written in place since the group was gathered: reshard, so the use gathers it again
        (see [Note: A kept copy]). ``requires_grad`` changed on the registered (unsharded) tensor while
        the sharded parameter kept its own: the change goes to the sharded parameter (the
        registration then agrees), so the parameter trains.
        """
        if group.sharded_state is not ShardedState.UNSHARDED:
            return
        flags = self._kept.get(id(group), ())
        params = group.fsdp_params
        if flags == tuple(p.sharded_param.requires_grad for p in params):
            for fsdp_param in params:
                unsharded = fsdp_param.unsharded_param
                if (
                    unsharded is not None
                    and unsharded.requires_grad != fsdp_param.sharded_param.requires_grad
                ):
                    fsdp_param.sharded_param.requires_grad_(unsharded.requires_grad)
        if not group.buffer.current(group.fsdp_params):
            group.reshard()

    def prefetch(self, group: FSDPParamGroup, as_state: TrainingState) -> None:
        """Unshard ``group`` ahead of a use in ``as_state`` (``FORWARD`` or ``PRE_BACKWARD``)."""
        if as_state is _PRE_BACKWARD and not group.controls.unshard_in_backward:
            return
        self.unshard(group, False, as_state)

    # ---- all-gather buckets ----------------------------------------------------------------------

    def plan(self, backward: bool) -> None:
        """Split this iteration's orders into buckets (see [Note: Bucket plan]).

        Forward follows the pre-forward order; backward (when a backward follows) the reversed
        post-forward order, restricted to groups that all-gather again in backward.
        """
        cap = self.bucketing.all_gather_cap
        if cap is None:
            return
        self._forward = _buckets(_groups_in(self.pre_forward_order), cap)
        if not backward:
            return
        regathered = [
            (group, alone)
            for group, alone in _groups_in(list(reversed(self.post_forward_order[self.iteration_start :])))
            if group.post_forward_mesh_info is group.mesh_info and group.controls.unshard_in_backward
        ]
        self._backward = _buckets(regathered, cap)

    def gather(self, group: FSDPParamGroup, state: TrainingState) -> bool:
        """Issue one all-gather for ``group`` and the members of its bucket that need one now.

        ``False`` (nothing done) where ``group`` gathers alone: no plan for it, or no member joins.
        Each member waits for and copies out its own part (``wait_for_unshard``).
        """
        members = self._members(group, state)
        if members is None:
            return False
        info = group.mesh_info
        names = "; ".join(g.module_fqn or "<root>" for g in members)
        with watch_collective("all-gather (bucket)", names, state):
            results = all_gather_bucket(
                lambda: [bucket_inputs(g, state) for g in members],
                info.shard_group,
                info.shard_size,
                info.shard_rank,
                group.gatherer.dtype,
                group.comms.all_gather,
                group.comm_ctx,
            )
        for member, result in zip(members, results, strict=True):
            member.gatherer.result = result  # its part of the shared output, copied out at its wait
        return True

    def _members(self, group: FSDPParamGroup, state: TrainingState) -> list[FSDPParamGroup] | None:
        if self.bucketing.all_gather_cap is None or state not in (_FORWARD, _PRE_BACKWARD):
            return None
        bucket = (self._forward if state is _FORWARD else self._backward).get(id(group))
        if bucket is None:
            return None
        key = all_gather_key(group)
        if key is None:
            return None
        members = [group]
        members.extend(g for g in bucket if g is not group and joins_bucket(g, state, key))
        return members if len(members) > 1 else None

    # ---- reduce-scatter queue --------------------------------------------------------------------

    def reduce(self, group: FSDPParamGroup, params: list[FSDPParam], grads: list[torch.Tensor]) -> None:
        """Reduce ``group``'s gradients: queued for a shared reduce-scatter, or its own collective now.

        Queued where a cap is set and the group may share; else alone (a bucket of one).

        A group that cannot share reduces after the queue, so buckets stay runs of consecutive
        post-backwards.
        """
        if not grads:
            return
        cap = self.bucketing.reduce_scatter_cap
        if cap is not None:
            key = reduce_scatter_key(group, params, grads)
            if key is not None:
                self.bucketing.queue.add(pack_gradients(group, params, grads), key, cap, group.comm_ctx)
                return
            self.bucketing.queue.flush(group.comm_ctx)
        group.reduce(params, grads)


def _groups_in(states: Sequence[StateLike]) -> list[tuple[FSDPParamGroup, bool]]:
    """The groups of ``states`` in order, each with whether it must stand alone (its state repeats)."""
    seen: dict[StateLike, int] = {}
    for state in states:
        seen[state] = seen.get(state, 0) + 1
    return [(group, seen[state] > 1) for state in states for group in state.groups]


def _buckets(order: list[tuple[FSDPParamGroup, bool]], cap: int) -> dict[int, list[FSDPParamGroup]]:
    keys: list[Hashable | None] = [None if alone else all_gather_key(group) for group, alone in order]
    sizes = [group.gatherer.output_bytes() for group, _ in order]
    plan: dict[int, list[FSDPParamGroup]] = {}
    for positions in split_into_buckets(sizes, keys, cap):
        if len(positions) < 2:
            continue
        members = [order[i][0] for i in positions]
        for group in members:
            plan[id(group)] = members
    return plan
