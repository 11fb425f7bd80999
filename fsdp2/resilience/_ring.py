"""Which rank keeps a copy of whose snapshot: each node's ranks send to the ranks of the next node.

Owns: ``Ring``, built from one key per rank naming the node it is on (its host and its snapshot
directory: two torchrun agents on one machine, each with its own directory, are two nodes). Nodes are
ordered by their lowest rank; the rank at position ``i`` of node ``k`` sends its snapshot to the rank at
position ``i`` (modulo its size) of node ``k + 1``, the last node to the first. With one node there is
no buddy: a snapshot survives a worker's loss but not the node's. Does not own the sending.

A ring is built in one pass over the keys (each rank's node number, in C); a rank's buddy, the ranks it
keeps copies for and its node's leader are then found from three nodes' members alone (its own, the
next and the previous), each a tensor comparison, and kept. ``buddy`` (every rank's) is computed only
when asked for.
"""

from __future__ import annotations

from functools import cache

import torch


class Ring:
    """The job's nodes and each rank's buddy (``None`` with a single node)."""

    def __init__(self, node_of: tuple[int, ...], nodes: int) -> None:
        self.node_of = node_of
        self.nodes = nodes
        self._node = torch.tensor(node_of, dtype=torch.int64)
        self.members = cache(self._members)  # a node's ranks, in order (only the nodes asked for)

    @classmethod
    def of(cls, keys: list[str]) -> Ring:
        """The ring of a job whose rank ``r`` runs on the node named ``keys[r]``."""
        number = {key: index for index, key in enumerate(dict.fromkeys(keys))}  # first appearance order
        return cls(tuple(map(number.__getitem__, keys)), len(number))

    def _members(self, node: int) -> tuple[int, ...]:
        return tuple((self._node == node).nonzero().flatten().tolist())

    def buddy_of(self, rank: int) -> int | None:
        """The rank that keeps a copy of ``rank``'s snapshot (``None`` with a single node)."""
        if self.nodes == 1:
            return None
        node = self.node_of[rank]
        position = self.members(node).index(rank)
        following = self.members((node + 1) % self.nodes)
        return following[position % len(following)]

    @property
    def buddy(self) -> tuple[int | None, ...]:
        """Every rank's buddy (a whole-job view, for tests and messages; O(world))."""
        return tuple(self.buddy_of(rank) for rank in range(len(self.node_of)))

    def kept_for(self, rank: int) -> list[int]:
        """The ranks whose snapshots ``rank`` keeps a copy of (from the previous node only)."""
        if self.nodes == 1:
            return []
        node = self.node_of[rank]
        mine, previous = self.members(node), self.members((node - 1) % self.nodes)
        position = mine.index(rank)
        return [source for index, source in enumerate(previous) if index % len(mine) == position]

    def is_leader(self, rank: int) -> bool:
        """Whether ``rank`` is its node's lowest rank (the one that tidies the node's directory)."""
        return self.members(self.node_of[rank])[0] == rank
