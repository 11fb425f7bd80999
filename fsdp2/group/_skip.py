"""Leaving parameters that no rank used out of the reduce-scatter (conditional compute).

Owns: ``UseTracker`` (one per group: which of the group's submodules ran forward on this rank since
the group's last reduction, from forward pre-hooks, and the idle signal its reductions carry back),
``UseAgreement`` (one per root: the small all-reduce of a backward that tells every rank which
submodules ran on some rank, and the parameters each group may leave out) and ``Skip`` (what a
group's reduction is told). See [Note: Skipping parameters no rank used].
Does not own: taking and packing the gradients, the usage row and the reduction after the fact
(``GradientReducer`` and ``UsageTail``).

[Note: Skipping parameters no rank used]
With conditional compute (a mixture-of-experts layer whose unrouted experts are not called) some
parameters of a group get no gradient on any rank in a step. Reducing their zeros is wasted bandwidth,
but leaving them out changes the reduce-scatter's layout, so every rank must leave out the same ones,
before the group's reduce-scatter. A parameter's gradient is predicted from its module: a parameter
owned (registered) by a submodule of the group whose forward ran on no rank since the group's last
reduction cannot have a gradient, unless it is read outside that forward (a weight read directly by
its parent, a tie). Parameters of the group's own module are never left out.

Which submodules ran on some rank is agreed by one all-reduce (MAX over the groups' common shard
group, one int32 per tracked submodule of every group: whether it ran), issued at the first
pre-backward and waited for by the first reduction. It is needed only when some submodule is idle on
some rank, and a dense model should not pay for it, so each group's usage row carries one more
element: 1 where a tracked submodule of the group was idle on this rank. Every rank reads the same
reduced value (on CUDA through a pinned copy, read at the next backward), and the next backward
agrees only if some group saw an idle submodule somewhere. A model whose submodules all run on every
rank issues exactly the collectives it issues without this; a mixture of experts starts leaving
parameters out from its second backward. (MAX, not a sum: simulated ranks, whose collectives return
their input, then agree as identical ranks would.)

A wrong prediction is caught, not trusted: a rank that holds a gradient for a parameter left out keeps
it and says so in its usage row, which has one element per parameter left out. Every rank reads
those sums at the end of backward; where some rank held a gradient, every rank reduces that parameter
once more (zeros where it has none), so the result is exact, and it is never left out again.

Not left out: HSDP groups (the replica all-reduce would need a second agreement), groups on another
shard group than the first, single-rank groups, and everything with ``set_reduce_scatter_unused_params``
(torch's zeros for every parameter).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from ..base._mesh import MeshInfo
from ..param._param import FSDPParam

__all__ = ["IdleSignal", "Skip", "UseAgreement", "UseTracker"]


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
        signal: what the group's reductions said of idle submodules (``IdleSignal``).
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
        self.signal = IdleSignal()
        self._handles = [m.register_forward_pre_hook(_marker(self.ran, i)) for i, m in enumerate(self.owners)]

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


# One tracker per group, whichever root adopts it (a later root reuses the hooks of an earlier one).
_TRACKERS: weakref.WeakKeyDictionary[Any, UseTracker] = weakref.WeakKeyDictionary()


class Skip(NamedTuple):
    """What a member group's reduction is told: which parameters to leave out, and the idle signal.

    ``idle``: a tracked submodule of the group did not run on this rank since its last reduction
    (the usage row's last element); ``signal`` receives that element's reduced value.
    """

    unused: frozenset[int]
    idle: bool
    signal: IdleSignal


class IdleSignal:
    """The reduced idle elements of one group's reductions, read at the next backward.

    On CUDA each value is copied to pinned memory on the stream that produced it (the reduce-scatter
    stream, where the output was allocated, so the output may be freed at once), with an event, so
    reading it later waits for nothing but that copy. No reference to the output is kept: it holds the
    sharded gradients, which ``zero_grad`` frees.
    """

    def __init__(self) -> None:
        self._values: list[tuple[torch.Tensor, Any]] = []  # (copy, event on CUDA)

    def note(self, value: torch.Tensor) -> None:
        """One reduction's reduced idle element (a 1-element view of its output).

        Not kept under ``estimate_memory``'s simulation (no values): simulated ranks never agree.
        """
        if isinstance(value, FakeTensor):
            return
        if value.is_cuda:
            host = torch.empty(1, dtype=value.dtype, pin_memory=True)
            host.copy_(value, non_blocking=True)
            event = torch.cuda.current_stream(value.device).record_event()
            self._values.append((host, event))
        else:
            self._values.append((value.clone(), None))

    def read(self) -> bool:
        """Whether some rank saw an idle submodule in the reductions since the last read."""
        idle = False
        for host, event in self._values:
            if event is not None:
                event.synchronize()
            idle = idle or float(host) > 0.0
        self._values.clear()
        return idle


class UseAgreement:
    """The agreement on which submodules ran on some rank, for one root's groups (see the note).

    Fields:
        members: ``(group, tracker)`` for each group that may leave parameters out, in module order.
        process_group / device: the members' common shard group and the tensor device it reduces on.
        _pending: the issued all-reduce (``_Pending``) of the running backward, until a group reads it.
        _unused: per member group (by id), the parameter ids it may leave out in this backward.
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
        self._trackers = {id(group): tracker for group, tracker in self.members}
        self._pending: _Pending | None = None
        self._unused: dict[int, frozenset[int]] | None = None

    def begin_backward(self) -> None:
        """The first pre-backward: agree if the last reductions saw an idle submodule on some rank."""
        self._pending, self._unused = None, None
        if not any(g.controls.reduce_grads for g, _ in self.members):
            return  # a no-sync backward: the signals wait for the backward that reduces
        seen = [tracker.signal.read() for _, tracker in self.members]  # every signal is read
        if not any(seen):
            return
        bits = [int(ran) for _, tracker in self.members for ran in tracker.ran]
        self._pending = self._issue(torch.tensor(bits, dtype=torch.int32))

    def skip(self, group: Any) -> Skip | None:
        """What ``group``'s reduction in this backward leaves out (``None``: not a member).

        Called once per reduction of the group; the group's counting starts again.
        """
        if self._unused is None and self._pending is not None:
            ran = self._pending.result()
            self._pending = None
            self._unused = {}
            offset = 0
            for member, counted in self.members:
                width = len(counted.owners)
                self._unused[id(member)] = counted.unused(member.fsdp_params, ran[offset : offset + width])
                offset += width
        tracker = self._trackers.get(id(group))
        if tracker is None:
            return None
        idle = not all(tracker.ran)
        tracker.reduced()
        unused: frozenset[int] = frozenset()
        if self._unused is not None and not group.controls.reduce_scatter_unused_params:
            unused = self._unused.get(id(group), frozenset())
        return Skip(unused, idle, tracker.signal)

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
