"""``fsdp2.straggler_report``: the rank the others waited for, found from each rank's own durations.

Rank 1 sleeps inside one block's forward every step; the others then wait for it at the next
collective. The reference is what the test did: rank 1, about the sleep per step, named on every rank
(the same rows everywhere). The bounds are wide: the machine may be loaded.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp2
from fsdp2.trace._straggler import _attribute
from tests._harness import run_threaded

SLEEP_S = 0.2


class _Sleepy(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 1:
            time.sleep(SLEEP_S)  # a slow rank: more work, a throttled GPU, a noisy neighbour
        return super().forward(x)


def _run() -> tuple[str, list[tuple[int, str, str, float, int]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Sleepy(8, 8), nn.Linear(8, 8))
    for layer in model:
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
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


def test_attribution_from_durations_alone() -> None:
    """Three ranks; rank 2 arrives last at the first collective, rank 0 at the second (longer)."""
    waits = [
        [("all-gather", "a", 0.5), ("reduce-scatter", "b", 0.0)],
        [("all-gather", "a", 0.3), ("reduce-scatter", "b", 0.5)],
        [("all-gather", "a", 0.1), ("reduce-scatter", "b", 0.2)],
    ]
    report = _attribute(waits)
    assert [(r.rank, r.module_fqn, r.collective, r.count) for r in report.rows] == [
        (0, "b", "reduce_scatter", 1),  # the others waited 0.5 and 0.2 s: 0.35 on average
        (2, "a", "all_gather", 1),  # 0.4 and 0.2 s: 0.3
    ]
    assert report.rows[0].lag_s == pytest.approx(0.35)
    assert report.rows[1].lag_s == pytest.approx(0.3)


def test_a_list_without_waits_is_refused() -> None:
    with pytest.raises(TypeError, match="record_events"):
        fsdp2.straggler_report([])
