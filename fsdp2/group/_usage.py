"""Parameters a rank did not use: the same reductions on every rank, no gradient that no rank computed.

Owns: ``UsageTail`` (one per group reducer): which parameters this rank zero-filled in its reductions
since the last end of backward, the usage row appended to each reduce-scatter input, and putting
``None`` back as the gradient of parameters no rank used (see [Note: Unused parameters]).
Does not own: taking or packing the gradients, the collectives (``GradientReducer``).

[Note: Unused parameters]
With conditional compute (a mixture-of-experts layer whose experts get tokens on some ranks only, a
branch taken on one rank) a rank can reach a group's post-backward without a gradient for some of its
trainable parameters. If it left them out, its reduce-scatter input would be smaller than the other
ranks' and the collectives would pair up wrongly: a hang or garbage. So on more than one rank a
missing gradient is always replaced by zeros (a parameter a rank did not use contributes nothing),
and the gradients are those of the unsharded model averaged over the ranks.

A parameter that no rank used must end with no gradient, as on the unsharded model (an optimizer
then leaves it alone; AdamW would otherwise decay it and update its moments). No rank can know that
alone, and a separate agreement would cost a collective per group. Instead each reduce-scatter input
carries a usage row: row ``j`` of the packed ``(W, S)`` buffer becomes ``(S + P,)``, its last ``P``
elements being 1 for each of the ``P`` packed parameters this rank has a real gradient for and 0 for
the zero-filled ones. The reduction sums (or averages) them like the gradients, so every rank receives
in its output's last ``P`` elements a positive value exactly for the parameters some rank used. Only a
rank that zero-filled a parameter needs to read it, at the end of backward after the reductions
finished; a parameter whose row stayed 0 in every reduction since its sharded gradient was ``None``
gets ``None`` back. Zeros go before the usage row where the longer rows would change the summation
order of the gradients on gloo (``comm._collectives.same_order_tail``: at most one zero for buffers up
to 2W MiB), so the sums stay torch's. Cost: ``W * P`` extra elements (and those zeros) per
reduce-scatter, and a wait for the reduction's result on the host only on ranks that zero-filled a
parameter in that step.
With ``set_reduce_scatter_unused_params(True)`` the zeros are kept, as torch does.
"""

from __future__ import annotations

import torch

from ..param import FSDPParam
from ._skip import IdleSignal, Skip

__all__ = ["UsageTail"]


class UsageTail:
    """This rank's unused parameters of one group, and the usage rows of its reductions.

    Fields:
        zero_filled: ids of the parameters zero-filled in the current reduction.
        watched: per parameter id, ``[param, tails]``: parameters whose sharded gradient was ``None``
            when a zero-filled gradient was first assigned to them, with each reduction's usage value
            (0-d views of reduce-scatter outputs); a real local gradient drops the parameter from it.
        skipped: the parameters left out of the current reduction (no rank used them, see
            ``_skip.py``); the usage row has one more element per parameter left out, 1 where this
            rank holds a gradient for it anyway (a wrong prediction).
        idle / signal: for a group ``_skip`` tracks, whether one of its submodules was idle on this
            rank (the usage row's last element) and where that element's reduced value goes;
            ``None`` for other groups (no such element).
        flags: per parameter left out since the last end of backward, ``(param, values)``: those
            elements after each reduction (positive: some rank held a gradient).
        never_skip: ids of parameters a rank held a gradient for while left out: always reduced now.
    """

    def __init__(self) -> None:
        self.zero_filled: set[int] = set()
        self.watched: dict[int, tuple[FSDPParam, list[torch.Tensor]]] = {}
        self.skipped: list[FSDPParam] = []
        self.idle: bool | None = None
        self.signal: IdleSignal | None = None
        self.flags: dict[int, tuple[FSDPParam, list[torch.Tensor]]] = {}
        self.never_skip: set[int] = set()

    def leave_out(
        self, params: list[FSDPParam], unused: frozenset[int]
    ) -> tuple[list[FSDPParam], list[FSDPParam]]:
        """Split ``params`` into ``(reduced, left out)``: trainable, unused on every rank, not pinned.

        Nothing is left out when that would leave nothing to reduce (the row needs a reduction to
        carry it). The split depends only on agreed facts, so every rank makes the same one.
        """
        kept: list[FSDPParam] = []
        skipped: list[FSDPParam] = []
        for fsdp_param in params:
            key = id(fsdp_param)
            if (
                key in unused
                and key not in self.never_skip
                and fsdp_param.sharded_param.requires_grad
                and fsdp_param.layout.padded_shard_numel
            ):
                skipped.append(fsdp_param)
            else:
                kept.append(fsdp_param)
        if not any(p.layout.padded_shard_numel and p.sharded_param.requires_grad for p in kept):
            return params, []
        return kept, skipped

    def note_taken(
        self,
        params: list[FSDPParam],
        zero_filled: list[FSDPParam],
        skipped: list[FSDPParam],
        skip: Skip | None,
    ) -> None:
        """The gradients of one reduction were taken: ``zero_filled`` had none on this rank."""
        self.zero_filled = {id(p) for p in zero_filled}
        self.skipped = skipped
        self.idle, self.signal = (None, None) if skip is None else (skip.idle, skip.signal)
        if self.watched:
            for fsdp_param in params:
                if id(fsdp_param) not in self.zero_filled:
                    self.watched.pop(id(fsdp_param), None)  # used here: it keeps its gradient

    def width(self, params: list[FSDPParam]) -> int:
        """Elements of the usage row after ``params``' gradients in the current reduction."""
        return len(params) + len(self.skipped) + (0 if self.idle is None else 1)

    def row(
        self, params: list[FSDPParam], dtype: torch.dtype, device: torch.device, world: int
    ) -> torch.Tensor:
        """The ``(W, width)`` usage rows to pack after ``params``' gradients (1: used on this rank)."""
        # Built on the device (no host-to-device copy, which would wait for the stream on CUDA)
        row = torch.ones(self.width(params), dtype=dtype, device=device)
        if self.zero_filled:
            for index, fsdp_param in enumerate(params):
                if id(fsdp_param) in self.zero_filled:
                    row[index] = 0
        for index, fsdp_param in enumerate(self.skipped, start=len(params)):
            if not fsdp_param.unsharded.holds_grad():
                row[index] = 0
        if self.idle is False:
            row[-1] = 0
        return row.expand(world, row.numel())

    def note_assigned(self, params: list[FSDPParam], tail: torch.Tensor, keep_zeros: bool) -> None:
        """Before assigning a reduction's shards: watch the zero-filled parameters (``tail``: usage)."""
        for index, fsdp_param in enumerate(self.skipped, start=len(params)):
            self.flags.setdefault(id(fsdp_param), (fsdp_param, []))[1].append(tail[index])
        if self.signal is not None:
            self.signal.note(tail[-1:])
        if not self.zero_filled or keep_zeros:
            return
        for index, fsdp_param in enumerate(params):
            key = id(fsdp_param)
            if key not in self.zero_filled:
                continue
            entry = self.watched.get(key)
            if entry is None:
                if fsdp_param.sharded_param.grad is not None:
                    continue  # an earlier reduction gave it a gradient: zeros add nothing
                entry = self.watched[key] = (fsdp_param, [])
            entry[1].append(tail[index])

    def pending(self) -> bool:
        """Whether ``finish`` has anything to read."""
        return bool(self.watched or self.flags)

    def finish(self) -> list[FSDPParam]:
        """End of backward, reductions done: ``None`` again for the parameters no rank used.

        Returns the parameters left out that must be reduced after all (some rank held a gradient for
        them); they are never left out again. Every rank reads the same sums, so all agree.
        """
        for fsdp_param, tails in self.watched.values():
            if all(float(value) == 0.0 for value in tails):
                fsdp_param.sharded_param.grad = None
        late = [p for p, values in self.flags.values() if any(float(v) > 0.0 for v in values)]
        self.never_skip.update(id(p) for p in late)
        self.forget()
        return late

    def forget(self) -> None:
        """Drop what the reductions since the last end of backward noted (also after an abort)."""
        self.watched.clear()
        self.zero_filled = set()
        self.skipped = []
        self.flags.clear()
