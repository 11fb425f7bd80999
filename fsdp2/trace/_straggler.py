"""Which rank the others waited for: ``straggler_report``, read off every rank's recording.

Owns: ``straggler_report`` (one exchange of each rank's blocked stretches, then the same rows on every
rank), ``StragglerReport`` and ``StragglerRow``. Pure data processing over what ``record_events``
yielded, plus one ``all_gather_object``; nothing of the engine.

[Note: Attributing a wait]
Every rank issues the same FSDP collectives in the same order, so the i-th wait of every rank's
recording (``EventList.waits``: the stretches the training thread was blocked on a collective) is
the same collective. A collective cannot finish before its last rank arrives, so the rank that waited
least at it is the one the others waited for, and each other rank waited the difference. Only
durations on each rank's own clock are compared, never timestamps across hosts. The late rank's
lateness comes from its compute before the collective (or a slow link): the row names the group
whose collective it was.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["StragglerReport", "StragglerRow", "straggler_report"]

_NAMES = {"all-gather": "all_gather", "reduce-scatter": "reduce_scatter", "all-reduce": "all_reduce"}


@dataclass(frozen=True)
class StragglerRow:
    """The waits one rank caused at one group's collectives of one kind.

    Attributes:
        rank: the rank the others waited for (its rank in the process group of the report).
        module_fqn: the group whose collective it was late for (``""``: the root).
        collective: ``"all_gather"`` or ``"reduce_scatter"``.
        lag_s: seconds the other ranks waited for it there, averaged over them, summed over the
            recorded collectives.
        count: how many of those collectives it was the last to reach.
    """

    rank: int
    module_fqn: str
    collective: str
    lag_s: float
    count: int


@dataclass(frozen=True)
class StragglerReport:
    """The rows, largest ``lag_s`` first; ``str(report)`` is an aligned table."""

    rows: tuple[StragglerRow, ...]
    collectives: int  # the collectives compared (the shortest recording's count)

    def __str__(self) -> str:
        lines = [f"{'rank':>4}  {'module':<24} {'collective':<15} {'lag s':>8} {'count':>6}"]
        for row in self.rows:
            name = row.module_fqn or "<root>"
            lines.append(f"{row.rank:>4}  {name:<24} {row.collective:<15} {row.lag_s:>8.3f} {row.count:>6}")
        lines.append(f"({self.collectives} collectives compared)")
        return "\n".join(lines)


def straggler_report(events: Any, group: dist.ProcessGroup | None = None) -> StragglerReport:
    """Which rank the others waited for, at which module's collective, and for how long.

    Call it on every rank of ``group`` (default: all ranks) with what ``record_events()`` yielded
    there, over the same steps: it exchanges each rank's blocked stretches once and returns the same
    report everywhere. See [Note: Attributing a wait] in ``fsdp2/trace/_straggler.py``; no clock is
    compared across hosts.

    Args:
        events: the list ``record_events()`` yielded (its ``waits``).
        group: the process group of the ranks to compare (ranks of the report are ranks in it).

    Raises:
        TypeError: on every rank, when some rank passed something other than a recording (the ranks
            exchange what they were given first, so none is left waiting).

    Warns:
        RuntimeWarning: on every rank, when some rank's recording holds no collective waits (nothing
            can be compared; the report has no rows).
    """
    waits = getattr(events, "waits", None)
    problem = "" if waits is not None else type(events).__name__
    mine = [(w.name, w.module_fqn, (w.end_us - w.start_us) / 1e6) for w in waits or ()]
    everyone: list[Any] = [(problem, mine)]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, (problem, mine), group=group)
    wrong = {rank: entry[0] for rank, entry in enumerate(everyone) if entry[0]}
    if wrong:
        given = ", ".join(f"rank {rank}: {name}" for rank, name in wrong.items())
        raise TypeError(
            "straggler_report expects, on every rank, what fsdp2.record_events() yielded there; got "
            f"something else on {given}. Pass each rank's own recording."
        )
    empty = [rank for rank, entry in enumerate(everyone) if not entry[1]]
    if empty:
        warnings.warn(
            f"straggler_report: the recording of rank(s) {empty} holds no collective waits, so no collective "
            "can be compared. Record the same training steps under fsdp2.record_events() on every rank.",
            RuntimeWarning,
            stacklevel=2,
        )
    return attribute([entry[1] for entry in everyone])


def attribute(per_rank: Sequence[Sequence[tuple[str, str, float]]]) -> StragglerReport:
    """The report from each rank's ``(name, module, seconds blocked)`` in recording order."""
    count = min(len(waits) for waits in per_rank)
    sums: dict[tuple[int, str, str], list[float]] = {}
    for index in range(count):
        durations = [waits[index][2] for waits in per_rank]
        late = min(range(len(durations)), key=durations.__getitem__)
        others = [d - durations[late] for r, d in enumerate(durations) if r != late]
        if not others:
            continue
        name, module = per_rank[late][index][0], per_rank[late][index][1]
        entry = sums.setdefault((late, module, _NAMES.get(name, name)), [0.0, 0])
        entry[0] += sum(others) / len(others)
        entry[1] += 1
    rows = [StragglerRow(rank, module, kind, lag, int(n)) for (rank, module, kind), (lag, n) in sums.items()]
    rows.sort(key=lambda row: (-row.lag_s, row.rank, row.module_fqn, row.collective))
    return StragglerReport(tuple(rows), count)
