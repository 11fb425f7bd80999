"""``communication_report``: collective time and exposed time per group, against known delays.

The collectives go through custom implementations that run the real collective and then take a known
extra time (``DELAY``): synchronously by sleeping, or asynchronously by handing back a work object that
is done ``DELAY`` after the issue. Compute is a forward that sleeps ``SLEEP`` (longer than ``DELAY``).
Two ranks (threads) record; every bound below follows from those two numbers, with margins for a busy
machine (times only ever grow under load, so lower bounds are tight and upper bounds generous).
- synchronous collectives: the thread waits for all of each one (exposed = total, at least ``DELAY``);
- an all-gather issued asynchronously (``unshard(async_op=True)``) before ``SLEEP`` of compute has
  finished by the time it is used: exposed near 0, total at least ``SLEEP``;
- a forward prefetch on CPU runs synchronously when issued: exposed ``DELAY``, while its total also
  spans the compute before the prefetched layer's forward;
- a bucketed all-gather is waited on by the group whose unshard issued it, the other members only copy
  out their part; a bucketed reduce-scatter's wait is shared among its members by bytes;
- the table, the total row, the timeline's waits, and the errors.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp2
from fsdp2.testing import run_ranks

DIM = 8
DELAY = 0.03  # seconds each custom collective takes on top of the real one
SLEEP = 0.08  # seconds of "compute" in a sleeping forward
SLACK = 0.5  # generous upper margin for a loaded machine, seconds per collective


class _Done:
    """The real collective's work, done no sooner than ``DELAY`` after the issue (a slow one in flight)."""

    def __init__(self, work: Any, ready_at: float) -> None:
        self.work = work
        self.ready_at = ready_at

    def wait(self, timeout: Any = None) -> bool:
        self.work.wait()
        time.sleep(max(self.ready_at - time.perf_counter(), 0.0))
        return True


class SlowAllGather(fsdp2.AllGather):
    """The real all-gather, then ``DELAY``: slept when synchronous, left in flight when asynchronous."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(tuple(size), dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
    ) -> Any:
        if async_op:  # the issue never blocks, not even on a peer that is late
            work = dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=True)
            return _Done(work, time.perf_counter() + DELAY)
        dist.all_gather_single(output_tensor, input_tensor, group=group)
        time.sleep(DELAY)
        return None


class SlowReduceScatter(fsdp2.ReduceScatter):
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(tuple(size), dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group)
        time.sleep(DELAY)
        return None


class Sleepy(nn.Module):
    """A linear layer whose forward also sleeps ``seconds`` (compute of a known length)."""

    def __init__(self, seconds: float, out: int = DIM) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, out)
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seconds:
            time.sleep(self.seconds)
        return self.lin(x)


def _slow(module: fsdp2.FSDPModule) -> None:
    module.set_custom_all_gather(SlowAllGather())
    module.set_custom_reduce_scatter(SlowReduceScatter())


def _x() -> torch.Tensor:
    return torch.ones(2, DIM)


def _synchronous(rank: int, world_size: int) -> tuple[fsdp2.CommunicationReport, int]:
    torch.manual_seed(0)
    model = Sleepy(SLEEP)
    fsdp2.fully_shard(model)
    _slow(model)
    model(_x()).sum().backward()  # lazy init outside the recording
    with fsdp2.record_events() as events:
        for _ in range(2):
            model(_x()).sum().backward()
    return fsdp2.communication_report(events), len(events.waits)


def test_synchronous_collectives_are_exposed_for_their_whole_span() -> None:
    report, _ = run_ranks(2, _synchronous)[0]
    assert report.steps == 2
    # The root keeps its parameters from forward to backward: one all-gather and one reduce-scatter a step.
    assert [(r.module_fqn, r.collective, r.count) for r in report.rows] == [
        ("", "all_gather", 2),
        ("", "reduce_scatter", 2),
    ]
    gather, reduce = report.row("", "all_gather"), report.row("", "reduce_scatter")
    for row in (gather, reduce):
        assert row.count * DELAY <= row.exposed_s <= row.total_s + 1e-6
        assert row.total_s < row.count * (DELAY + SLACK)
    # Issued and finished in one call: the reduce-scatter's wait is its span, to the microsecond.
    assert reduce.exposed_s == pytest.approx(reduce.total_s, abs=1e-9)
    # The all-gather's span has its issue and its wait back to back: nothing in between is hidden.
    assert gather.hidden_s < gather.count * DELAY / 2
    # The forward's sleep is compute, never communication.
    assert gather.total_s < gather.count * SLEEP


def _overlapped(rank: int, world_size: int) -> tuple[fsdp2.CommunicationRow, fsdp2.CommunicationRow]:
    torch.manual_seed(0)
    model = Sleepy(0.0)
    fsdp2.fully_shard(model)
    _slow(model)
    with torch.no_grad():
        model(_x())  # lazy init
    rows = []
    for compute in (SLEEP, 0.0):
        with torch.no_grad(), fsdp2.record_events() as events:
            handle = model.unshard(async_op=True)
            assert handle is not None
            time.sleep(compute)  # other work while the all-gather is in flight
            model(_x())  # waits for it, then runs
        rows.append(fsdp2.communication_report(events).row("", "all_gather"))
    return rows[0], rows[1]


def test_an_all_gather_finished_behind_compute_is_hidden() -> None:
    hidden, waited = run_ranks(2, _overlapped)[0]
    assert hidden.count == waited.count == 1
    # In flight across the compute; done before the forward needed it.
    assert hidden.total_s >= SLEEP
    assert hidden.exposed_s < DELAY / 2
    assert hidden.hidden_s >= SLEEP - DELAY / 2
    # Used right away: the forward waits out the collective (all of it but the moment between the
    # issue's return and the forward's wait).
    assert DELAY <= waited.total_s < DELAY + SLACK
    assert waited.total_s - DELAY / 2 <= waited.exposed_s <= waited.total_s + 1e-6


def _prefetched(rank: int, world_size: int) -> fsdp2.CommunicationReport:
    torch.manual_seed(0)
    model = nn.Sequential(Sleepy(SLEEP), Sleepy(0.0))
    for layer in model:
        fsdp2.fully_shard(layer)
        _slow(layer)
    fsdp2.fully_shard(model)  # the root has no parameters of its own: no group, no collectives
    model[0].set_modules_to_forward_prefetch([model[1]])
    with torch.no_grad():
        model(_x())
    with torch.no_grad(), fsdp2.record_events() as events:
        model(_x())
    return fsdp2.communication_report(events)


def test_a_prefetch_on_cpu_is_exposed_when_issued_and_spans_the_compute_before_its_use() -> None:
    report = run_ranks(2, _prefetched)[0]
    assert report.steps == 1  # one forward, no backward
    first, second = report.row("0", "all_gather"), report.row("1", "all_gather")
    assert [r.module_fqn for r in report.rows] == ["0", "1"]
    assert first.count == second.count == 1
    # Layer 0 gathers, then issues layer 1's all-gather (synchronous on CPU), then sleeps SLEEP.
    assert DELAY <= first.exposed_s <= first.total_s + 1e-6 < DELAY + SLACK
    assert DELAY <= second.exposed_s < DELAY + SLACK
    assert second.total_s >= second.exposed_s + SLEEP
    total = report.total
    assert (total.module_fqn, total.collective, total.count) == ("(all)", "all", 2)
    assert total.exposed_s == pytest.approx(first.exposed_s + second.exposed_s)
    assert total.total_s == pytest.approx(first.total_s + second.total_s)


def _bucketed(rank: int, world_size: int, out: str) -> tuple[fsdp2.CommunicationReport, list[Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(Sleepy(0.0), Sleepy(0.0, out=3 * DIM))
    for layer in model:
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
    model.set_bucket_cap_mb(reduce_scatter=64)  # both layers' gradients in one reduce-scatter
    model(_x()).sum().backward()
    with fsdp2.record_events() as events:
        model(_x()).sum().backward()
    waits = [(w.module_fqn, w.start_us, w.end_us) for w in events.waits if w.name == "reduce-scatter"]
    fsdp2.save_timeline(events, f"{out}/rank{rank}.json")
    return fsdp2.communication_report(events), waits


def test_a_bucketed_reduce_scatter_shares_its_wait_by_bytes(tmp_path: Path) -> None:
    report, waits = run_ranks(2, _bucketed, str(tmp_path))[0]
    # Backward reaches layer 1 first; one shared reduction, whose wait is cut in two consecutive pieces.
    assert [fqn for fqn, _, _ in waits] == ["1", "0"]
    assert waits[0][2] == waits[1][1]
    pieces = {fqn: end - start for fqn, start, end in waits}
    # Layer 1 has 3x layer 0's parameters (8*24 + 24 against 8*8 + 8), so 3x its bytes (up to a
    # per-parameter tail of a few elements).
    assert pieces["1"] / pieces["0"] == pytest.approx(3.0, rel=0.1)
    for fqn in ("0", "1"):
        row = report.row(fqn, "reduce_scatter")
        assert row.count == 1
        assert row.exposed_s == pytest.approx(pieces[fqn] / 1e6)
        assert row.exposed_s <= row.total_s + 1e-6
    trace = json.loads((tmp_path / "rank0.json").read_text())["traceEvents"]
    in_trace = [e for e in trace if e.get("cat") == "waits" and e["name"] == "reduce-scatter wait"]
    assert sorted(e["dur"] for e in in_trace) == pytest.approx(sorted(pieces.values()))
    assert {e["tid"] for e in in_trace}.isdisjoint({e["tid"] for e in trace if e.get("cat") == "collectives"})


def _bucketed_gather(rank: int, world_size: int) -> fsdp2.CommunicationReport:
    torch.manual_seed(0)
    model = nn.Sequential(Sleepy(SLEEP), Sleepy(0.0))
    for layer in model:
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
    model.set_bucket_cap_mb(all_gather=64)  # both layers gathered by one all-gather
    model(_x()).sum().backward()  # learns the execution order
    with fsdp2.record_events() as events:
        loss = model(_x()).sum()
    loss.backward()
    return fsdp2.communication_report(events)


def test_a_bucketed_all_gather_is_waited_on_by_the_group_that_issued_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = dist.all_gather_single

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(DELAY)
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "all_gather_single", slow)  # fsdp2's built-in all-gather looks it up per call
    report = run_ranks(2, _bucketed_gather)[0]
    first, second = report.row("0", "all_gather"), report.row("1", "all_gather")
    assert first.count == second.count == 1
    # Layer 0's unshard issues the bucket and waits for it; layer 1 finds its part there after layer 0's
    # forward (SLEEP) and only copies it out.
    assert DELAY <= first.exposed_s <= first.total_s + 1e-6
    assert first.total_s < DELAY + SLACK
    assert second.exposed_s < DELAY / 2
    assert second.total_s >= DELAY + SLEEP


def test_the_table_lists_every_row_and_the_total() -> None:
    report, n_waits = run_ranks(2, _synchronous)[0]
    assert n_waits == 2 * 2 + 2  # per step: the all-gather's issue and its wait, the reduce-scatter
    lines = str(report).splitlines()
    assert lines[0] == "Communication per group over 2 steps"
    assert lines[1].split() == [
        "module",
        "collective",
        "count",
        "total",
        "ms",
        "exposed",
        "ms",
        "exposed",
        "%",
    ]
    gather = report.row("", "all_gather")
    cells = lines[3].split()
    assert cells[:3] == ["<root>", "all_gather", "2"]
    assert float(cells[3]) == pytest.approx(gather.total_s * 1e3, abs=0.01)
    assert float(cells[4]) == pytest.approx(gather.exposed_s * 1e3, abs=0.01)
    assert lines[-1].split()[:3] == ["total", "all", "4"]
    assert len({len(line) for line in lines[1:] if not line.startswith("-")}) == 1  # aligned columns


def test_errors_name_the_problem_and_the_fix() -> None:
    with pytest.raises(TypeError, match=r"needs the list record_events\(\) yielded.*got list.*filtered copy"):
        fsdp2.communication_report([])
    with pytest.raises(TypeError, match=r"got int"):
        fsdp2.communication_report(3)  # type: ignore[arg-type]
    empty = fsdp2.CommunicationReport((), 0)
    with pytest.raises(KeyError, match=r"no 'all_gather' recorded for module 'layers.0'; the rows are: none"):
        empty.row("layers.0", "all_gather")
    assert empty.total.count == 0
    assert "total" in str(empty)
