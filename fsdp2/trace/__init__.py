"""Floor 2: what a step leaves to read (events, timelines, reports, debug settings).

What a step leaves to read: the event recorder, timelines, the communication report, the straggler
report, and the debug-mode settings and collective watchdog. Imports ``base``.

Internal: fsdp2's public names are in ``fsdp2``; this face is for reading the architecture.
"""

from ._debug import set_debug
from ._events import Event, EventScope, Span, record_events, save_chrome_trace
from ._report import communication_report
from ._straggler import straggler_report
from ._timeline import merge_timelines, save_timeline

__all__ = [
    "Event",
    "EventScope",
    "Span",
    "communication_report",
    "merge_timelines",
    "record_events",
    "save_chrome_trace",
    "save_timeline",
    "set_debug",
    "straggler_report",
]
