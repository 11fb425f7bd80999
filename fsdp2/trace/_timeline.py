"""Timelines of recorded steps: a Perfetto/Chrome JSON with durations, a PNG, and merged ranks.

Owns: ``save_timeline`` (``.json``: complete events with durations per module group, the waits on
them (category ``waits``) on a track of their own per group, instant events for
unshard/reshard/post-backward, a memory counter; ``.png``: one row per group, bars for the
collectives with the waits hatched red on them, a memory line) and ``merge_timelines`` (several
ranks' JSON files into one, a process per rank). Does not own: recording (``_events``).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch.distributed as dist

from ._events import Event, Span, chrome_marker, chrome_track_names, write_chrome_trace

_COLORS = {"all-gather": "tab:blue", "reduce-scatter": "tab:orange"}


def save_timeline(events: Iterable[Event], path: str | os.PathLike[str], *, rank: int | None = None) -> None:
    """Write the recorded step(s) as a timeline: a PNG picture or a Perfetto/Chrome JSON trace.

    Args:
        events: the list :func:`record_events` yielded (its ``spans`` give the durations, its
            ``waits`` the time the training thread was blocked on them).
        path: ends in ``.png`` (needs matplotlib) or ``.json`` (open in https://ui.perfetto.dev or
            ``chrome://tracing``).
        rank: the rank shown (default: this process's rank, or 0).

    Raises:
        ValueError: ``path`` ends in neither ``.png`` nor ``.json``.
        ImportError: a PNG without matplotlib installed.
    """
    path = os.fspath(path)
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if not path.endswith((".json", ".png")):
        raise ValueError(f"save_timeline writes .png or .json files, got {path!r}.")
    if not hasattr(events, "spans"):
        warnings.warn(
            "save_timeline: these events carry no spans, so the timeline shows no durations (only "
            "markers). The spans ride on the list record_events() yielded; a filtered copy (a list "
            "comprehension) drops them. Pass that list, or copy its .spans onto the filtered one.",
            stacklevel=2,
        )
    events = list(events) if not isinstance(events, list) else events
    spans: list[Span] = list(getattr(events, "spans", []))
    waits: list[Span] = list(getattr(events, "waits", []))
    if path.endswith(".json"):
        write_chrome_trace(path, _trace_events(events, spans, rank) + _wait_events(waits, rank))
    else:
        _save_png(events, spans, waits, path, rank)


def merge_timelines(paths: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str]) -> None:
    """Merge several ranks' JSON timelines (from :func:`save_timeline`) into one file, a process per rank.

    Each input keeps its own process id (its rank), so one Perfetto view shows every rank's rows.
    """
    merged: list[dict[str, Any]] = []
    for path in paths:
        with open(path) as f:
            merged.extend(json.load(f)["traceEvents"])
    write_chrome_trace(out, merged)


def _trace_events(events: Sequence[Event], spans: Sequence[Span], rank: int) -> list[dict[str, Any]]:
    tracks: dict[str, int] = {}

    def tid(module_fqn: str) -> int:
        return tracks.setdefault(module_fqn or "<root>", len(tracks))

    trace: list[dict[str, Any]] = []
    for span in spans:
        trace.append(
            {
                "name": span.name,
                "cat": "collectives",
                "ph": "X",
                "ts": span.start_us,
                "dur": max(span.end_us - span.start_us, 0.0),
                "pid": rank,
                "tid": tid(span.module_fqn),
                "args": {"module": span.module_fqn or "<root>", "training_state": span.training_state.name},
            }
        )
        if span.memory_bytes is not None:
            trace.append(
                {
                    "name": "memory",
                    "ph": "C",
                    "ts": span.end_us,
                    "pid": rank,
                    "args": {"bytes": span.memory_bytes},
                }
            )
    trace.extend(chrome_marker(event, rank, tid(event.module_fqn)) for event in events)
    names = chrome_track_names(tracks, rank)
    process = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}]
    return process + names + trace


def _wait_events(waits: Sequence[Span], rank: int) -> list[dict[str, Any]]:
    """The waits as complete events on one track per group, beside the group's own (ids from 1000).

    A track of their own: a wait that covers its whole span (a synchronous reduce-scatter) would
    otherwise hide behind it, and a track of waits alone reads as "where this group held training up".
    """
    tracks: dict[str, int] = {}
    trace: list[dict[str, Any]] = []
    for wait in waits:
        module = wait.module_fqn or "<root>"
        tid = tracks.setdefault(module, 1000 + len(tracks))
        trace.append(
            {
                "name": f"{wait.name} wait",
                "cat": "waits",
                "ph": "X",
                "ts": wait.start_us,
                "dur": max(wait.end_us - wait.start_us, 0.0),
                "pid": rank,
                "tid": tid,
                "args": {"module": module, "training_state": wait.training_state.name},
            }
        )
    names = [
        {"name": "thread_name", "ph": "M", "pid": rank, "tid": t, "args": {"name": f"{module} (waits)"}}
        for module, t in tracks.items()
    ]
    return names + trace


def _save_png(
    events: Sequence[Event], spans: Sequence[Span], waits: Sequence[Span], path: str, rank: int
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("save_timeline(..., '*.png') needs matplotlib: pip install matplotlib") from exc
    times = [s.start_us for s in spans] + [e.time_us for e in events]
    origin = min(times) if times else 0.0
    rows: dict[str, int] = {}
    for name in [s.module_fqn for s in spans] + [e.module_fqn for e in events]:
        rows.setdefault(name or "<root>", len(rows))
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.5 * max(len(rows), 1)))
    for span in spans:
        row = rows[span.module_fqn or "<root>"]
        start, width = (span.start_us - origin) / 1e3, max(span.end_us - span.start_us, 1.0) / 1e3
        ax.broken_barh([(start, width)], (row - 0.35, 0.7), color=_COLORS.get(span.name, "tab:gray"))
    for wait in waits:  # the blocked part, over the lower half of its group's bar
        row = rows.setdefault(wait.module_fqn or "<root>", len(rows))
        start, width = (wait.start_us - origin) / 1e3, max(wait.end_us - wait.start_us, 1.0) / 1e3
        box = (row - 0.35, 0.35)
        ax.broken_barh([(start, width)], box, facecolor="none", edgecolor="tab:red", hatch="///")
    for event in events:
        row = rows[event.module_fqn or "<root>"]
        marker = {"unshard": "v", "reshard": "^", "post_backward": "o"}[event.kind]
        ax.plot([(event.time_us - origin) / 1e3], [row], marker=marker, color="black", markersize=4)
    ax.set_yticks(list(rows.values()), list(rows))
    ax.set_xlabel("time (ms)")
    ax.set_title(
        f"rank {rank}: all-gathers (blue), reduce-scatters (orange), waited on (red hatch); "
        "v unshard, ^ reshard, o post-backward"
    )
    memory = [(s.end_us, s.memory_bytes) for s in spans if s.memory_bytes is not None]
    if memory:
        twin = ax.twinx()
        twin.plot([(t - origin) / 1e3 for t, _ in memory], [m / 2**20 for _, m in memory], color="tab:green")
        twin.set_ylabel("memory (MiB)", color="tab:green")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
