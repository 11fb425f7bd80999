"""Which rank keeps a copy of whose snapshot: each node's ranks send to the ranks of the next node.

Owns: ``Ring``, built from one key per rank naming the node it is on (its host and its snapshot
directory: two torchrun agents on one machine, each with its own directory, are two nodes), and
``key_hash`` (a key as one 64-bit integer, so that every rank's key travels in one tensor all-gather
rather than as pickled strings). Nodes are ordered by their lowest rank; the rank at position ``i`` of
node ``k`` sends its snapshot to the rank at position ``i`` (modulo its size) of node ``k + 1``, the
last node to the first. With one node there is no buddy: a snapshot survives a worker's loss but not
the node's. Does not own the sending.

A ring is built from the keys' hashes by tensor operations (unique, the first rank of each, their
order), with no Python pass over the ranks; a rank's buddy, the ranks it keeps copies for and its
node's leader are then found from three nodes' members alone (its own, the next and the previous),
each a tensor comparison, and kept. ``buddy`` and ``node_of`` (every rank's) are computed only when
asked for. Two keys with one hash (a chance of about ``nodes^2 / 2^65``) would make two nodes one.
"""

from __future__ import annotations

import hashlib
from functools import cache

import torch


def key_hash(key: str) -> int:
    """``key`` as a signed 64-bit integer (the first 8 bytes of its BLAKE2b digest)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little", signed=True)


class Ring:
    """The job's nodes and each rank's buddy (``None`` with a single node)."""

    def __init__(self, node: torch.Tensor, nodes: int) -> None:
        self._node = node  # every rank's node number (int64, one per rank)
        self.nodes = nodes
        self.members = cache(self._members)  # a node's ranks, in order (only the nodes asked for)

    @classmethod
    def of(cls, keys: list[str]) -> Ring:
        """The ring of a job whose rank ``r`` runs on the node named ``keys[r]``."""
        return cls.of_hashes(torch.tensor([key_hash(key) for key in keys], dtype=torch.int64))

    @classmethod
    def of_hashes(cls, hashes: torch.Tensor) -> Ring:
        """The ring of a job whose rank ``r``'s node key hashes to ``hashes[r]`` (see ``key_hash``)."""
        distinct, node_of_distinct = torch.unique(hashes, return_inverse=True)
        ranks = torch.arange(hashes.numel(), dtype=torch.int64)
        first = torch.full((distinct.numel(),), hashes.numel(), dtype=torch.int64)
        first = first.scatter_reduce(0, node_of_distinct, ranks, reduce="amin")  # each node's lowest rank
        number = torch.empty_like(first)
        number[torch.argsort(first)] = torch.arange(first.numel(), dtype=torch.int64)  # by lowest rank
        return cls(number[node_of_distinct], int(distinct.numel()))

    def node(self, rank: int) -> int:
        """The node ``rank`` is on (nodes numbered by their lowest rank)."""
        return int(self._node[rank])

    @property
    def node_of(self) -> tuple[int, ...]:
        """Every rank's node (a whole-job view, for tests and messages; O(world))."""
        return tuple(self._node.tolist())

    def _members(self, node: int) -> tuple[int, ...]:
        return tuple((self._node == node).nonzero().flatten().tolist())

    def buddy_of(self, rank: int) -> int | None:
        """The rank that keeps a copy of ``rank``'s snapshot (``None`` with a single node)."""
        if self.nodes == 1:
            return None
        node = self.node(rank)
        position = self.members(node).index(rank)
        following = self.members((node + 1) % self.nodes)
        return following[position % len(following)]

    @property
    def buddy(self) -> tuple[int | None, ...]:
        """Every rank's buddy (a whole-job view, for tests and messages; O(world))."""
        return tuple(self.buddy_of(rank) for rank in range(self._node.numel()))

    def kept_for(self, rank: int) -> list[int]:
        """The ranks whose snapshots ``rank`` keeps a copy of (from the previous node only)."""
        if self.nodes == 1:
            return []
        node = self.node(rank)
        mine, previous = self.members(node), self.members((node - 1) % self.nodes)
        position = mine.index(rank)
        return [source for index, source in enumerate(previous) if index % len(mine) == position]

    def is_leader(self, rank: int) -> bool:
        """Whether ``rank`` is its node's lowest rank (the one that tidies the node's directory)."""
        return self.members(self.node(rank))[0] == rank
