"""Event trace of unshard, reshard and post-backward calls.

Owns: the ``Event`` record, the ``record_events()`` context manager, ``EventScope`` (which recorder a
root's backward reports to) and the cheap ``record`` call that parameter groups make. Does not own:
deciding when an event happens (the parameter group does).
Invariants: an event lands only in a recorder opened by the thread whose step produced it: the calling
thread's own recorder, or, for a backward that autograd runs on a worker thread (CUDA), the recorder
that thread had open when the root's forward started. There is no process-wide fallback, so ranks that
are threads of one process never see each other's events.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from ..base import TrainingState, in_backward_task_id

EventKind = Literal["unshard", "reshard", "post_backward"]

_local = threading.local()


class _Switch:
    """How many ``record_events()`` blocks are open, in every thread (the engine's one check).

    While it reads 0 nothing records anywhere, so the engine's hot path skips its event calls with
    one attribute read (``if RECORDING.on:``) instead of calling into this module.
    """

    __slots__ = ("lock", "on")

    def __init__(self) -> None:
        self.on = 0
        self.lock = threading.Lock()


RECORDING = _Switch()


class EventList(list["Event"]):
    """The list ``record_events()`` yields: the events, plus ``spans`` and ``waits``.

    ``spans`` are collectives from issue to a usable result; ``waits`` the stretches within them in
    which the training thread was blocked on one (see :func:`communication_report`).
    """

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[Span] = []
        self.waits: list[Span] = []


class _Recorder:
    """One open ``record_events()`` context: its list, and whether it still accepts events.

    ``outer`` is the context it is nested in, which records the same events (an inner block does not
    take them away from the outer one).
    """

    __slots__ = ("events", "open", "outer")

    def __init__(self, outer: _Recorder | None) -> None:
        self.events = EventList()
        self.open = True
        self.outer = outer

    def _open(self) -> Iterator[_Recorder]:
        """This recorder and the ones it is nested in that are still open."""
        recorder: _Recorder | None = self
        while recorder is not None:
            if recorder.open:
                yield recorder
            recorder = recorder.outer

    def add_event(self, event: Event) -> None:
        for recorder in self._open():
            recorder.events.append(event)

    def add_span(self, span: Span) -> None:
        for recorder in self._open():
            recorder.events.spans.append(span)

    def add_wait(self, wait: Span) -> None:
        for recorder in self._open():
            recorder.events.waits.append(wait)


def _thread_recorder() -> _Recorder | None:
    recorder: _Recorder | None = getattr(_local, "recorder", None)
    return recorder


class EventScope:
    """Where the events of one root's backward go when autograd runs it on another thread.

    The root captures the calling thread's recorder when an iteration's forward starts; a backward
    event raised on a thread with no recorder of its own (the CUDA autograd worker) goes there, if that
    recorder is still open. One scope per root, shared by all its groups.
    """

    __slots__ = ("_captured",)

    def __init__(self) -> None:
        self._captured: _Recorder | None = None

    def capture(self) -> None:
        """Remember the calling thread's recorder (``None`` if it records nothing)."""
        self._captured = _thread_recorder()

    def backward_recorder(self) -> _Recorder | None:
        captured = self._captured
        return captured if captured is not None and captured.open else None


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


class GpuTiming:
    """CUDA timing events of one all-gather on the side streams, recorded only while recording.

    ``began``/``ended``: on the all-gather stream around the collective (``None`` for a bucket's
    all-gather, issued elsewhere); ``before``/``after``: on the compute stream around its wait for the
    all-gather. Read lazily, after synchronizing with the event read last.
    """

    __slots__ = ("after", "before", "began", "ended")

    def __init__(self, began: torch.cuda.Event | None, ended: torch.cuda.Event | None) -> None:
        self.began, self.ended = began, ended
        self.before: torch.cuda.Event | None = None
        self.after: torch.cuda.Event | None = None

    def collective_us(self) -> float | None:
        """µs the collective ran on its stream (``None`` if not timed)."""
        if self.began is None or self.ended is None:
            return None
        self.ended.synchronize()
        return float(self.began.elapsed_time(self.ended)) * 1e3

    def stall_us(self) -> float | None:
        """µs the compute stream stalled waiting for the all-gather (``None`` if not timed)."""
        if self.before is None or self.after is None:
            return None
        self.after.synchronize()
        return float(self.before.elapsed_time(self.after)) * 1e3


@dataclass(frozen=True)
class Span:
    """A stretch of time of one group: a collective from issue to completion, or a wait on one.

    In ``spans`` a span runs from the collective's issue to its result being usable; in ``waits``, from
    the training thread entering a call that blocks on the collective (the issue of a synchronous one,
    the wait and copy-out of an asynchronous or prefetched one) to its return.

    Attributes:
        name: ``"all-gather"`` (issue to copy-out done) or ``"reduce-scatter"`` (packing to the
            sharded gradients assigned; an HSDP replica all-reduce is part of it).
        module_fqn: the group's module name (``""`` for the root).
        training_state: the group's training state when it started.
        start_us: start, in microseconds of ``time.perf_counter``.
        end_us: end, same clock.
        memory_bytes: memory in use at the end: ``torch.cuda.memory_allocated()`` on CUDA, the
            process's resident set size on CPU (Linux), else ``None`` (always ``None`` for a wait).
        gpu: for an all-gather on CUDA side streams while recording, its timing events (see
            ``duration_us`` and ``exposed_us``), else ``None``.
    """

    name: str
    module_fqn: str
    training_state: TrainingState
    start_us: float
    end_us: float
    memory_bytes: int | None = None
    gpu: GpuTiming | None = field(default=None, compare=False, repr=False)

    def duration_us(self) -> float:
        """A span's duration in µs: ``end_us - start_us`` on the host.

        On CUDA side streams, the collective's own time on its stream where it was timed (this
        synchronizes with its events).
        """
        timed = self.gpu.collective_us() if self.gpu is not None else None
        return max(self.end_us - self.start_us, 0.0) if timed is None else timed

    def exposed_us(self) -> float:
        """A wait's exposed time in µs: the host's blocked time ``end_us - start_us``.

        On CUDA side streams, the compute stream's stall on the all-gather (this synchronizes with its
        events).
        """
        timed = self.gpu.stall_us() if self.gpu is not None else None
        return max(self.end_us - self.start_us, 0.0) if timed is None else timed


def span_start(scope: EventScope | None) -> float | None:
    """The start time of a span if the calling thread's step is being recorded, else ``None`` (cheap)."""
    if getattr(_local, "recorder", None) is None and (scope is None or scope.backward_recorder() is None):
        return None
    return time.perf_counter() * 1e6


def _recorder_for(scope: EventScope | None) -> _Recorder | None:
    recorder: _Recorder | None = getattr(_local, "recorder", None)
    if recorder is None and scope is not None:
        recorder = scope.backward_recorder()
    return recorder


def span_end(
    start: float | None,
    name: str,
    module_fqn: str,
    state: TrainingState,
    scope: EventScope | None,
    waited: float | None = None,
    gpu: GpuTiming | None = None,
) -> None:
    """Record the span begun at ``start`` (a no-op when ``start`` is ``None``).

    ``waited``: the training thread was blocked on this collective from then until now (a wait is
    recorded too); pass ``start`` for a collective issued and finished in one blocking call.
    ``gpu``: CUDA, the all-gather's timing events (its time on its stream, the compute stream's stall).
    """
    if start is None:
        return
    recorder = _recorder_for(scope)
    if recorder is None:
        return
    end = time.perf_counter() * 1e6
    recorder.add_span(Span(name, module_fqn, state, start, end, _memory_bytes(), gpu))
    if waited is not None:
        recorder.add_wait(Span(name, module_fqn, state, waited, end, gpu=gpu))


def wait_end(
    start: float | None,
    name: str,
    module_fqn: str,
    state: TrainingState,
    scope: EventScope | None,
    end: float | None = None,
) -> None:
    """Record that the training thread was blocked on a collective from ``start`` until ``end`` (now).

    A no-op when ``start`` is ``None`` (nobody records); ``start`` comes from :func:`span_start`.
    """
    if start is None:
        return
    recorder = _recorder_for(scope)
    if recorder is not None:
        stop = time.perf_counter() * 1e6 if end is None else end
        recorder.add_wait(Span(name, module_fqn, state, start, stop))


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _memory_bytes() -> int | None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.memory_allocated())
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE_SIZE
    except (OSError, IndexError, ValueError):
        return None


@contextmanager
def record_events() -> Iterator[EventList]:
    """Record the FSDP events of the calling thread's steps while the context is open.

    Events of other threads (other ranks, when ranks are threads of one process) never land here; a
    nested ``record_events()`` block records its events in the enclosing lists too. A
    backward that autograd runs on a worker thread (CUDA) reports to the recorder that was open when
    the root's forward started, so open the context around forward and backward together.

    Yields:
        A list that fills with :class:`Event` objects in the order they happen; its ``spans``
        attribute fills with :class:`Span` objects (collectives with durations) and its ``waits``
        with the stretches the training thread was blocked on them, for :func:`save_timeline` and
        :func:`communication_report`.

    Example:
        >>> with fsdp2.record_events() as events:  # doctest: +SKIP
        ...     model(x).sum().backward()
        >>> [e.as_tuple() for e in events]  # doctest: +SKIP
    """
    previous = _thread_recorder()
    recorder = _Recorder(previous)
    _local.recorder = recorder
    with RECORDING.lock:
        RECORDING.on += 1
    try:
        yield recorder.events
    finally:
        recorder.open = False
        _local.recorder = previous
        with RECORDING.lock:
            RECORDING.on -= 1


def record(
    kind: EventKind, module_fqn: str, training_state: TrainingState, scope: EventScope | None = None
) -> None:
    """Append an event for the calling thread's step; costs one attribute lookup when nobody records."""
    recorder = getattr(_local, "recorder", None)
    if recorder is None:
        if scope is None or in_backward_task_id() == -1:
            return
        recorder = scope.backward_recorder()
        if recorder is None:
            return
    recorder.add_event(Event(kind, module_fqn, training_state, time.perf_counter() * 1e6))


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
    trace = [
        chrome_marker(event, rank, tracks.setdefault(event.module_fqn or "<root>", len(tracks)))
        for event in events
    ]
    write_chrome_trace(path, chrome_track_names(tracks, rank) + trace)


# ---- the Chrome-trace format, shared with save_timeline ---------------------------------------------


def chrome_marker(event: Event, rank: int, tid: int) -> dict[str, Any]:
    """``event`` as an instant marker on track ``tid`` of process ``rank``."""
    module = event.module_fqn or "<root>"
    state = event.training_state.name
    return {
        "name": f"{event.kind} ({state})",
        "ph": "i",
        "s": "t",
        "ts": event.time_us,
        "pid": rank,
        "tid": tid,
        "args": {"module": module, "training_state": state},
    }


def chrome_track_names(tracks: Mapping[str, int], rank: int) -> list[dict[str, Any]]:
    """The metadata entries that name each track (``{name: tid}``) of process ``rank``."""
    return [
        {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}}
        for name, tid in tracks.items()
    ]


def write_chrome_trace(path: str | os.PathLike[str], trace: list[dict[str, Any]]) -> None:
    """Write ``trace`` (Chrome-trace entries) as one JSON file."""
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)
