"""A snapshot of W ranks onto W' ranks: which rows each new rank takes from each old one.

Owns: ``Reshard``, the plan of one restore, the same on every rank: leaf table, old and new world
size, and which new rank holds (reads and sends) each old rank's snapshot. ``outgoing`` cuts, for each
new rank, the rows of every sharded leaf its chunk shares with the old ranks held here, plus the tree
and the whole-held tensors of the old rank it takes them from (``source``); ``incoming`` puts a new
rank's pieces together. Pure: tensors in, tensors out; the exchange itself is ``_restore``'s.

[Note: What each new rank receives]
From each sender, in this order: for each sharded leaf in table order, for each old rank the sender
holds in ascending order, the rows of that old rank's chunk that fall in the new rank's chunk (both
chunks as ``torch.chunk`` cuts the leaf's sharded dimension); then, when the sender holds the
receiver's ``source`` (old rank ``new_rank % old_world``), that rank's tree and whole-held tensors,
pickled. A receiver computes every piece's size from the leaf table; only the pickled part's length
travels (the all-to-all's counts).
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from ..param._layout import chunk_rows
from ._format import Leaf, RankSnapshot, local_shape


@dataclass(frozen=True)
class Reshard:
    """One restore's plan: ``holder[r]`` is the new rank that reads and sends old rank ``r``'s snapshot."""

    leaves: tuple[Leaf, ...]
    old_world: int
    new_world: int
    holder: tuple[int, ...]

    def source(self, new_rank: int) -> int:
        """The old rank whose tree and whole-held tensors ``new_rank`` takes (itself when it existed)."""
        return new_rank % self.old_world

    def held_by(self, new_rank: int) -> list[int]:
        return [old for old, holder in enumerate(self.holder) if holder == new_rank]

    def _overlap(self, leaf: Leaf, old: int, new: int) -> tuple[int, int] | None:
        """Rows ``[start, stop)`` of ``leaf``'s sharded dimension in both chunks, in global numbering."""
        assert leaf.dim is not None
        size = leaf.shape[leaf.dim]
        old_start, old_stop = _span(size, self.old_world, old)
        new_start, new_stop = _span(size, self.new_world, new)
        start, stop = max(old_start, new_start), min(old_stop, new_stop)
        return (start, stop) if start < stop else None

    def outgoing(self, me: int, held: dict[int, RankSnapshot]) -> list[torch.Tensor]:
        """What ``me`` sends each new rank (uint8, flat), from the old snapshots it holds."""
        mine = self.held_by(me)
        out = []
        for receiver in range(self.new_world):
            parts: list[torch.Tensor] = []
            for index, leaf in enumerate(self.leaves):
                if leaf.dim is None:
                    continue
                for old in mine:
                    span = self._overlap(leaf, old, receiver)
                    if span is not None:
                        start = _span(leaf.shape[leaf.dim], self.old_world, old)[0]
                        piece = held[old].local(index).narrow(leaf.dim, span[0] - start, span[1] - span[0])
                        parts.append(piece.contiguous().view(-1).view(torch.uint8))
            if self.source(receiver) in mine:
                parts.append(_pickled_rest(held[self.source(receiver)]))
            out.append(torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8))
        return out

    def incoming(self, me: int, received: list[torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
        """``me``'s tree and its local value of every leaf, from what each sender sent it."""
        cursors = [0] * len(received)
        pieces: dict[int, list[torch.Tensor]] = {}
        for index, leaf in enumerate(self.leaves):
            if leaf.dim is None:
                continue
            for old in range(self.old_world):  # ascending: each sender's pieces come in this order too
                span = self._overlap(leaf, old, me)
                if span is None:
                    continue
                sender = self.holder[old]
                shape = list(leaf.shape)
                shape[leaf.dim] = span[1] - span[0]
                nbytes = math.prod(shape) * leaf.dtype.itemsize
                raw = received[sender][cursors[sender] : cursors[sender] + nbytes]
                cursors[sender] += nbytes
                if raw.storage_offset() % leaf.dtype.itemsize:  # viewed in its dtype, it must be aligned
                    raw = raw.clone()
                pieces.setdefault(index, []).append(raw.view(leaf.dtype).view(shape))
        rest = received[self.holder[self.source(me)]][cursors[self.holder[self.source(me)]] :]
        tree, whole = pickle.loads(rest.numpy().tobytes())
        values: list[torch.Tensor] = []
        for index, leaf in enumerate(self.leaves):
            if leaf.dim is None:
                values.append(whole[index])
            elif index in pieces:
                values.append(torch.cat(pieces[index], dim=leaf.dim))
            else:  # this rank's chunk is empty (more ranks than rows)
                values.append(torch.empty(local_shape(leaf, self.new_world, me), dtype=leaf.dtype))
        return tree, values


def _pickled_rest(snapshot: RankSnapshot) -> torch.Tensor:
    """An old rank's tree and whole-held tensors, pickled into a uint8 tensor."""
    whole = {i: snapshot.local(i).clone() for i, leaf in enumerate(snapshot.leaves) if leaf.dim is None}
    data = pickle.dumps((snapshot.tree, whole), protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _span(size: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s ``torch.chunk`` piece of ``size`` rows."""
    _, start, count = chunk_rows(size, world, rank)
    return start, start + count
