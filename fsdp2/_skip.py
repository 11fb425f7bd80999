"""Leaving parameters that no rank used out of the reduce-scatter (conditional compute).

Owns: ``UseTracker`` (one per group: which of the group's submodules ran forward on this rank since
the group's last reduction, from forward pre-hooks) and ``UseAgreement`` (one per root: the one small
all-reduce per backward that tells every rank which submodules ran on some rank, and the parameters
each group may leave out). See [Note: Skipping parameters no rank used].
Does not own: taking and packing the gradients, the usage row and the recovery reduction
(``GradientReducer`` and ``UsageTail``).

[Note: Skipping parameters no rank used]
With conditional compute (a mixture-of-experts layer whose unrouted experts are not called) some
parameters of a group get no gradient on any rank in a step. Reducing their zeros is wasted bandwidth,
but leaving them out changes the reduce-scatter's layout, so every rank must leave out the same ones,
before the group's reduce-scatter. A parameter's gradient is predicted from its module: a parameter
owned (registered) by a submodule of the group whose forward ran on no rank since the group's last
reduction cannot have a gradient, unless it is read outside that forward (a weight read directly by
its parent, a tie). Parameters of the group's own module are never left out.

The facts are agreed once per backward that reduces: the first pre-backward issues one all-reduce
(MAX over the groups' common shard group, int32: per tracked submodule of every group, whether it ran
on some rank, then whether it was idle on some rank), and the first reduction waits for it. A model
whose submodules all ran on every rank has nothing to leave out, so after such a result the next
agreements are spaced out (after 1, 2, 4, ... up to 64 backwards); one that shows a submodule idle on
some rank brings back one per backward. The decision reads only agreed facts, so every rank issues
the same agreements. (MAX, not a sum: simulated ranks, whose collectives return their input, then
agree as identical ranks would.)

A wrong prediction is caught, not trusted: a rank that holds a gradient for a parameter left out keeps
it and says so in its usage row, which ends with one element per parameter left out. Every rank reads
those sums at the end of backward; where some rank held a gradient, every rank reduces that parameter
once more (zeros where it has none), so the result is exact, and it is never left out again.

Not left out: HSDP groups (the replica all-reduce would need a second agreement), groups on another
shard group than the first, single-rank groups, and everything with ``set_reduce_scatter_unused_params``
(torch's zeros for every parameter).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ._mesh import MeshInfo
from ._param import FSDPParam

__all__ = ["UseAgreement", "UseTracker"]


class _Controls(Protocol):
    reduce_grads: bool
    reduce_scatter_unused_params: bool


class _Group(Protocol):
    """What the agreement reads of a group (``_param_group.FSDPParamGroup``)."""

    fsdp_params: list[FSDPParam]
    modules: tuple[nn.Module, ...]
    mesh_info: MeshInfo
    device: torch.device
    controls: _Controls


class UseTracker:
    """Which of one group's parameter-owning submodules ran forward on this rank.

    Fields:
        owners: the submodules (other than the group's own modules) that register its parameters.
        slots: per parameter of the group, the indices in ``owners`` of the modules that own it;
            empty for a parameter of the group's own module (never left out).
        ran: per owner, whether its forward ran since the group's last reduction (set by its hook).
    """

    def __init__(self, group: _Group) -> None:
        own = {id(m) for m in group.modules}
        index: dict[int, int] = {}
        self.owners: list[nn.Module] = []
        self.slots: list[tuple[int, ...]] = []
        for fsdp_param in group.fsdp_params:
            modules = [m for m, _ in fsdp_param.owners]
            if any(id(m) in own for m in modules):
                self.slots.append(())
                continue
            for module in modules:
                if id(module) not in index:
                    index[id(module)] = len(self.owners)
                    self.owners.append(module)
            self.slots.append(tuple(index[id(m)] for m in modules))
        self.ran = [False] * len(self.owners)
        self._handles = [m.register_forward_pre_hook(_marker(self.ran, i)) for i, m in enumerate(self.owners)]

    def take(self) -> list[int]:
        """This rank's bits (1: ran) for the agreement; they keep counting until the group reduces."""
        return [int(flag) for flag in self.ran]

    def unused(self, fsdp_params: Sequence[FSDPParam], ran: Sequence[int]) -> frozenset[int]:
        """Ids of the parameters whose owners ran on no rank (``ran``: 1 where an owner ran on some)."""
        return frozenset(
            id(p)
            for p, owners in zip(fsdp_params, self.slots, strict=True)
            if owners and not any(ran[o] for o in owners)
        )

    def reduced(self) -> None:
        """The group reduced: count again from zero."""
        for index in range(len(self.ran)):
            self.ran[index] = False


def _marker(ran: list[bool], index: int) -> Any:
    def mark(module: nn.Module, args: Any) -> None:
        ran[index] = True

    return mark


_MAX_GAP = 64  # backwards between agreements while nothing is idle anywhere

# One tracker per group, whichever root adopts it (a later root reuses the hooks of an earlier one).
_TRACKERS: weakref.WeakKeyDictionary[Any, UseTracker] = weakref.WeakKeyDictionary()


class UseAgreement:
    """The once-per-backward agreement on which submodules ran on some rank, for one root's groups.

    Fields:
        members: ``(group, tracker)`` for each group that may leave parameters out, in module order.
        process_group / device: the members' common shard group and the tensor device it reduces on.
        _pending: the issued all-reduce (``_Pending``) of the running backward, until a group reads it.
        _unused: per member group (by id), the parameter ids it may leave out in this backward.
        _backwards / _next / _gap: backwards begun, the next one that agrees, the current spacing.
    """

    def __init__(self, groups: Sequence[_Group]) -> None:
        self.members: list[tuple[_Group, UseTracker]] = []
        self.process_group: Any = None
        self.device = torch.device("cpu")
        self._side_stream: Any = None
        for group in groups:
            info = group.mesh_info
            if info.shard_size <= 1 or info.replicate_group is not None:
                continue
            if self.process_group is None:
                self.process_group, self.device = info.shard_group, group.device
            elif info.shard_group is not self.process_group:
                continue
            tracker = _TRACKERS.get(group)
            if tracker is None:
                tracker = _TRACKERS[group] = UseTracker(group)
            if tracker.owners:
                self.members.append((group, tracker))
        self._pending: _Pending | None = None
        self._unused: dict[int, frozenset[int]] | None = None
        self._backwards = self._next = self._gap = 0

    def begin_backward(self) -> None:
        """The first pre-backward: issue the agreement if some member group reduces in this backward."""
        self._pending, self._unused = None, None
        if not any(g.controls.reduce_grads for g, _ in self.members):
            return
        self._backwards += 1
        if self._backwards < self._next:
            return  # everything ran everywhere last time: not this backward
        bits = [bit for _, tracker in self.members for bit in tracker.take()]
        self._pending = self._issue(torch.tensor(bits + [1 - bit for bit in bits], dtype=torch.int32))

    def unused(self, group: Any) -> frozenset[int]:
        """Ids of ``group``'s parameters that no rank used in this backward (empty when unknown).

        Called once per reduction of the group; the group's counting starts again.
        """
        if self._unused is None:
            if self._pending is None:
                return frozenset()
            agreed = self._pending.result()
            self._pending = None
            ran, idle = agreed[: len(agreed) // 2], agreed[len(agreed) // 2 :]
            self._space_out(any(idle))
            self._unused = {}
            offset = 0
            for member, tracker in self.members:
                width = len(tracker.owners)
                self._unused[id(member)] = tracker.unused(member.fsdp_params, ran[offset : offset + width])
                offset += width
        counting = _TRACKERS.get(group)
        if counting is not None:
            counting.reduced()
        if group.controls.reduce_scatter_unused_params:
            return frozenset()
        return self._unused.get(id(group), frozenset())

    def _space_out(self, idle_somewhere: bool) -> None:
        """Agree less often while every tracked submodule runs on every rank, each backward otherwise."""
        self._gap = 0 if idle_somewhere else min(2 * self._gap or 1, _MAX_GAP)
        self._next = self._backwards + self._gap + 1 if self._gap else 0

    def reset(self) -> None:
        """An aborted iteration: forget the agreement in flight (its collective finishes on its own)."""
        if self._pending is not None:
            self._pending.result()
        self._pending, self._unused = None, None

    def _issue(self, bits: torch.Tensor) -> _Pending:
        device = self.device
        if device.type != "cuda":
            bits = bits.to(device)
            return _Pending(
                dist.all_reduce(bits, dist.ReduceOp.MAX, self.process_group, async_op=True), bits, None, None
            )
        # CUDA: on a side stream of its own, so neither the copies nor the wait queue behind compute.
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device)
        host = bits.pin_memory()
        with torch.cuda.stream(self._side_stream):
            on_device = host.to(device, non_blocking=True)
            dist.all_reduce(on_device, dist.ReduceOp.MAX, self.process_group, async_op=True).wait()
            host.copy_(on_device, non_blocking=True)
            event = self._side_stream.record_event()
        return _Pending(None, host, event, on_device)


class _Pending:
    """An issued agreement: wait with ``result()`` (the agreed values, on the host)."""

    def __init__(self, work: Any, host: torch.Tensor, event: Any, on_device: Any) -> None:
        self.work, self.host, self.event, self.on_device = work, host, event, on_device

    def result(self) -> list[int]:
        if self.work is not None:
            self.work.wait()
        if self.event is not None:
            self.event.synchronize()
        return [int(v) for v in self.host.tolist()]
