"""Leaving parameters that no rank used out of the reduce-scatter (conditional compute).

Owns: ``UseTracker`` (one per group, the group's ``use_tracker``: which of the group's submodules
ran forward on this rank since the group's last reduction, from forward pre-hooks, and the idle
signal its reductions carry back) and ``Skip`` (what a group's reduction is told). See [Note:
Skipping parameters no rank used].
Does not own: the agreement across a root's groups (``runtime``'s ``UseAgreement``, held by the
root's context), taking and packing the gradients, the usage row and the reduction after the fact
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
pre-backward and waited for by the first reduction. The first backward that reduces always agrees,
so a mixture of experts leaves parameters out from its first step. Later it is needed only when some
submodule is idle on some rank, and a dense model should not pay for it every step, so each group's
usage row carries one more element: 1 where a tracked submodule of the group was idle on this rank.
Every rank reads the same reduced value (on CUDA through a pinned copy, read at the next backward),
and the next backward agrees only if some group saw an idle submodule somewhere. A model whose
submodules all run on every rank issues one small all-reduce more than torch in its first backward,
then exactly the collectives it issues without this. (MAX, not a sum: simulated ranks, whose
collectives return their input, then agree as identical ranks would.)

A wrong prediction is caught, not trusted: a rank that holds a gradient for a parameter left out keeps
it and says so in its usage row, which has one element per parameter left out. Every rank reads
those sums at the end of backward; where some rank held a gradient, every rank reduces that parameter
once more (zeros where it has none), so the result is exact, and it is never left out again.

Not left out: HSDP groups (the replica all-reduce would need a second agreement), groups on another
shard group than the first, single-rank groups, and everything with ``set_reduce_scatter_unused_params``
(torch's zeros for every parameter).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from ..param import FSDPParam

__all__ = ["IdleSignal", "Skip", "UseTracker"]


class UseTracker:
    """Which of one group's parameter-owning submodules ran forward on this rank.

    Fields:
        owners: the submodules (other than the group's own modules) that register its parameters.
        slots: per parameter of the group, the indices in ``owners`` of the modules that own it;
            empty for a parameter of the group's own module (never left out).
        ran: per owner, whether its forward ran since the group's last reduction (set by its hook).
        signal: what the group's reductions said of idle submodules (``IdleSignal``).
    """

    def __init__(self, modules: Sequence[nn.Module], fsdp_params: Sequence[FSDPParam]) -> None:
        own = {id(m) for m in modules}
        index: dict[int, int] = {}
        self.owners: list[nn.Module] = []
        self.slots: list[tuple[int, ...]] = []
        for fsdp_param in fsdp_params:
            owned_by = [m for m, _ in fsdp_param.owners]
            if any(id(m) in own for m in owned_by):
                self.slots.append(())
                continue
            for module in owned_by:
                if id(module) not in index:
                    index[id(module)] = len(self.owners)
                    self.owners.append(module)
            self.slots.append(tuple(index[id(m)] for m in owned_by))
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

    def close(self) -> None:
        """Remove the forward pre-hooks (the group's parameters changed: a split)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def reduced(self) -> None:
        """The group reduced: count again from zero."""
        for index in range(len(self.ran)):
            self.ran[index] = False


def _marker(ran: list[bool], index: int) -> Any:
    def mark(module: nn.Module, args: Any) -> None:
        ran[index] = True

    return mark


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

        Under ``estimate_memory``'s simulation the copy is kept as in a real run, so its bytes are
        counted, but never read (it holds no value): simulated ranks never agree.
        """
        if isinstance(value, FakeTensor):
            self._values.append((value.clone(), None))
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
            if isinstance(host, FakeTensor):
                continue
            if event is not None:
                event.synchronize()
            idle = idle or float(host) > 0.0
        self._values.clear()
        return idle
