"""``set_bucket_cap_mb("auto")``: caps from a measurement of the process group, threads as ranks.

- two process groups of different speed (one whose collectives sleep ``DELAY_S`` first, patched into
  ``torch.distributed`` as a profiler would): the slow one's fitted latency holds the delay, its caps
  are larger, every rank holds the same caps and fits, and training with the automatic caps is
  bit-equal to the unbucketed run (world 2: one addition per element) while issuing fewer collectives;
- agreement: under HSDP only rank 0's collectives are slowed; the replicate all-reduce carries its fit
  to the other shard group, so all four ranks hold the slowest fit;
- the measurement uses the groups' own collectives (counted with ``record_collectives``), a custom
  collective where the whole process group uses one;
- arguments: ``"auto"`` alone sets both caps, per argument one, a number stays a number; a single-rank
  shard group measures nothing;
- the fit's arithmetic and the clamps of the cap;
- errors: bad strings, a non-root module, a call during forward: nothing measured, caps unchanged.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import fsdp2
from fsdp2.runtime._autocap import CAP_LATENCIES, MAX_CAP, MIN_CAP
from fsdp2.testing import record_collectives
from tests._harness import broadcast_module_, run_threaded
from tests._training import EXACT
from tests.shared.bucketing import Blocks, _caps, _input, _train

MIB = 1024 * 1024
DELAY_S = 0.02  # added before every collective of a slowed process group
DIMS = [16, 16, 16, 16, 16]  # 4 blocks + root: 5 groups


class _Slowdown:
    """Collectives of the registered process groups (by name) or ranks sleep ``DELAY_S`` first."""

    def __init__(self) -> None:
        self.groups: set[str] = set()
        self.ranks: set[int] = set()
        self._lock = threading.Lock()

    def add_group(self, group: dist.ProcessGroup) -> None:
        with self._lock:
            self.groups.add(group.group_name)

    def wrap(self, collective: Any) -> Any:
        def slowed(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group", args[2] if len(args) > 2 else None)
            if getattr(group, "group_name", None) in self.groups or dist.get_rank() in self.ranks:
                time.sleep(DELAY_S)
            return collective(*args, **kwargs)

        return slowed


@pytest.fixture
def slowdown(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Slowdown]:
    """Patch ``torch.distributed``'s single-tensor collectives (fsdp2's default ones look them up there)."""
    slow = _Slowdown()
    for name in ("all_gather_single", "reduce_scatter_single"):
        monkeypatch.setattr(dist, name, slow.wrap(getattr(dist, name)))
    return slow


def _shard(model: Blocks, mesh: DeviceMesh) -> Blocks:
    for block in model.blocks:
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    return model


def _fit_tuple(caps: fsdp2.BucketCaps) -> tuple[Any, ...]:
    fits = (caps.all_gather_fit, caps.reduce_scatter_fit)
    return (caps.all_gather, caps.reduce_scatter, *[(f.latency_s, f.seconds_per_byte) for f in fits if f])


# ---- two process groups of different speed -------------------------------------------------------


def _two_speeds_body(slow: _Slowdown) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    fast_mesh = init_device_mesh("cpu", (2,))
    slow_group = dist.new_group([0, 1])
    slow.add_group(slow_group)
    slow_mesh = DeviceMesh.from_group(slow_group, "cpu")
    torch.manual_seed(0)
    base = broadcast_module_(Blocks(DIMS))
    chosen = {}
    for name, mesh in (("fast", fast_mesh), ("slow", slow_mesh)):
        plain, auto = _shard(copy.deepcopy(base), mesh), _shard(copy.deepcopy(base), mesh)
        caps = auto.set_bucket_cap_mb("auto")
        assert _caps(auto) == (caps.all_gather, caps.reduce_scatter)
        chosen[name] = caps
        counts: list[Any] = []
        want = _train(plain, DIMS[0], 2, 1)
        got = _train(auto, DIMS[0], 2, 1, counts)
        for w, g in zip(want, got, strict=True):
            for a, b in zip(w, g, strict=True):
                torch.testing.assert_close(b, a, **EXACT)
        # Every cap holds the whole model (at least 1 MiB): one collective per pass once the order is known.
        assert counts[1] == {"all_gather": 2, "reduce_scatter": 1}, counts
    fast, slowed = chosen["fast"], chosen["slow"]
    for kind in ("all_gather", "reduce_scatter"):
        fast_fit, slow_fit = getattr(fast, f"{kind}_fit"), getattr(slowed, f"{kind}_fit")
        assert fast_fit is not None
        assert slow_fit is not None
        assert slow_fit.latency_s >= DELAY_S * 0.9, (kind, slow_fit)
        assert slow_fit.latency_s > fast_fit.latency_s + DELAY_S / 2, (kind, fast_fit, slow_fit)
        assert getattr(slowed, kind) > getattr(fast, kind), (kind, fast, slowed)
        for fit, cap in ((fast_fit, getattr(fast, kind)), (slow_fit, getattr(slowed, kind))):
            ideal = CAP_LATENCIES * fit.latency_s * fit.bytes_per_second
            assert cap == pytest.approx(min(max(ideal, MIN_CAP), MAX_CAP), abs=1), (fit, cap)
    return _fit_tuple(fast), _fit_tuple(slowed)


@pytest.mark.slow
def test_auto_caps_on_two_process_groups_of_different_speed(slowdown: _Slowdown) -> None:
    results = run_threaded(2, _two_speeds_body, slowdown)
    assert results[0] == results[1]  # caps and fits, bit for bit, on both ranks


def _hsdp_agreement_body() -> tuple[Any, ...]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = _shard(broadcast_module_(Blocks(DIMS)), mesh)
    caps = model.set_bucket_cap_mb("auto")
    assert caps.all_gather_fit is not None
    assert caps.reduce_scatter_fit is not None
    # Rank 0's delay reaches rank 1 (same shard group) through the collective, ranks 2 and 3 only
    # through the agreement over the replicate group.
    assert caps.all_gather_fit.latency_s >= DELAY_S * 0.9
    assert caps.reduce_scatter_fit.latency_s >= DELAY_S * 0.9
    model(_input(DIMS[0], dist.get_rank(), 0)).sum().backward()
    return _fit_tuple(caps)


def test_every_rank_of_the_mesh_agrees(slowdown: _Slowdown) -> None:
    slowdown.ranks.add(0)
    results = run_threaded(4, _hsdp_agreement_body)
    assert all(r == results[0] for r in results), results


# ---- what is measured ----------------------------------------------------------------------------


class _SleepyAllGather(fsdp2.AllGather):
    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(tuple(size), dtype=dtype, device=device)

    def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, async_op: bool = False) -> Any:
        time.sleep(DELAY_S)
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


def _measured_collectives_body() -> None:
    torch.manual_seed(0)
    base = broadcast_module_(Blocks(DIMS))
    mesh = init_device_mesh("cpu", (2,))
    model = _shard(copy.deepcopy(base), mesh)
    with record_collectives(model) as log:
        model.set_bucket_cap_mb("auto")
    # One process group: 2 sizes x (1 + 5 timed) calls of each collective, by the groups' own objects.
    assert dict(log) == {"all_gather": 12, "reduce_scatter": 12}
    with record_collectives(model) as log:
        model.set_bucket_cap_mb(all_gather="auto", reduce_scatter=None)
    assert dict(log) == {"all_gather": 12}

    # One block with a slow custom all-gather: the process group is measured through the default one.
    mixed = _shard(copy.deepcopy(base), mesh)
    mixed.blocks[1].set_custom_all_gather(_SleepyAllGather())  # type: ignore[operator]
    fit = mixed.set_bucket_cap_mb("auto", None).all_gather_fit
    assert fit is not None
    assert fit.latency_s < DELAY_S / 2, fit

    # Every group custom: its collective is what the process group offers, so it is measured.
    custom = _shard(copy.deepcopy(base), mesh)
    for module in custom.modules():
        if isinstance(module, fsdp2.FSDPModule):
            module.set_custom_all_gather(_SleepyAllGather())
    fit = custom.set_bucket_cap_mb("auto", None).all_gather_fit
    assert fit is not None
    assert fit.latency_s >= DELAY_S * 0.9, fit
    # Custom collectives still run per group (they never bucket); numbers equal the unbucketed run.
    plain = _shard(copy.deepcopy(base), mesh)
    counts: list[Any] = []
    want, got = _train(plain, DIMS[0], 2, 1), _train(custom, DIMS[0], 2, 1, counts)
    for w, g in zip(want, got, strict=True):
        for a, b in zip(w, g, strict=True):
            torch.testing.assert_close(b, a, **EXACT)
    assert counts[1]["all_gather"] == 2 * len(DIMS) - 1  # the root keeps its parameters for backward


def test_measures_the_groups_own_collectives() -> None:
    run_threaded(2, _measured_collectives_body)


# ---- arguments -----------------------------------------------------------------------------------


def _arguments_body() -> None:
    torch.manual_seed(0)
    model = _shard(broadcast_module_(Blocks(DIMS)), init_device_mesh("cpu", (2,)))
    caps = model.set_bucket_cap_mb("auto")
    assert caps.all_gather_fit is not None
    assert caps.reduce_scatter_fit is not None
    assert caps.all_gather is not None
    assert caps.reduce_scatter is not None
    assert MIN_CAP <= caps.all_gather <= MAX_CAP
    assert MIN_CAP <= caps.reduce_scatter <= MAX_CAP
    assert caps.all_gather_mb == caps.all_gather / MIB
    caps = model.set_bucket_cap_mb(None, "auto")
    assert caps.all_gather is None
    assert caps.all_gather_fit is None
    assert caps.reduce_scatter_fit is not None
    assert _caps(model) == (None, caps.reduce_scatter)
    caps = model.set_bucket_cap_mb(2, "auto")
    assert caps.all_gather == 2 * MIB
    assert caps.reduce_scatter_fit is not None
    caps = model.set_bucket_cap_mb(3)  # a number alone: the reduce-scatter cap stays None, as before
    assert caps == fsdp2.BucketCaps(3 * MIB, None)
    assert _caps(model) == (3 * MIB, None)
    assert model.set_bucket_cap_mb() == fsdp2.BucketCaps(None, None)


def test_arguments() -> None:
    run_threaded(2, _arguments_body)


def test_single_rank_shard_group_measures_nothing() -> None:
    def body() -> None:
        model = _shard(Blocks(DIMS), init_device_mesh("cpu", (1,)))
        with record_collectives(model) as log:
            caps = model.set_bucket_cap_mb("auto")
        assert caps == fsdp2.BucketCaps(None, None)
        assert not log
        model(_input(DIMS[0], 0, 0)).sum().backward()

    run_threaded(1, body)


# ---- the fit and the cap -------------------------------------------------------------------------


def test_cap_is_k_latencies_of_bytes_within_the_clamps() -> None:
    fit = fsdp2.CollectiveFit(latency_s=1e-3, seconds_per_byte=1e-9)  # 1 ms, 1 GB/s
    assert fit.seconds(10**6) == pytest.approx(2e-3)
    assert fit.cap() == round(CAP_LATENCIES * 1e6)
    assert fsdp2.CollectiveFit(1e-6, 1e-9).cap() == MIN_CAP  # 4 KB: below the lower clamp
    assert fsdp2.CollectiveFit(1.0, 1e-9).cap() == MAX_CAP  # 4 GB: above the upper one
    assert fsdp2.CollectiveFit(1e-3, 0.0).cap() == MAX_CAP  # no measurable per-byte cost
    assert fsdp2.CollectiveFit(0.0, 1e-9).cap() == MIN_CAP


# ---- errors --------------------------------------------------------------------------------------

BAD_STRINGS = ["Auto", "AUTO", "fast", "", "25"]


def _errors_body() -> None:
    torch.manual_seed(0)
    model = _shard(broadcast_module_(Blocks(DIMS)), init_device_mesh("cpu", (2,)))
    model.set_bucket_cap_mb(1, 2)
    for bad in BAD_STRINGS:
        for args in ((bad, None), (None, bad), (bad,)):
            with record_collectives(model) as log, pytest.raises(ValueError, match="None or 'auto'"):
                model.set_bucket_cap_mb(*args)
            assert not log
            assert _caps(model) == (MIB, 2 * MIB)
    with pytest.raises(ValueError, match="or 'auto'"):
        model.set_bucket_cap_mb([1], "auto")  # type: ignore[arg-type]
    model(_input(DIMS[0], dist.get_rank(), 0)).sum().backward()
    child = model.blocks[0]
    assert isinstance(child, fsdp2.FSDPModule)
    with record_collectives(model) as log, pytest.raises(RuntimeError, match="root"):
        child.set_bucket_cap_mb("auto")
    assert not log
    assert _caps(model) == (MIB, 2 * MIB)
    seen: list[BaseException] = []

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        try:
            model.set_bucket_cap_mb("auto")
        except RuntimeError as error:
            seen.append(error)

    handle = model.blocks[1].register_forward_hook(hook)
    with record_collectives(model) as log:
        model(_input(DIMS[0], dist.get_rank(), 1)).sum().backward()
    handle.remove()
    assert len(seen) == 1
    assert "between training steps" in str(seen[0])
    assert _caps(model) == (MIB, 2 * MIB)
    # Only the training step's own collectives: bucketed by the 1 / 2 MiB caps, nothing measured.
    assert dict(log) == {"all_gather": 2, "reduce_scatter": 1}


def test_errors() -> None:
    run_threaded(2, _errors_body)
