"""Event trace of unshard, reshard and post-backward calls.

Owns: the ``Event`` record, the ``record_events()`` context manager and the cheap ``record`` call that
parameter groups make. Does not own: deciding when an event happens (the parameter group does).
Invariants: events land only in the sink of the thread that opened ``record_events()``; a backward
running on an autograd worker thread (CUDA) lands in the single process-wide recorder, if any.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

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
    """

    kind: EventKind
    module_fqn: str
    training_state: TrainingState

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
    sink.append(Event(kind, module_fqn, training_state))
