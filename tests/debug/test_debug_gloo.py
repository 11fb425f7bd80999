"""Debug mode in 2 real gloo processes whose models differ: both raise within seconds.

Without debug mode the mismatched collectives would fail or hang (up to the process group timeout);
with ``FSDP2_DEBUG``-style checking on, the first forward compares the ranks' parameters and every
rank raises the same error naming the first parameter that differs. Also: a watchdog deadline not
shorter than the process group's timeout warns at the first collective (the threaded backend's
timeout cannot be read, so this needs real gloo).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp2
from tests._harness import run_multiprocess
from tests.models import sharded_sleepy_chain

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def _mismatched_models() -> None:
    fsdp2.set_debug(True, deadline=5.0)
    rank = dist.get_rank()
    torch.manual_seed(0)
    hidden = 16 if rank == 1 else 8  # rank 1 built a different model
    model = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2))
    fsdp2.fully_shard(model[0])
    fsdp2.fully_shard(model)
    start = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"ranks manage different models.*'2\.weight' on rank 0 \(shape \(2, 8\)"
    ):
        model(torch.ones(3, 4))
    assert time.monotonic() - start < 10


def test_ranks_with_different_models_both_raise() -> None:
    run_multiprocess(2, _mismatched_models)


def _deadline_past_the_timeout() -> None:
    import warnings

    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    fsdp2.fully_shard(model)
    fsdp2.set_debug(True, deadline=500.0)  # the harness's process group times out after 120 s
    try:
        with pytest.warns(
            UserWarning, match=r"reports after 500 s, but the process group times out after 120 s"
        ):
            model(torch.ones(3, 4)).sum().backward()
        fsdp2.set_debug(True, deadline=30.0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # below the timeout: nothing to say
            model(torch.ones(3, 4)).sum().backward()
    finally:
        fsdp2.set_debug(False)


def test_a_watchdog_deadline_past_the_group_timeout_warns() -> None:
    # Before: the watchdog printed nothing, the process group's timeout ended the job first.
    run_multiprocess(2, _deadline_past_the_timeout)


SLEEP_S = 0.15


def _straggler_in_processes() -> None:
    import warnings

    model = sharded_sleepy_chain(SLEEP_S)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(2, 8)

    def step() -> None:
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # lazy init, outside the recording
    with fsdp2.record_events() as events:
        for _ in range(3):
            step()
    report = fsdp2.straggler_report(events)  # the same rows on both processes, from their own clocks
    top = report.rows[0]
    assert (top.rank, top.module_fqn, top.collective) == (1, "2", "all_gather"), str(report)
    assert 3 * SLEEP_S * 0.6 < top.lag_s < 3 * SLEEP_S * 3, str(report)
    everyone: list[object] = [None, None]
    dist.all_gather_object(everyone, [(r.rank, r.module_fqn, r.collective, r.count) for r in report.rows])
    assert everyone[0] == everyone[1]

    # Debug mode: the same rank is named while training runs (a new root: the guard installs at init).
    fsdp2.set_debug(True, straggler=0.2, straggler_steps=3)
    model = sharded_sleepy_chain(SLEEP_S)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):  # warm-up, then the check after 3 more steps
            step()
    fsdp2.set_debug(False, straggler=0.1, straggler_steps=10)
    named = [str(w.message) for w in caught if "kept the other ranks" in str(w.message)]
    assert len(named) == 1, named
    assert named[0].startswith("fsdp2 debug: rank 1 kept"), named
    assert "of module '2'" in named[0]


def test_the_slow_rank_is_named_across_processes() -> None:
    """straggler_report and debug mode's warning in real processes, one clock each."""
    run_multiprocess(2, _straggler_in_processes)
