"""A restart's choice: the newest snapshot whole on the surviving nodes, and which new rank reads what.

Owns: ``Choice`` (a step, its old world size and layout fingerprint, and the new rank that reads each
old rank's file, one tensor), ``choose`` (the choice, or why there is none: the old ranks that survive
nowhere named apart from those of which only damaged copies are left) and ``lines`` (damaged copies in
one line). Takes its reductions as a function (``Reduce``): an all-reduce on the snapshots' group in
``_restore``, threads in the tests. Does not own reading the files or moving the rows (``_restore``,
``_reshard``).

[Note: Choosing by tensors]
Every new rank lists its node's files (its own old rank's, and the copies its node keeps for the
previous node), so what one rank lists does not grow with the world, and the listings are never
gathered. From them:

- The candidates, newest first: a MAX all-reduce of the newest step among the keys (step, old world,
  layout fingerprint) each rank lists and has not found damaged, then one of ``world << 32 |
  fingerprint`` among that step's keys; the next candidate is the newest key below it. Two scalar
  all-reduces a candidate.
- The readers: for a candidate of ``W`` old ranks each rank writes, into ``W`` int64, a priority for
  each old rank it lists, and one MIN all-reduce keeps the lowest. An old rank listed by the new rank
  of its own number is read there (priority ``old``, below every other); else by the lister ``l`` of
  least ``(1 + (l - old) mod P) * N + l`` (``P``: the ranks on ``l``'s node, ``N``: the new ranks).
  Every rank of a buddy node lists the same copies, those of a node's ``P`` consecutive old ranks, so
  each of them reads one. The reader is the priority modulo ``N``; an old rank no rank lists keeps the
  sentinel, and the candidate is not whole: the next one is tried.
- Damaged copies matter only for the messages; the caller gathers their why-lines, as objects, only
  when some rank has found one (one flag all-reduce says so), so every rank has them all alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from ._store import Listed

Key = tuple[int, int, int]  # step, old world size, layout fingerprint
Reduce = Callable[[torch.Tensor, str], torch.Tensor]  # an all-reduce ("max" or "min"), its result
UNLISTED = 2**62  # the priority of an old rank no rank lists


@dataclass(frozen=True)
class Choice:
    """The snapshot to restore: its step, old world size, layout and ``holder[old]``, old rank's reader."""

    step: int
    old_world: int
    fingerprint: int
    holder: torch.Tensor  # int64, one per old rank

    def read_by(self, rank: int) -> list[int]:
        """The old ranks whose files ``rank`` reads, in ascending order."""
        return (self.holder == rank).nonzero().flatten().tolist()


def choose(
    listing: list[Listed],
    dropped: set[tuple[int, int]],
    broken: Mapping[tuple[int, int], list[str]],
    place: tuple[int, int, int],
    reduce: Reduce,
) -> Choice | str:
    """The newest snapshot every old rank of which some new rank lists, or why there is none.

    On every rank alike (see [Note: Choosing by tensors]). ``listing``: this rank's node's files;
    ``dropped``: the ``(step, old rank)`` copies this rank found damaged; ``broken[(step, old)]``: why
    each damaged copy of that old rank's file is (on every rank alike, for the messages);
    ``place``: this rank, the new world size and the ranks on this rank's node.
    """
    mine: dict[Key, list[int]] = {}
    for found in listing:
        if (found.step, found.rank) not in dropped:
            mine.setdefault((found.step, found.world, found.fingerprint), []).append(found.rank)
    why, key = "", _newest(list(mine), None, reduce)
    if key is None and broken:
        return f"every snapshot file found is damaged: {lines(broken.values())}"
    while key is not None:
        priority = reduce(_priorities(key[1], mine.get(key, []), place), "min")
        unlisted = priority == UNLISTED
        if not bool(unlisted.any()):
            return Choice(*key, priority.remainder(place[1]))
        why = why or _not_whole(key[0], key[1], unlisted.nonzero().flatten().tolist(), broken)
        key = _newest(list(mine), key, reduce)
    return why


def _newest(keys: list[Key], below: Key | None, reduce: Reduce) -> Key | None:
    """The newest key some rank lists below ``below`` (every key: ``None``), or ``None``: two all-reduces."""
    left = [key for key in keys if below is None or key < below]
    step = int(reduce(torch.tensor([max((key[0] for key in left), default=-1)]), "max"))
    if step < 0:
        return None
    rest = max(((world << 32) | print_ for at, world, print_ in left if at == step), default=-1)
    rest = int(reduce(torch.tensor([rest]), "max"))
    return step, rest >> 32, rest & 0xFFFFFFFF


def _priorities(world: int, olds: list[int], place: tuple[int, int, int]) -> torch.Tensor:
    """This rank's bid to read each of ``world`` old ranks (``UNLISTED`` where it lists none)."""
    me, ranks, per_node = place
    listed = torch.tensor(olds, dtype=torch.int64)
    bid = (1 + (me - listed).remainder(per_node)) * ranks + me
    out = torch.full((world,), UNLISTED, dtype=torch.int64)
    out[listed] = torch.where(listed == me, listed, bid)
    return out


def _not_whole(
    step: int, world: int, missing: list[int], damaged: Mapping[tuple[int, int], list[str]]
) -> str:
    broken = [old for old in missing if (step, old) in damaged]
    gone = [old for old in missing if (step, old) not in damaged]
    parts = []
    if gone:
        parts.append(
            f"survives nowhere for rank(s) {', '.join(map(str, gone))} (their node and their buddy's node "
            "are gone, or the snapshot was cut short)"
        )
    if broken:
        parts.append(
            f"has only damaged copies of rank(s) {', '.join(map(str, broken))} "
            f"({lines(damaged[(step, old)] for old in broken)})"
        )
    return f"the newest snapshot, step {step} of {world} ranks, {', and '.join(parts)}"


def lines(groups: Iterable[list[str]], shown: int = 2) -> str:
    """Damaged copies, one ``path: why`` each: the first ``shown`` of them, then how many more."""
    every = [line for group in groups for line in group]
    more = f"; and {len(every) - shown} more" if len(every) > shown else ""
    return "; ".join(every[:shown]) + more
