"""The agreement, once per backward, on which submodules ran forward on some rank (one per root).

Owns: ``UseAgreement``, held by the root's context: its member groups and their trackers (each
group's ``use_tracker``, made here the first time a root adopts the group and kept by the group, so a
later root reuses its hooks), the small all-reduce a backward issues and what each member's
reduction may leave out (``Skip``). See [Note: Skipping parameters no rank used] in
``group/_skip.py``. Does not own: the trackers' hooks and signals (``UseTracker``), the usage rows
(``UsageTail``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..group import FSDPParamGroup, Skip, UseTracker

__all__ = ["UseAgreement"]


class UseAgreement:
    """The agreement on which submodules ran on some rank, for one root's groups (see the note).

    Fields:
        members: ``(group, tracker)`` for each group that may leave parameters out, in module order.
        process_group / device: the members' common shard group and the tensor device it reduces on.
        _pending: the issued all-reduce (``_Pending``) of the running backward, until a group reads it.
        _unused: per member group (by id), the parameter ids it may leave out in this backward.
        _agreed: whether a reducing backward has agreed yet (the first one always does).
    """

    def __init__(self, groups: Sequence[FSDPParamGroup]) -> None:
        self.members: list[tuple[FSDPParamGroup, UseTracker]] = []
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
            tracker = group.use_tracker
            if tracker is None:
                tracker = group.use_tracker = UseTracker(group.modules, group.fsdp_params)
            if tracker.owners:
                self.members.append((group, tracker))
        self._trackers = {id(group): tracker for group, tracker in self.members}
        self._pending: _Pending | None = None
        self._unused: dict[int, frozenset[int]] | None = None
        self._agreed = not self.members  # the first reducing backward agrees: nothing was signalled yet

    def begin_backward(self) -> None:
        """The first pre-backward: agree if the last reductions saw an idle submodule on some rank.

        The first backward that reduces always agrees (no reduction has signalled yet), so parameters
        no rank used are left out from the first step on.
        """
        self._pending, self._unused = None, None
        if not any(g.controls.reduce_grads for g, _ in self.members):
            return  # a no-sync backward: the signals wait for the backward that reduces
        seen = [tracker.signal.read() for _, tracker in self.members]  # every signal is read
        if not any(seen) and self._agreed:
            return  # no rank saw an idle submodule in the last reducing backward
        self._agreed = True
        bits = [int(ran) for _, tracker in self.members for ran in tracker.ran]
        self._pending = self._issue(torch.tensor(bits, dtype=torch.int32))

    def skip(self, group: FSDPParamGroup) -> Skip | None:
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
