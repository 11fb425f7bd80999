"""Exposed communication per group, read off a recording: no profiler involved.

Owns: ``communication_report`` (the recorded spans and waits of :func:`record_events`, summed per group
and collective), ``CommunicationReport`` (its rows, the total, the printed table) and
``CommunicationRow``. Does not own: recording (``_events``), pictures (``_timeline``). Pure data
processing: it reads what ``record_events`` yielded and nothing of the engine.

[Note: Total and exposed time]
``total_s`` sums each collective's span, from its issue to its result being usable (the copy-out of
an all-gather done, a reduce-scatter's sharded gradients assigned). ``exposed_s`` sums the stretches
within those spans during which the training thread was blocked on the collective: inside the call
that issued it (a synchronous collective runs there), and inside the wait and copy-out before its
result was used. ``total_s - exposed_s`` is the time the collective was in flight, or its result
ready, while the thread did other work: what prefetching hid. A collective issued and finished in one
blocking call is exposed for its whole span. On CUDA the host does not block on the side streams: there
an all-gather's total is its time on the all-gather stream and its wait counts the time the compute
stream stalled on it (timing events around the collective and around the compute stream's wait for
it, read when the report is made); a bucket's all-gather keeps the host span, and the issuing call
and the reduce-scatters count host time (launches, copy-in). The compute stream's wait for the
reductions at the end of backward is not measured.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ._events import Event

__all__ = ["CommunicationReport", "CommunicationRow", "communication_report"]

# Span names as recorded, and the names the report gives them.
_COLLECTIVES = {"all-gather": "all_gather", "reduce-scatter": "reduce_scatter", "all-reduce": "all_reduce"}


@dataclass(frozen=True)
class CommunicationRow:
    """One group's collectives of one kind over the recorded steps.

    Attributes:
        module_fqn: the group's module name (``""`` for the root; ``"(all)"`` in the total row).
        collective: ``"all_gather"``, ``"reduce_scatter"`` (an HSDP replica all-reduce is part of
            its reduce-scatter), or ``"all"`` in the total row.
        count: how many were recorded.
        total_s: seconds from issue to a usable result, summed (see :func:`communication_report`).
        exposed_s: seconds the training thread was blocked on them, summed.
    """

    module_fqn: str
    collective: str
    count: int
    total_s: float
    exposed_s: float

    @property
    def hidden_s(self) -> float:
        """Seconds of ``total_s`` the thread spent on other work (prefetching hid them)."""
        return max(self.total_s - self.exposed_s, 0.0)

    @property
    def exposed_fraction(self) -> float:
        """``exposed_s / total_s`` (0 for no time)."""
        return self.exposed_s / self.total_s if self.total_s > 0 else 0.0


@dataclass(frozen=True)
class CommunicationReport:
    """Communication per group and collective; ``str(report)`` is an aligned table.

    Attributes:
        rows: one row per (group, collective), in the order the groups first communicated.
        steps: backward passes recorded (forward passes where no backward was recorded).
    """

    rows: tuple[CommunicationRow, ...]
    steps: int

    @property
    def total(self) -> CommunicationRow:
        """Every row summed (``module_fqn="(all)"``, ``collective="all"``)."""
        return CommunicationRow(
            "(all)",
            "all",
            sum(r.count for r in self.rows),
            sum(r.total_s for r in self.rows),
            sum(r.exposed_s for r in self.rows),
        )

    def row(self, module_fqn: str, collective: str) -> CommunicationRow:
        """The row of one group's collective (``module_fqn=""`` for the root).

        Raises:
            KeyError: nothing of that group and collective was recorded; the message lists the rows.
        """
        for row in self.rows:
            if row.module_fqn == module_fqn and row.collective == collective:
                return row
        known = ", ".join(f"({r.module_fqn!r}, {r.collective!r})" for r in self.rows) or "none"
        raise KeyError(f"no {collective!r} recorded for module {module_fqn!r}; the rows are: {known}")

    def __str__(self) -> str:
        header = ("module", "collective", "count", "total ms", "exposed ms", "exposed %")
        body = [_cells(r, r.module_fqn or "<root>") for r in self.rows]
        total = _cells(self.total, "total")
        widths = [max(len(line[i]) for line in [header, *body, total]) for i in range(len(header))]

        def line(cells: tuple[str, ...]) -> str:
            left = [c.ljust(w) for c, w in zip(cells[:2], widths[:2], strict=True)]
            right = [c.rjust(w) for c, w in zip(cells[2:], widths[2:], strict=True)]
            return "  ".join(left + right).rstrip()

        rule = "-" * len(line(header))
        title = f"Communication per group over {self.steps} step{'s' if self.steps != 1 else ''}"
        return "\n".join([title, line(header), rule, *map(line, body), rule, line(total)])


def _cells(row: CommunicationRow, name: str) -> tuple[str, ...]:
    percent = f"{100 * row.exposed_fraction:.0f}%" if row.total_s > 0 else "-"
    return (
        name,
        row.collective,
        str(row.count),
        f"{row.total_s * 1e3:.2f}",
        f"{row.exposed_s * 1e3:.2f}",
        percent,
    )


def communication_report(events: Iterable[Event]) -> CommunicationReport:
    """Sum the recorded collectives per group: how long they took, and how long compute waited.

    Args:
        events: the list :func:`record_events` yielded (its ``spans`` and ``waits`` are read).

    Returns:
        A :class:`CommunicationReport`: a row per group and collective with ``count``, ``total_s``
        (issue to usable result) and ``exposed_s`` (time the training thread was blocked on them);
        ``total_s - exposed_s`` is what overlapped other work. ``print(report)`` shows a table.

    Raises:
        TypeError: ``events`` is not a recording (a filtered copy of one loses its spans and waits).

    Example:
        >>> with fsdp2.record_events() as events:  # doctest: +SKIP
        ...     model(x).sum().backward()
        >>> print(fsdp2.communication_report(events))  # doctest: +SKIP
    """
    spans = getattr(events, "spans", None)
    waits = getattr(events, "waits", None)
    if not isinstance(spans, list) or not isinstance(waits, list):
        raise TypeError(
            "communication_report needs the list record_events() yielded, which carries the recorded "
            f"spans and waits; got {type(events).__name__}. Record with `with fsdp2.record_events() as "
            "events:` and pass `events` itself (a filtered copy, e.g. a list comprehension, drops them)."
        )
    sums: dict[tuple[str, str], _Sums] = {}  # by (module_fqn, span name)
    for span in spans:
        acc = sums.setdefault((span.module_fqn, span.name), _Sums(span.start_us))
        acc.add(span.start_us, span.start_us + span.duration_us(), exposed=False)
    for wait in waits:
        acc = sums.setdefault((wait.module_fqn, wait.name), _Sums(wait.start_us))
        acc.add(wait.start_us, wait.start_us + wait.exposed_us(), exposed=True)
    group_start: dict[str, float] = {}  # rows follow the order in which groups first communicated
    for (fqn, _), acc in sums.items():
        group_start[fqn] = min(group_start.get(fqn, acc.first_us), acc.first_us)
    order = sorted(sums, key=lambda key: (group_start[key[0]], sums[key].first_us))
    rows = tuple(sums[key].row(*key) for key in order)
    return CommunicationReport(rows, _steps(events))


@dataclass
class _Sums:
    """What one group's collectives of one kind add up to, while reading a recording."""

    first_us: float  # the earliest start seen
    count: int = 0
    total_us: float = 0.0
    exposed_us: float = 0.0

    def add(self, start_us: float, end_us: float, exposed: bool) -> None:
        self.first_us = min(self.first_us, start_us)
        if exposed:
            self.exposed_us += max(end_us - start_us, 0.0)
        else:
            self.count += 1
            self.total_us += max(end_us - start_us, 0.0)

    def row(self, module_fqn: str, name: str) -> CommunicationRow:
        collective = _COLLECTIVES.get(name, name.replace("-", "_"))
        # On CUDA the compute stream's stall can outlast the collective's own time on its stream (it
        # also waits for work queued on that stream before it); count the collective as long as that.
        seconds = (max(self.total_us, self.exposed_us) / 1e6, self.exposed_us / 1e6)
        return CommunicationRow(module_fqn, collective, self.count, *seconds)


def _steps(events: Iterable[Event]) -> int:
    backward: dict[str, int] = {}
    forward: dict[str, int] = {}
    for event in events:
        if event.kind == "post_backward":
            backward[event.module_fqn] = backward.get(event.module_fqn, 0) + 1
        elif event.kind == "unshard" and event.training_state.name == "FORWARD":
            forward[event.module_fqn] = forward.get(event.module_fqn, 0) + 1
    return max(backward.values(), default=0) or max(forward.values(), default=0)
