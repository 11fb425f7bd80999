"""Rank-ordered gradient reductions: ``MixedPrecisionPolicy(wire_dtype=...)`` and
``FSDPModule.set_deterministic_reduction``, threads as ranks.

The reference is computed from every rank's unsharded gradients: a plain copy of the model runs the same
inputs on each rank, the ranks' gradients are gathered, summed one after another in rank order (in
fp32) and divided by the world size. fsdp2's sharded gradients must equal it bit for bit:

- wire dtype: bf16 parameters, fp32 reduction, bf16 on the wire; the bytes sent per rank (recorded from
  the collectives) are half those of the fp32 reduce-scatter;
- deterministic: the same parameters after three AdamW steps on 4 FSDP ranks (bucketed and not, with
  explicit prefetch and without resharding after forward) and on 2 x 2 HSDP ranks, and in two runs;
- settings it cannot honour are refused before anything changes.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2.testing import record_collectives
from tests._harness import run_threaded
from tests._training import EXACT, fill_deterministic_

BF16, FP32 = torch.bfloat16, torch.float32


def _model() -> nn.Sequential:
    """Two blocks with dims the world size does not divide (padding on the wire too)."""
    model = nn.Sequential(nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))
    return fill_deterministic_(model, scale=0.5)  # the same in every run (threads share torch's RNG)


def _shard(model: nn.Sequential, mesh: Any = None, **kwargs: Any) -> nn.Sequential:
    fsdp2.fully_shard(model[0], mesh=mesh, **kwargs)
    fsdp2.fully_shard(model[2], mesh=mesh, **kwargs)
    fsdp2.fully_shard(model, mesh=mesh, **kwargs)
    return model


def _batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(4, 6, generator=gen)


def _rank_ordered_mean(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient summed over the ranks one after another in rank order (fp32), then averaged."""
    world = dist.get_world_size()
    means = []
    for grad in grads:
        gathered = [torch.empty_like(grad) for _ in range(world)]
        dist.all_gather(gathered, grad)
        total = gathered[0].to(FP32, copy=True)
        for other in gathered[1:]:
            total.add_(other)
        means.append(total.div_(world))
    return means


# ---- fp32 sums of bf16 bytes ---------------------------------------------------------------------


def _wire(
    wire: torch.dtype | None, hsdp: bool = False
) -> tuple[list[torch.Tensor], list[torch.Tensor], int, int]:
    model = _model()
    ref = copy.deepcopy(model).to(BF16)  # what fsdp2 computes with param_dtype=bf16
    policy = fsdp2.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, wire_dtype=wire)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    _shard(model, mesh, mp_policy=policy)
    x = _batch(0)
    with record_collectives(model) as log:
        model(x).sum().backward()
    ref(x.to(BF16)).sum().backward()
    expected = _rank_ordered_mean([p.grad for p in ref.parameters()])
    got = [p.grad.full_tensor() for p in model.parameters()]
    reduce_kind = "reduce_scatter" if wire is None else "all_to_all"
    return got, expected, log.sent_bytes(reduce_kind), log[reduce_kind]


@pytest.mark.parametrize("world", [2, 3])
def test_bf16_on_the_wire_is_the_exact_fp32_sum_at_half_the_bytes(world: int) -> None:
    default = run_threaded(world, _wire, None)
    wired = run_threaded(world, _wire, BF16)
    for (got, expected, sent, calls), (_, _, fp32_sent, fp32_calls) in zip(wired, default, strict=True):
        assert got[0].dtype == FP32
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, **EXACT)
        assert calls == fp32_calls == 3  # one per group, all-to-alls instead of reduce-scatters
        assert sent * 2 == fp32_sent, (sent, fp32_sent)


def test_bf16_on_the_wire_with_hsdp_is_the_exact_fp32_sum_of_all_ranks() -> None:
    for got, expected, _, calls in run_threaded(4, _wire, BF16, True):
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, **EXACT)
        assert calls == 3


def _accumulated(
    wire: torch.dtype | None, sync_each: bool, hsdp: bool = False
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, int]]:
    """Two micro-batches: no-sync then synced (``sync_each``: both synced); the gradients, a reference."""
    model = _model()
    ref = copy.deepcopy(model).to(BF16)
    policy = fsdp2.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, wire_dtype=wire)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    _shard(model, mesh, mp_policy=policy)
    expected: list[torch.Tensor] = []
    held = [torch.zeros_like(p, dtype=FP32) for p in ref.parameters()]
    with record_collectives(model) as log:
        for step in range(2):
            model.set_requires_gradient_sync(sync_each or step == 1)
            model(_batch(step)).sum().backward()
            ref.zero_grad()
            ref(_batch(step).to(BF16)).sum().backward()
            for h, p in zip(held, ref.parameters(), strict=True):
                h.add_(p.grad)  # the fp32 sum of bf16 micro-batch gradients, as fsdp2 holds it
            if sync_each:  # each micro-batch reduced alone, the means summed in fp32
                means = _rank_ordered_mean([p.grad for p in ref.parameters()])
                expected = means if not expected else [e + m for e, m in zip(expected, means, strict=True)]
    if not sync_each:
        expected = _rank_ordered_mean(held)
    got = [p.grad.full_tensor() for p in model.parameters()]
    return got, expected, {k: log[k] for k in ("reduce_scatter", "all_to_all")}


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp", "hsdp"])
def test_accumulated_gradients_are_not_rounded_to_the_wire_dtype(hsdp: bool) -> None:
    # A no-sync sum of micro-batches in fp32 is not exact in bf16: that reduction travels in fp32, as
    # without wire_dtype (bit for bit); micro-batches that each sync still use the wire.
    world = 4 if hsdp else 2
    wired = run_threaded(world, _accumulated, BF16, False, hsdp)
    plain = run_threaded(world, _accumulated, None, False, hsdp)
    for (got, _, calls), (plain_got, _, _) in zip(wired, plain, strict=True):
        for g, e in zip(got, plain_got, strict=True):
            torch.testing.assert_close(g, e, **EXACT)
        assert calls == {"reduce_scatter": 3, "all_to_all": 0}
    if not hsdp:
        for got, expected, _ in wired:
            for g, e in zip(got, expected, strict=True):
                torch.testing.assert_close(g, e, **EXACT)
        for got, expected, calls in run_threaded(world, _accumulated, BF16, True):
            assert calls == {"reduce_scatter": 0, "all_to_all": 6}
            for g, e in zip(got, expected, strict=True):
                torch.testing.assert_close(g, e, **EXACT)


# ---- reproducible reductions ---------------------------------------------------------------------

LAYOUTS = ["fsdp", "fsdp-bucketed", "fsdp-prefetch-no-reshard", "hsdp"]


def _deterministic(layout: str, steps: int = 3) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    model = _model()
    ref = copy.deepcopy(model)
    mesh = None
    kwargs: dict[str, Any] = {}
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    if layout == "fsdp-prefetch-no-reshard":
        kwargs["reshard_after_forward"] = False
    _shard(model, mesh, **kwargs)
    if layout == "fsdp-bucketed":
        model.set_bucket_cap_mb(all_gather=1.0, reduce_scatter=1.0)
    if layout == "fsdp-prefetch-no-reshard":
        model[0].set_modules_to_forward_prefetch([model[2]])
        model[2].set_modules_to_backward_prefetch([model[0]])
    model.set_deterministic_reduction()
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    first_grads: list[torch.Tensor] = []
    for step in range(steps):
        x = _batch(step)
        model(x).square().sum().backward()
        if step == 0:
            ref(x).square().sum().backward()
            expected = _rank_ordered_mean([p.grad for p in ref.parameters()])
            first_grads = [p.grad.full_tensor() for p in model.parameters()]
            for got, want in zip(first_grads, expected, strict=True):
                torch.testing.assert_close(got, want, **EXACT)
        optim.step()
        optim.zero_grad()
    return first_grads, [p.full_tensor() for p in model.parameters()]


@pytest.mark.slow
def test_deterministic_reduction_is_bit_identical_across_layouts_and_runs() -> None:
    results = {layout: run_threaded(4, _deterministic, layout) for layout in LAYOUTS}
    results["fsdp-again"] = run_threaded(4, _deterministic, "fsdp")
    baseline = results["fsdp"][0][1]
    for layout, per_rank in results.items():
        for rank, (_, params) in enumerate(per_rank):
            for got, want in zip(params, baseline, strict=True):
                torch.testing.assert_close(
                    got, want, **EXACT, msg=lambda m, r=rank, la=layout: f"{la} {r}: {m}"
                )


def _hsdp_sent() -> tuple[int, int, int]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _shard(_model(), mesh)
    model.set_deterministic_reduction()
    with record_collectives(model) as log:
        model(_batch(0)).sum().backward()
    return log["all_to_all"], log["reduce_scatter"], log["all_reduce"]


def test_hsdp_gathers_replica_contributions_instead_of_all_reducing() -> None:
    for all_to_all, reduce_scatter, all_reduce in run_threaded(4, _hsdp_sent):
        assert (all_to_all, reduce_scatter, all_reduce) == (3, 0, 0)


# ---- what it cannot do ---------------------------------------------------------------------------


def test_policy_validation() -> None:
    with pytest.raises(TypeError, match=r"wire_dtype=...\) expects a torch.dtype or None.*torch.bfloat16"):
        fsdp2.MixedPrecisionPolicy(wire_dtype="bfloat16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"wire_dtype=torch.int8\) must be a floating-point dtype"):
        fsdp2.MixedPrecisionPolicy(wire_dtype=torch.int8)
    with pytest.raises(ValueError, match=r"wider than the dtype gradients are summed in"):
        fsdp2.MixedPrecisionPolicy(reduce_dtype=BF16, wire_dtype=FP32)
    # torch's policy objects keep working (they have no wire_dtype)
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    from fsdp2.base._api import as_fsdp2_policy

    assert as_fsdp2_policy(TorchPolicy(param_dtype=BF16)) == fsdp2.MixedPrecisionPolicy(param_dtype=BF16)


def _refusals() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _shard(_model(), mesh)
    with pytest.raises(TypeError, match=r"set_deterministic_reduction expects a bool"):
        model.set_deterministic_reduction(1)  # type: ignore[arg-type]
    model.set_requires_all_reduce(False)
    with pytest.raises(RuntimeError, match=r"set_requires_all_reduce\(False\) cannot hold partial sums"):
        model.set_deterministic_reduction()
    model.set_requires_all_reduce(True)
    model.set_deterministic_reduction()
    with pytest.raises(RuntimeError, match=r"cannot hold partial sums"):
        model.set_requires_all_reduce(False)
    with pytest.raises(
        RuntimeError, match=r"custom reduce-scatter \(set_custom_reduce_scatter\) would never run"
    ):
        model[0].set_custom_reduce_scatter(fsdp2.ReduceScatter.__subclasses__()[0]())
    # Nothing changed by the refused calls: still ordered, still all-reducing, no custom collective.
    with record_collectives(model) as log:
        model(_batch(0)).sum().backward()
    assert (log["all_to_all"], log["reduce_scatter"]) == (3, 0)


def test_settings_it_cannot_honour_are_refused_before_any_change() -> None:
    run_threaded(4, _refusals)
