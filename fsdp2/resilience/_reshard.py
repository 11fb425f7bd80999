"""A snapshot of W ranks onto W' ranks: which rows each new rank takes from each old one.

Owns: ``Reshard``, the plan of one restore, the same on every rank: leaf table, old and new world
size, and which new rank holds (reads and sends) each old rank's snapshot. ``outgoing`` cuts, for each
new rank, the rows of every sharded leaf its chunk shares with the old ranks held here, plus the tree
and the whole-held tensors of the old rank it takes them from (``source``); ``incoming`` puts a new
rank's pieces together. Pure: tensors in, tensors out; the exchange itself is ``_restore``'s (through
``comm.exchange``).

[Note: What each new rank receives]
From each sender, in this order: for each sharded leaf in table order, for each old rank the sender
holds in ascending order, the rows of that old rank's chunk that fall in the new rank's chunk (both
chunks as ``torch.chunk`` cuts the leaf's sharded dimension: ``param.routes`` between the two
``RowLayout``s, whichever dimension it is); then, when the sender holds the receiver's ``source`` (old
rank ``new_rank % old_world``), that rank's tree and whole-held tensors, pickled. A receiver computes
every piece's size from the leaf table; only the pickled part's length travels (the exchange's counts).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch

from ..comm import take
from ..param import Routes, RowLayout, routes
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

    def _routes(self, leaf: Leaf, rank: int) -> Routes:
        """``rank``'s rows of ``leaf``'s sharded dimension going from the old chunks to the new ones.

        ``send``: to new ranks, ``rank`` as an old rank; ``receive``: from old ranks, ``rank`` as a new one.
        """
        assert leaf.dim is not None
        size = leaf.shape[leaf.dim]
        return routes(RowLayout.chunked(size, self.old_world), RowLayout.chunked(size, self.new_world), rank)

    def outgoing(self, me: int, held: dict[int, RankSnapshot]) -> list[torch.Tensor]:
        """What ``me`` sends each new rank (uint8, flat), from the old snapshots it holds."""
        mine = self.held_by(me)
        parts: list[list[torch.Tensor]] = [[] for _ in range(self.new_world)]
        for index, leaf in enumerate(self.leaves):
            if leaf.dim is None:
                continue
            for old in mine:
                local = held[old].local(index)
                start = RowLayout.chunked(leaf.shape[leaf.dim], self.old_world).span(old)[0]
                for piece in self._routes(leaf, old).send:
                    rows = local.narrow(leaf.dim, piece.start - start, piece.rows)
                    parts[piece.peer].append(rows.contiguous().view(-1).view(torch.uint8))
        for receiver in range(self.new_world):
            if self.source(receiver) in mine:
                parts[receiver].append(_pickled_rest(held[self.source(receiver)]))
        return [torch.cat(part) if part else torch.empty(0, dtype=torch.uint8) for part in parts]

    def incoming(self, me: int, received: list[torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
        """``me``'s tree and its local value of every leaf, from what each sender sent it."""
        cursors = [0] * len(received)
        pieces: dict[int, list[torch.Tensor]] = {}
        for index, leaf in enumerate(self.leaves):
            if leaf.dim is None:
                continue
            for piece in self._routes(leaf, me).receive:  # ascending old ranks: each sender's order too
                sender = self.holder[piece.peer]
                shape = list(leaf.shape)
                shape[leaf.dim] = piece.rows
                value, cursors[sender] = take(received[sender], cursors[sender], shape, leaf.dtype, align=1)
                pieces.setdefault(index, []).append(value)
        sender = self.holder[self.source(me)]
        tree, whole = pickle.loads(received[sender][cursors[sender] :].numpy().tobytes())
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
