"""``fsdp2.straggler_report``: the rank the others waited for, found from each rank's own durations.

Rank 1 sleeps inside one block's forward every step; the others then wait for it at the next
collective. The reference is what the test did: rank 1, about the sleep per step, named on every rank
(the same rows everywhere). The bounds are wide: the machine may be loaded.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fsdp2
from fsdp2.trace._debug import debug_enabled
from fsdp2.trace._straggler import attribute
from tests._harness import run_threaded
from tests.models import sharded_sleepy_chain

SLEEP_S = 0.2


def _run() -> tuple[str, list[tuple[int, str, str, float, int]]]:
    model = sharded_sleepy_chain(SLEEP_S)
    x = torch.ones(2, 8)
    model(x).sum().backward()  # lazy init, outside the recording
    with fsdp2.record_events() as events:
        for _ in range(3):
            model(x).sum().backward()
    report = fsdp2.straggler_report(events)
    rows = [(r.rank, r.module_fqn, r.collective, r.lag_s, r.count) for r in report.rows]
    return str(report), rows


def test_the_sleeping_rank_is_named_on_every_rank() -> None:
    (text, rows), (_, other_rows) = run_threaded(2, _run)
    assert rows == other_rows  # the same report everywhere
    top = rows[0]
    assert top[0] == 1  # the sleeping rank
    assert top[2] == "all_gather"  # the next collective: the following block's all-gather
    assert top[1] == "2"
    assert 3 * SLEEP_S * 0.6 < top[3] < 3 * SLEEP_S * 3  # about the sleep, per step
    assert top[4] >= 3  # the forward all-gathers (and, a little, the backward ones)
    assert sum(r[3] for r in rows[1:]) < top[3] / 2  # the rest is noise
    assert text.splitlines()[1].split()[:2] == ["1", "2"]


def _train_in_debug_mode() -> float:
    model = sharded_sleepy_chain(SLEEP_S)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(2, 8)
    for _ in range(4):  # the first step is warm-up; the check comes after the next 3
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return float(model(x).sum())


def test_debug_mode_names_the_sleeping_rank_while_training() -> None:
    fsdp2.set_debug(True, straggler=0.2, straggler_steps=3)
    try:
        with warnings.catch_warnings(record=True) as caught:  # the rank threads warn in this process
            warnings.simplefilter("always")
            losses = run_threaded(2, _train_in_debug_mode)
    finally:
        fsdp2.set_debug(False, straggler=0.1, straggler_steps=10)
    named = [str(w.message) for w in caught if "kept the other ranks" in str(w.message)]
    assert len(named) == 2, [str(w.message) for w in caught]  # once on each rank, after step 4
    for message in named:
        assert message.startswith("fsdp2 debug: rank 1 kept the other ranks")
        assert "of module '2'" in message  # the block after the sleep: its all-gather waited
    assert losses[0] == losses[1]  # and training went on, the same on both ranks


def test_straggler_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"straggler=\.\.\.\) is a fraction"):
        fsdp2.set_debug(True, straggler=1.5)
    with pytest.raises(ValueError, match="count of optimizer steps"):
        fsdp2.set_debug(True, straggler_steps=-1)
    assert not debug_enabled()  # the failed calls switched nothing on


def test_attribution_from_durations_alone() -> None:
    """Three ranks; rank 2 arrives last at the first collective, rank 0 at the second (longer)."""
    waits = [
        [("all-gather", "a", 0.5), ("reduce-scatter", "b", 0.0)],
        [("all-gather", "a", 0.3), ("reduce-scatter", "b", 0.5)],
        [("all-gather", "a", 0.1), ("reduce-scatter", "b", 0.2)],
    ]
    report = attribute(waits)
    assert [(r.rank, r.module_fqn, r.collective, r.count) for r in report.rows] == [
        (0, "b", "reduce_scatter", 1),  # the others waited 0.5 and 0.2 s: 0.35 on average
        (2, "a", "all_gather", 1),  # 0.4 and 0.2 s: 0.3
    ]
    assert report.rows[0].lag_s == pytest.approx(0.35)
    assert report.rows[1].lag_s == pytest.approx(0.3)


def test_a_list_without_waits_is_refused() -> None:
    with pytest.raises(TypeError, match="record_events"):
        fsdp2.straggler_report([])


def _report_with_rank_1(given: str) -> str | int:
    """Rank 0 passes its recording of a step; rank 1 passes ``given``: a list, or an empty recording."""
    import torch.distributed as dist

    model = sharded_sleepy_chain(0.0)
    x = torch.ones(2, 8)
    model(x).sum().backward()
    with fsdp2.record_events() as events:
        if dist.get_rank() == 0:
            model(x).sum().backward()
    if dist.get_rank() == 1:
        model(x).sum().backward()  # the same step, after its (empty) recording
    argument = events if dist.get_rank() == 0 or given == "empty recording" else []
    try:
        return len(fsdp2.straggler_report(argument).rows)
    except TypeError as error:
        return str(error)


def test_a_non_recording_on_one_rank_raises_on_every_rank() -> None:
    """Before: rank 1 raised alone and rank 0 was left in the exchange."""
    messages = run_threaded(2, _report_with_rank_1, "list")
    assert messages[0] == messages[1]
    assert "got something else on rank 1: list" in messages[0]


def test_an_empty_recording_on_one_rank_warns_on_every_rank() -> None:
    """Before: "(0 collectives compared)" and no word of why."""
    with warnings.catch_warnings(record=True) as caught:  # the rank threads warn in this process
        warnings.simplefilter("always")
        rows = run_threaded(2, _report_with_rank_1, "empty recording")
    assert rows == [0, 0]
    named = [w for w in caught if "the recording of rank(s) [1] holds no collective waits" in str(w.message)]
    assert len(named) == 2  # once on each rank
    assert all(w.category is RuntimeWarning for w in named)
