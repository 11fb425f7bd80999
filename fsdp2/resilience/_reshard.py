"""A snapshot of W ranks onto W' ranks: which rows each new rank takes from each old one.

Owns: ``Reshard``, the plan of one restore, the same on every rank: leaf table, old and new world
size, and which new rank holds (reads and sends) each old rank's snapshot. ``outgoing`` cuts, for each
new rank, the rows of every sharded leaf its chunk shares with the old ranks held here, plus the tree
and the whole-held tensors of the old rank it takes them from (``source``); ``incoming`` puts a new
rank's pieces together. Pure: tensors in, tensors out; the exchange itself is ``_restore``'s (through
``comm.exchange``).

[Note: What each new rank receives]
A leaf's rows are cut into ``shards`` pieces (``torch.chunk`` on its dimension, whichever it is): the
whole world's for FSDP, the shard mesh dim's for HSDP, one for a replicated tensor (``Leaf``); rank
``r`` holds piece ``r % shards``, so the ranks below ``shards`` hold every piece once and the others
repeat them (replicas). Optimizer state sharded across replicas (``Leaf.replicas`` above 1) cuts each
piece again, every rank holding its own (``_format.position``); the restore cuts it as the parameter
(replicas 1), and the optimizer's next step cuts it into slices again. Only those first ranks' copies
(every rank's, for slices) are sent: piece by piece, ``param.routes``
between the old and the new cut gives each new piece's rows, and every new rank holding that piece
(its replicas too) receives them. From each sender, in this order: for each sharded leaf in table
order, for each old rank the sender holds in ascending order of its piece, the rows of that old
rank's piece that fall in the receiver's new piece; then, when the sender holds the receiver's
``source`` (old rank ``new_rank % old_world``), that rank's tree and whole-held tensors, pickled. A
receiver computes every piece's size from the leaf table; only the pickled part's length travels (the
exchange's counts). A sender names only the ranks it sends to, and a receiver reads only the ranks it
hears from (``comm.exchange``'s [Note: Sparse sends]); ``holder`` is one tensor, so which old ranks a
new rank holds is one comparison: no Python pass over the old or the new ranks.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..comm import take
from ..param import Routes, RowLayout, routes
from ._format import Leaf, RankSnapshot, local_shape, position, rank_at, rows_of


@dataclass(frozen=True)
class Reshard:
    """One restore's plan: ``holder[r]`` is the new rank that reads and sends old rank ``r``'s snapshot.

    ``new_shards[i]``: how many pieces this job cuts leaf ``i``'s rows into (``Leaf.shards``: ``None``
    for the whole world); all ``None`` when not given (FSDP on a 1-D mesh).
    """

    leaves: tuple[Leaf, ...]
    old_world: int
    new_world: int
    holder: torch.Tensor  # int64, one per old rank
    new_shards: tuple[int | None, ...] | None = None

    def _cuts(self, index: int) -> tuple[int, int]:
        """Leaf ``index``'s old and new number of pieces."""
        new = self.new_shards[index] if self.new_shards is not None else None
        return self.leaves[index].shards or self.old_world, new or self.new_world

    def source(self, new_rank: int) -> int:
        """The old rank whose tree and whole-held tensors ``new_rank`` takes (itself when it existed)."""
        return new_rank % self.old_world

    def held_by(self, new_rank: int) -> list[int]:
        """The old ranks ``new_rank`` holds, in ascending order."""
        return (self.holder == new_rank).nonzero().flatten().tolist()

    def _sender(self, old: int) -> int:
        return int(self.holder[old])

    def _routes(self, index: int, piece: int) -> Routes:
        """Piece ``piece``'s rows of leaf ``index``'s sharded dimension, from the old cut to the new one.

        ``send``: to new pieces, ``piece`` as an old one; ``receive``: from old ones, ``piece`` as a new one.
        """
        leaf = self.leaves[index]
        assert leaf.dim is not None
        new = RowLayout.chunked(leaf.shape[leaf.dim], self._cuts(index)[1])
        return routes(rows_of(leaf, self.old_world), new, piece)

    def outgoing(self, me: int, held: dict[int, RankSnapshot]) -> dict[int, list[torch.Tensor]]:
        """What ``me`` sends each new rank it sends to (uint8 pieces, in order), from the snapshots it holds.

        Only the receivers of some row or tree: work proportional to what it sends, not to the world.
        """
        mine = sorted(held)
        parts: dict[int, list[torch.Tensor]] = {}
        for index, leaf in enumerate(self.leaves):
            if leaf.dim is None:
                continue
            old_cut, new_cut = self._cuts(index)
            for old in sorted(mine, key=lambda rank: position(leaf, self.old_world, rank)):
                if leaf.replicas == 1 and old >= old_cut:  # a replica: rank ``old % old_cut`` sends these
                    continue
                local = held[old].local(index)
                mine_at = position(leaf, self.old_world, old)
                start = rows_of(leaf, self.old_world).span(mine_at)[0]
                for piece in self._routes(index, mine_at).send:
                    rows = local.narrow(leaf.dim, piece.start - start, piece.rows)
                    raw = rows.contiguous().view(-1).view(torch.uint8)
                    for receiver in range(piece.peer, self.new_world, new_cut):
                        parts.setdefault(receiver, []).append(raw)
        for old in mine:  # its tree to every new rank whose source it is: old, old + W, ...
            rest = _pickled_rest(held[old])
            for receiver in range(old, self.new_world, self.old_world):
                parts.setdefault(receiver, []).append(rest)
        return dict(sorted(parts.items()))

    def incoming(self, me: int, part: Callable[[int], torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
        """``me``'s tree and its local value of every leaf, from what each sender sent it (``part``)."""
        cursors: dict[int, int] = {}
        pieces: dict[int, list[torch.Tensor]] = {}
        for index, leaf in enumerate(self.leaves):
            if leaf.dim is None:
                continue
            for piece in self._routes(index, me % self._cuts(index)[1]).receive:  # ascending old pieces
                sender = self._sender(rank_at(leaf, self.old_world, piece.peer))
                shape = list(leaf.shape)
                shape[leaf.dim] = piece.rows
                at = cursors.get(sender, 0)
                value, cursors[sender] = take(part(sender), at, shape, leaf.dtype, align=1)
                pieces.setdefault(index, []).append(value)
        sender = self._sender(self.source(me))
        tree, whole = pickle.loads(part(sender)[cursors.get(sender, 0) :].numpy().tobytes())
        values: list[torch.Tensor] = []
        for index, leaf in enumerate(self.leaves):
            if leaf.dim is None:
                values.append(whole[index])
            elif index in pieces:
                values.append(torch.cat(pieces[index], dim=leaf.dim))
            else:  # this rank's chunk is empty (more pieces than rows)
                cut = replace(leaf, shards=self._cuts(index)[1], replicas=1)
                values.append(torch.empty(local_shape(cut, self.new_world, me), dtype=leaf.dtype))
        return tree, values


def _pickled_rest(snapshot: RankSnapshot) -> torch.Tensor:
    """An old rank's tree and whole-held tensors, pickled into a uint8 tensor."""
    whole = {i: snapshot.local(i).clone() for i, leaf in enumerate(snapshot.leaves) if leaf.dim is None}
    data = pickle.dumps((snapshot.tree, whole), protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
