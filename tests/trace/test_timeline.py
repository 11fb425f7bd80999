"""Timelines: spans with durations, ``save_timeline`` (JSON and PNG) and ``merge_timelines``.

Two ranks (threads) record two training steps; every all-gather and reduce-scatter of every group
becomes a span with a duration and a memory sample, and the training thread's waits on them become
waits; the JSON is a valid trace with complete events (collectives and waits on separate tracks),
the PNG opens as an image, and merging keeps every rank.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

import fsdp2
from fsdp2.testing import run_ranks


def _record(rank: int, world_size: int, out: str) -> list[tuple[str, str, str]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))
    for layer in (model[0], model[2]):
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
    with fsdp2.record_events() as events:
        for _step in range(2):
            model(torch.randn(4, 8)).sum().backward()
    spans = events.spans
    assert all(s.end_us >= s.start_us for s in spans)
    assert all(s.memory_bytes is not None and s.memory_bytes > 0 for s in spans)  # RSS on Linux CPU
    fsdp2.save_timeline(events, f"{out}/rank{rank}.json")
    fsdp2.save_timeline(events, f"{out}/rank{rank}.png")
    return [(s.name, s.module_fqn, s.training_state.name) for s in spans]


def test_timeline_files(tmp_path: Path) -> None:
    spans = run_ranks(2, _record, str(tmp_path))
    counts = Counter((name, state) for name, _, state in spans[0])
    # Per step: 3 all-gathers in forward (two layers, the root), 2 in backward (the root keeps its
    # parameters), 3 reduce-scatters.
    assert counts == Counter(
        {
            ("all-gather", "FORWARD"): 6,
            ("all-gather", "PRE_BACKWARD"): 4,
            ("reduce-scatter", "POST_BACKWARD"): 6,
        }
    )
    trace = json.loads((tmp_path / "rank1.json").read_text())["traceEvents"]
    complete = [e for e in trace if e["ph"] == "X" and e["cat"] == "collectives"]
    assert len(complete) == 16
    assert all(e["dur"] >= 0 and e["pid"] == 1 for e in complete)
    assert {e["args"]["module"] for e in complete} == {"0", "2", "<root>"}
    # The waits, on tracks of their own: an all-gather's issue and its wait, a reduce-scatter's call.
    waits = [e for e in trace if e["ph"] == "X" and e["cat"] == "waits"]
    assert Counter(e["name"] for e in waits) == {"all-gather wait": 2 * 10, "reduce-scatter wait": 6}
    assert {e["tid"] for e in waits}.isdisjoint({e["tid"] for e in complete})
    assert sum(e["ph"] == "X" for e in trace) == 16 + 26
    assert any(e["ph"] == "C" and e["args"]["bytes"] > 0 for e in trace)  # the memory line
    png = (tmp_path / "rank0.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    import matplotlib.image

    assert matplotlib.image.imread(tmp_path / "rank0.png").ndim == 3
    fsdp2.merge_timelines([tmp_path / "rank0.json", tmp_path / "rank1.json"], tmp_path / "all.json")
    merged = json.loads((tmp_path / "all.json").read_text())["traceEvents"]
    assert {e["pid"] for e in merged} == {0, 1}
    assert sum(e["ph"] == "X" for e in merged) == 2 * (16 + 26)


def test_events_compare_like_plain_lists() -> None:
    def body(rank: int, world_size: int) -> bool:
        model = nn.Linear(4, 4)
        fsdp2.fully_shard(model)
        with fsdp2.record_events() as events:
            model(torch.ones(1, 4)).sum().backward()
        return next(e.as_tuple() for e in events) == ("unshard", "", "FORWARD") and isinstance(events, list)

    assert run_ranks(2, body) == [True, True]


def test_nested_recorders_and_filtered_lists(tmp_path: Path) -> None:
    def body(rank: int, world_size: int) -> tuple[int, int, int, int, int, int]:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        fsdp2.fully_shard(model[0])
        fsdp2.fully_shard(model)
        with fsdp2.record_events() as outer:
            model(torch.ones(1, 4)).sum().backward()
            with fsdp2.record_events() as inner:  # before: the outer list missed these
                model(torch.ones(1, 4)).sum().backward()
        assert outer[len(outer) - len(inner) :] == inner
        filtered = [e for e in outer if e.kind == "unshard"]
        with pytest.warns(UserWarning, match=r"carry no spans, so the timeline shows no durations"):
            fsdp2.save_timeline(filtered, tmp_path / f"filtered{rank}.json")
        return len(outer), len(inner), len(outer.spans), len(inner.spans), len(outer.waits), len(inner.waits)

    n_outer, n_inner, spans_outer, spans_inner, waits_outer, waits_inner = run_ranks(2, body)[0]
    assert n_outer == 2 * n_inner > 0
    assert spans_outer == 2 * spans_inner > 0
    assert waits_outer == 2 * waits_inner > 0
