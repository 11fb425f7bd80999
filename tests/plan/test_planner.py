"""``fsdp2.plan(objective="time")``: the search by predicted step time, inside a job and before one.

The step-time model is checked against its own arithmetic (packing, calibration, resharding and
buckets in the right direction); the search against what it must return (fits the budget, even one
equal to the default wrapping's measured peak, the same plan on every rank, the frozen-residency and
bucket settings searched, one clear error when nothing fits, raised on every rank when one rank
fails); the applied plan trains like the unsharded model. How close the prediction comes to measured
steps is a benchmark (``benchmarks/plan_time.py``), not a test.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2 import Plan
from fsdp2.plan._cost import CostModel, GroupBytes, Setting, _packed, calibrate
from fsdp2.runtime._autocap import CollectiveFit
from fsdp2.testing import run_ranks
from tests.models import make_input


class Blocks(nn.Module):
    def __init__(self, n: int = 4, dim: int = 24, frozen: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(12, dim)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)) for _ in range(n)
        )
        self.out = nn.Linear(dim, 3)
        if frozen:  # a frozen backbone: only the head trains
            for p in [*self.inp.parameters(), *self.layers.parameters()]:
                p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.out(h)


def _step(built: tuple[nn.Module, torch.optim.Optimizer]) -> None:
    model, optim = built
    model(make_input((16, 12), 0)).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()


FIT = CollectiveFit(1e-3, 1e-9)
SIZES = [GroupBytes(f"b{i}", 1000, 1000) for i in range(4)]
ROOT = GroupBytes("", 100, 100)


def test_the_model_counts_latencies_and_bytes() -> None:
    model = CostModel(FIT, FIT, compute_s=0.05, per_group_s=1e-4, overlap=False, measured_network=True)
    groups = tuple((f"b{i}",) for i in range(4))
    resharding = model.predict(Setting(groups, (True,) * 4), SIZES, ROOT)
    keeping = model.predict(Setting(groups, (False,) * 4), SIZES, ROOT)
    # 4 backward all-gathers of 1000 bytes more: exactly their latency and bytes
    assert resharding - keeping == pytest.approx(4 * FIT.seconds(1000))
    bucketed = model.predict(Setting(groups, (False,) * 4, bucket_cap_mb=1.0), SIZES, ROOT)
    # one all-gather and one reduce-scatter of 4100 bytes instead of 5 each: 8 latencies fewer
    assert keeping - bucketed == pytest.approx(8 * FIT.latency_s)
    assert _packed([3, 3, 3, 0, 5], 6) == [6, 3, 5]
    assert _packed([3, 3], None) == [3, 3]
    frozen = [GroupBytes(f"b{i}", 1000, 0) for i in range(4)]
    kept = model.predict(Setting(groups, (True,) * 4, keep_frozen=True), frozen, ROOT)
    gathered = model.predict(Setting(groups, (True,) * 4), frozen, ROOT)
    assert gathered - kept == pytest.approx(8 * FIT.seconds(1000))  # no frozen bytes gathered, twice


def test_on_streams_collectives_hide_behind_their_share_of_compute() -> None:
    groups = tuple((f"b{i}",) for i in range(4))
    setting = Setting(groups, (True,) * 4)
    serial = CostModel(FIT, FIT, 0.0, 0.0, overlap=False, measured_network=True)
    streams = dataclasses.replace(serial, overlap=True)
    # no compute to hide behind: the same as paying every collective
    assert streams.predict(setting, SIZES, ROOT) == pytest.approx(serial.predict(setting, SIZES, ROOT))
    # ample compute: only the compute and the first all-gather (nothing runs before it) remain
    busy = dataclasses.replace(streams, compute_s=10.0)
    assert busy.predict(setting, SIZES, ROOT) == pytest.approx(10.0 + FIT.seconds(1000))


def test_the_root_carries_every_candidate_left_to_it() -> None:
    from fsdp2.plan._planner import _shape

    sizes = {"": ROOT, **{g.name: g for g in SIZES}}
    groups, root = _shape(Setting((), ()), sizes)  # root only: one group of everything
    assert groups == []
    assert (root.total, root.trainable) == (4100, 4100)
    groups, root = _shape(Setting((("b0", "b1"),), (True,)), sizes)
    assert [g.total for g in groups] == [2000]
    assert root.total == 2100


def test_calibration_separates_compute_from_per_group_cost() -> None:
    true = CostModel(FIT, FIT, compute_s=0.2, per_group_s=3e-4, overlap=False, measured_network=True)
    zero = CostModel(FIT, FIT, 0.0, 0.0, False, True)
    a = Setting(tuple((f"b{i}",) for i in range(4)), (True,) * 4)
    b = Setting((("b0", "b1"), ("b2", "b3")), (True, True))
    pairs = [GroupBytes("p0", 2000, 2000), GroupBytes("p1", 2000, 2000)]
    timed = [(true.predict(a, SIZES, ROOT), a), (true.predict(b, pairs, ROOT), b)]
    fitted = calibrate(timed, [(SIZES, ROOT), (pairs, ROOT)], zero)
    assert fitted.compute_s == pytest.approx(0.2)
    assert fitted.per_group_s == pytest.approx(3e-4)


def _plan_in_job(rank: int, world: int, budget: int, frozen: bool) -> tuple[str, float, list[str], str]:
    """plan() on every rank of a running job (thread ranks)."""
    chosen = fsdp2.plan(lambda: Blocks(frozen=frozen), _step, world_size=world, budget_bytes=budget)
    assert chosen.fits
    assert chosen.objective == "time"
    described = [description for description, _, _ in chosen.tried]
    return str(chosen.setting), chosen.predicted_step_s or 0.0, described, chosen.explain()


@pytest.mark.slow  # a search over every bucket cap, each trial simulated (the quick loop keeps the rest)
def test_where_latency_dominates_buckets_win_within_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp2.plan import _planner

    slow = CollectiveFit(20e-3, 1e-9)  # 20 ms a collective: bucketing pays
    model = CostModel(slow, slow, compute_s=0.01, per_group_s=1e-4, overlap=False, measured_network=True)
    monkeypatch.setattr(_planner, "_cost_model", lambda *args: (model, ["fixed"], "cpu"))
    with pytest.raises(fsdp2.PlanError) as info:
        fsdp2.plan(Blocks, _step, world_size=2, budget_bytes=1, objective="collectives")
    budget = int(info.value.best.peak_bytes * 1.1)  # every block resharding fits; root only does not
    chosen = fsdp2.plan(Blocks, _step, world_size=2, budget_bytes=budget)
    assert chosen.fits
    assert any("MiB buckets" in d for d, _, _ in chosen.tried)  # fewer latencies: tried first
    assert chosen.predicted_step_s == pytest.approx(_planner._predict(model, chosen.setting, _sizes()))
    # every fitting plan tried is predicted no faster
    assert all(peak > budget for d, peak, _ in chosen.tried if d.startswith("root only"))


def _sizes() -> dict[str, GroupBytes]:
    from fsdp2.plan import _planner
    from fsdp2.plan._plan import Search

    search = Search(Blocks, _step, 2, torch.optim.AdamW, {}, 2**30)
    return _planner._candidate_bytes(search, [f"layers.{i}" for i in range(4)])


def test_frozen_parameters_kept_gathered_are_searched(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp2.plan import _planner

    # no near-tie timing: on this toy model the two are within noise, and the model's choice is tested
    monkeypatch.setattr(_planner, "TIE", -1.0)
    (setting, _, described, _), _ = run_ranks(2, _plan_in_job, 2**30, True)
    assert any("frozen parameters kept gathered" in d for d in described)
    assert "keep_frozen=True" in setting  # nothing gathered again: predicted the fastest where it fits


def test_nothing_fits_raises_one_error_with_the_lowest_peak() -> None:
    with pytest.raises(fsdp2.PlanError, match="no wrapping of this model fits") as info:
        fsdp2.plan(Blocks, _step, world_size=2, budget_bytes=4096)
    best = info.value.best
    assert not best.fits
    assert best.peak_bytes == min(peak for _, peak, _ in best.tried)


def test_bad_calls_are_refused() -> None:
    with pytest.raises(ValueError, match="objective is 'time' or 'collectives'"):
        fsdp2.plan(Blocks, _step, world_size=2, budget_bytes=2**30, objective="fast")
    with pytest.raises(ValueError, match="offload_policy"):
        fsdp2.plan(Blocks, _step, world_size=2, budget_bytes=2**30, offload_policy=fsdp2.CPUOffloadPolicy())

    def rank_fn(rank: int, world: int) -> None:
        with pytest.raises(ValueError, match="this job has 2 ranks but world_size=4"):
            fsdp2.plan(Blocks, _step, world_size=4, budget_bytes=2**30)
        # rank 1 builds a wider model: refused on both ranks before any real step could hang
        with pytest.raises(ValueError, match=r"ranks \[1\] built another model than rank 0"):
            fsdp2.plan(lambda: Blocks(dim=24 + 8 * rank), _step, world_size=2, budget_bytes=2**30)

    run_ranks(2, rank_fn)


def test_the_applied_plan_trains_like_the_unsharded_model() -> None:
    chosen = fsdp2.plan(Blocks, _step, world_size=2, budget_bytes=2**30)  # before a job
    assert "nominal" in chosen.explain()

    def rank_fn(rank: int, size: int) -> list[float]:
        mesh = init_device_mesh("cpu", (size,))
        return fsdp2.testing.assert_matches_unsharded(
            Blocks,
            lambda model: chosen.apply(model, mesh=mesh),
            lambda r, s: make_input((8, 12), r, seed=s),
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        )

    losses = run_ranks(2, rank_fn)  # each rank's own batch; every step checked against the reference
    assert len(losses[0]) == 3


@pytest.mark.slow  # a dozen simulated trials
def test_offload_is_the_last_resort_on_an_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing fits: on an accelerator the groups are offloaded, largest first; on the CPU never."""
    from fsdp2.plan import _planner

    model = CostModel(FIT, FIT, compute_s=0.01, per_group_s=1e-4, overlap=True, measured_network=True)
    monkeypatch.setattr(_planner, "_cost_model", lambda *args: (model, ["fixed"], "cuda"))
    with pytest.raises(fsdp2.PlanError) as info:
        fsdp2.plan(Blocks, _step, world_size=2, budget_bytes=4096)
    offloaded = [d for d, _, _ in info.value.best.tried if "offloaded to CPU" in d]
    # the simulated CPU run frees nothing by offloading, so every group is tried in turn, one more each
    assert [d.rsplit(", ", 1)[-1] for d in offloaded] == [f"{n} offloaded to CPU" for n in range(1, 5)]
    monkeypatch.setattr(_planner, "_cost_model", lambda *args: (model, ["fixed"], "cpu"))
    with pytest.raises(fsdp2.PlanError) as info:
        fsdp2.plan(Blocks, _step, world_size=2, budget_bytes=4096)
    assert not any("offloaded" in d for d, _, _ in info.value.best.tried)


def test_a_near_tie_inside_a_job_is_settled_by_timing_both(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from fsdp2.plan import _planner

    free = CollectiveFit(0.0, 0.0)  # every setting predicted alike: the best two tie
    model = CostModel(free, free, compute_s=0.01, per_group_s=0.0, overlap=False, measured_network=True)
    monkeypatch.setattr(_planner, "_cost_model", lambda *args: (model, ["fixed"], "cpu"))
    calls: dict[int, int] = {}

    def timed(search: object, setting: Setting, world: int) -> tuple[float, str]:
        count = calls[threading.get_ident()] = calls.get(threading.get_ident(), 0) + 1
        return (1.0 if count == 1 else 0.5), "cpu"  # the runner-up is faster for real

    monkeypatch.setattr(_planner, "_time_wrapped", timed)

    def rank_fn(rank: int, world: int) -> tuple[str, str]:
        chosen = fsdp2.plan(Blocks, _step, world_size=2, budget_bytes=2**30)
        return chosen.setting.describe(), chosen.explain()

    (described, explained), other = run_ranks(2, rank_fn)
    assert other[0] == described
    assert "near tie" in explained
    assert "took the latter" in explained
    runner_up = next(line for line in explained.splitlines() if line.startswith("runner-up: "))
    assert runner_up.removeprefix("runner-up: ").startswith(described)  # the runner-up was taken


def _measured_default_peak(rank: int, world: int) -> int:
    """The step peak of one group per block (resharding) then the root, measured for real on this job.

    The mesh is the job's, made before the model (as ``Plan.apply`` is given it); every rank's peak,
    the largest taken.
    """
    from fsdp2.plan._memory import MemoryTracker, run_tracked

    mesh = init_device_mesh("cpu", (world,))

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = Blocks()
        for layer in model.layers:
            fsdp2.fully_shard(layer, mesh=mesh)
        fsdp2.fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters())

    tracker = MemoryTracker()
    run_tracked(tracker, build, _step, 2)
    torch.distributed.barrier()
    peaks: list[Any] = [None] * world
    torch.distributed.all_gather_object(peaks, tracker.report(world, rank).step_peak_bytes)
    return max(peaks)


@pytest.mark.slow  # a whole search and a measured run in 2 thread ranks
def test_inside_a_job_every_rank_gets_the_same_plan_within_the_default_wrappings_measured_peak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fsdp2.plan import _planner
    from fsdp2.plan._memory import process_hooks
    from fsdp2.testing._measure import _collectives_untracked

    monkeypatch.setattr(_planner, "TIE", -1.0)  # no near-tie timing: tested on its own below

    def rank_fn(rank: int, world: int) -> tuple[int, int, Plan]:
        measured = _measured_default_peak(rank, world)
        chosen = fsdp2.plan(Blocks, _step, world_size=world, budget_bytes=measured)
        default = {d: peak for d, peak, _ in chosen.tried}["4 groups of up to 1, 4 resharding after forward"]
        return measured, default, chosen

    with process_hooks(), _collectives_untracked():  # the threaded backend's own copies are no rank's
        (measured, default, chosen), (_, _, other) = run_ranks(2, rank_fn)
    assert other.setting == chosen.setting
    # the estimate of the default wrapping is what it measurably uses, to the byte (it was 8 bytes more:
    # the mesh's rank map, host memory the job made before the model), so a budget it meets gives a plan
    assert default == measured
    assert chosen.fits
    assert chosen.peak_bytes <= measured
    assert chosen.objective == "time"
    assert (chosen.predicted_step_s or 0.0) > 0
    explained = chosen.explain()
    assert "measured on the job's 2 ranks" in explained
    assert "runner-up" in explained


class _BoomError(RuntimeError):
    pass


def test_a_failure_on_one_rank_is_raised_on_every_rank() -> None:
    """Each rank's own plan() call fails on rank 1 only; every rank raises the same error, none waits."""

    def rank_fn(rank: int, world: int) -> list[str]:
        seen = []

        def raise_on_rank_1(when: str) -> Callable[[Any], None]:
            def step(built: tuple[nn.Module, torch.optim.Optimizer]) -> None:
                _step(built)  # every collective of the step done
                if rank == 1 and (when == "always" or not fsdp2.is_simulated()):
                    raise _BoomError(f"step failed on rank 1 ({when})")

            return step

        # a bad argument on rank 1 only: refused on both before any collective of the search
        with pytest.raises(ValueError, match="budget_bytes must be a positive int") as info:
            fsdp2.plan(Blocks, _step, world_size=2, budget_bytes=2**30 if rank == 0 else 0)
        seen.append(str(info.value))
        # train_step raising on rank 1 in the simulation: before any real step
        with pytest.raises(_BoomError, match=r"step failed on rank 1 \(always\)") as boom:
            fsdp2.plan(Blocks, raise_on_rank_1("always"), world_size=2, budget_bytes=2**30)
        seen.append(str(boom.value))
        if sys.version_info >= (3, 11):
            assert "raised on rank 1 of the job" in boom.value.__notes__[-1]
        # train_step raising on rank 1 in a real step only, after its collectives
        with pytest.raises(_BoomError, match=r"step failed on rank 1 \(real\)") as boom:
            fsdp2.plan(Blocks, raise_on_rank_1("real"), world_size=2, budget_bytes=2**30)
        seen.append(str(boom.value))
        # a budget nothing fits on rank 1 only: the plan must fit every rank, so both raise PlanError
        with pytest.raises(fsdp2.PlanError, match=r"no wrapping of this model fits 0\.00 MiB") as plan_error:
            fsdp2.plan(Blocks, _step, world_size=2, budget_bytes=2**30 if rank == 0 else 4096)
        seen.append(str(plan_error.value))
        assert plan_error.value.best.budget_bytes == 4096
        assert plan_error.value.best.peak_bytes == min(peak for _, peak, _ in plan_error.value.best.tried)
        return seen

    first, second = run_ranks(2, rank_fn)
    assert first == second
