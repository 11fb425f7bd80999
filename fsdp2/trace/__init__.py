"""Floor 2: what a step leaves to read (events, timelines, reports, debug settings).

What a step leaves to read: the event recorder, timelines, the communication report, the straggler
report, and the debug-mode settings and collective watchdog. Imports ``base``.

The face: ``__all__`` is what the rooms above may use, and they import nothing else of this room
(``tests/house/test_layering.py`` checks). fsdp2's public names are in ``fsdp2``.
"""

from ._debug import (
    DEBUG,
    NOT_WATCHED,
    check_environment,
    check_same_model,
    debug_enabled,
    guard_timeout,
    replica_check_every,
    run_root_init_hooks,
    set_debug,
    straggler_check_steps,
    straggler_fraction,
    watch_collective,
)
from ._events import (
    RECORDING,
    Event,
    EventScope,
    GpuTiming,
    Span,
    record,
    record_events,
    save_chrome_trace,
    span_end,
    span_start,
    wait_end,
)
from ._report import communication_report
from ._straggler import attribute, straggler_report
from ._timeline import merge_timelines, save_timeline

__all__ = [
    "DEBUG",
    "NOT_WATCHED",
    "RECORDING",
    "Event",
    "EventScope",
    "GpuTiming",
    "Span",
    "attribute",
    "check_environment",
    "check_same_model",
    "communication_report",
    "debug_enabled",
    "guard_timeout",
    "merge_timelines",
    "record",
    "record_events",
    "replica_check_every",
    "run_root_init_hooks",
    "save_chrome_trace",
    "save_timeline",
    "set_debug",
    "span_end",
    "span_start",
    "straggler_check_steps",
    "straggler_fraction",
    "straggler_report",
    "wait_end",
    "watch_collective",
]
