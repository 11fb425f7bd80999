"""Event trace of unshard, reshard and post-backward calls.

Owns: the ``Event`` record, the ``record_events()`` context manager and the cheap ``record`` call that
parameter groups make. Does not own: deciding when an event happens (the parameter group does).
Invariants: events land only in the sink of the thread that opened ``record_events()``; a backward
running on an autograd worker thread (CUDA) lands in the single process-wide recorder, if any.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch.distributed as dist

from ._autograd import in_backward_task_id
from ._lifecycle import TrainingState

EventKind = Literal["unshard", "reshard", "post_backward"]

_local = threading.local()
_process_sinks: list[list[Event]] = []
_process_lock = threading.Lock()


@dataclass(frozen=True)
class Event:
    """One recorded step of a parameter group.

    Attributes:
        kind: ``"unshard"`` when an all-gather is issued, ``"reshard"`` when the registered parameters
            change back to a sharded form, ``"post_backward"`` after the group's post-backward ran.
        module_fqn: the group's module name relative to the root (``""`` for the root, several
            modules joined by ``", "``).
        training_state: the group's training state when the event happened (after it, for
            ``"post_backward"``).
        time_us: when it happened, in microseconds of ``time.perf_counter`` (not compared).
    """

    kind: EventKind
    module_fqn: str
    training_state: TrainingState
    time_us: float = field(default=0.0, compare=False)

    def __str__(self) -> str:
        return f"{self.kind:13s} {self.module_fqn or '<root>'} ({self.training_state.name})"

    def as_tuple(self) -> tuple[str, str, str]:
        """Return ``(kind, module_fqn, training_state name)``, handy for comparisons in tests."""
        return (self.kind, self.module_fqn, self.training_state.name)


@contextmanager
def record_events() -> Iterator[list[Event]]:
    """Record this thread's FSDP events while the context is open.

    Yields:
        A list that fills with :class:`Event` objects in the order they happen.

    Example:
        >>> with fsdp2.record_events() as events:  # doctest: +SKIP
        ...     model(x).sum().backward()
        >>> [e.as_tuple() for e in events]  # doctest: +SKIP
    """
    events: list[Event] = []
    previous = getattr(_local, "sink", None)
    _local.sink = events
    with _process_lock:
        _process_sinks.append(events)
    try:
        yield events
    finally:
        _local.sink = previous
        with _process_lock:
            _process_sinks.remove(events)


def record(kind: EventKind, module_fqn: str, training_state: TrainingState) -> None:
    """Append an event to the active sink; costs one attribute lookup when nobody records."""
    sink = getattr(_local, "sink", None)
    if sink is None:
        if not _process_sinks or in_backward_task_id() == -1:
            return
        # An autograd worker thread (CUDA backward): attribute it only when unambiguous.
        if len(_process_sinks) != 1:
            return
        sink = _process_sinks[0]
    sink.append(Event(kind, module_fqn, training_state, time.perf_counter() * 1e6))


def save_chrome_trace(
    events: Iterable[Event], path: str | os.PathLike[str], *, rank: int | None = None
) -> None:
    """Write ``events`` as a Chrome trace (open it in ``chrome://tracing`` or https://ui.perfetto.dev).

    Each event is an instant marker on one track per module group, labelled with its kind and
    training state, so the unshard/reshard/reduce order of a step can be read off a timeline.

    Args:
        events: events from :func:`record_events`.
        path: the ``.json`` file to write.
        rank: the process id shown in the viewer (default: this rank if a process group exists).
    """
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    tracks: dict[str, int] = {}
    trace = []
    for event in events:
        name = event.module_fqn or "<root>"
        tid = tracks.setdefault(name, len(tracks))
        trace.append(
            {
                "name": f"{event.kind} ({event.training_state.name})",
                "ph": "i",
                "s": "t",
                "ts": event.time_us,
                "pid": rank,
                "tid": tid,
                "args": {"module": name, "training_state": event.training_state.name},
            }
        )
    names = [
        {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": module}}
        for module, tid in tracks.items()
    ]
    with open(path, "w") as f:
        json.dump({"traceEvents": names + trace, "displayTimeUnit": "ms"}, f)
