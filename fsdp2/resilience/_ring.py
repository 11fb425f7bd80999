"""Which rank keeps a copy of whose snapshot: each node's ranks send to the ranks of the next node.

Owns: ``Ring``, built from one key per rank naming the node it is on (its host and its snapshot
directory: two torchrun agents on one machine, each with its own directory, are two nodes). Nodes are
ordered by their lowest rank; the rank at position ``i`` of node ``k`` sends its snapshot to the rank at
position ``i`` (modulo its size) of node ``k + 1``, the last node to the first. With one node there is
no buddy: a snapshot survives a worker's loss but not the node's. Does not own the sending.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ring:
    """The job's nodes and each rank's buddy (``None`` with a single node)."""

    node_of: tuple[int, ...]
    buddy: tuple[int | None, ...]

    @classmethod
    def of(cls, keys: list[str]) -> Ring:
        """The ring of a job whose rank ``r`` runs on the node named ``keys[r]``."""
        order: list[str] = []
        for key in keys:
            if key not in order:
                order.append(key)
        members = [[rank for rank, key in enumerate(keys) if key == node] for node in order]
        node_of = tuple(order.index(key) for key in keys)
        buddy: list[int | None] = []
        for rank in range(len(keys)):
            node = node_of[rank]
            if len(members) == 1:
                buddy.append(None)
                continue
            position = members[node].index(rank)
            following = members[(node + 1) % len(members)]
            buddy.append(following[position % len(following)])
        return cls(node_of, tuple(buddy))

    def kept_for(self, rank: int) -> list[int]:
        """The ranks whose snapshots ``rank`` keeps a copy of."""
        return [source for source, target in enumerate(self.buddy) if target == rank]

    def is_leader(self, rank: int) -> bool:
        """Whether ``rank`` is its node's lowest rank (the one that tidies the node's directory)."""
        return self.node_of.index(self.node_of[rank]) == rank
