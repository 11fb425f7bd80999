"""Tree-ordered gradient reductions: ``MixedPrecisionPolicy(wire_dtype=...)`` and
``FSDPModule.set_deterministic_reduction``, threads as ranks.

The reference is computed from every rank's unsharded gradients: a plain copy of the model runs the same
inputs on each rank, the ranks' gradients are gathered, summed by the pairwise tree in global rank order
(in fp32: ``(g0 + g1) + (g2 + g3)`` at 4 ranks) and divided by the world size. fsdp2's sharded
gradients must equal it bit for bit:

- wire dtype: bf16 parameters, fp32 reduction, bf16 on the wire; the bytes sent per rank (recorded from
  the collectives) are half those of the fp32 reduce-scatter;
- deterministic: the same parameters after three AdamW steps on 4 FSDP ranks (bucketed and not, with
  explicit prefetch and without resharding after forward) and on 2 x 2 HSDP ranks, and in two runs;
  HSDP's replica step sends what the default all-reduce sends, up to padding;
- settings it cannot honour are refused before anything changes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2.testing import record_collectives
from tests._harness import run_threaded
from tests._training import EXACT
from tests.shared.ordered import (
    BF16,
    FP32,
    LAYOUTS,
    _batch,
    _deterministic,
    _model,
    _shard,
    _tree_ordered_mean,
    _wire,
)

# ---- fp32 sums of bf16 bytes ---------------------------------------------------------------------


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
        assert calls == 6  # per group: the shard group's all-to-all, then the replicas'


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
                means = _tree_ordered_mean([p.grad for p in ref.parameters()])
                expected = means if not expected else [e + m for e, m in zip(expected, means, strict=True)]
    if not sync_each:
        expected = _tree_ordered_mean(held)
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


Call = tuple[str, str, int, int]  # kind, module, input bytes, bytes sent


def _hsdp_calls(deterministic: bool) -> list[Call]:
    """The collectives of the second backward, in order (the first initialises lazily)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _shard(_model(), mesh)
    model.set_deterministic_reduction(deterministic)
    model(_batch(0)).sum().backward()
    with record_collectives(model) as log:
        model(_batch(1)).sum().backward()
    return [(c.kind, c.module_fqn, c.input_bytes, c.sent_bytes) for c in log.calls]


def _hsdp_replica_step() -> tuple[list[Call], list[Call]]:
    return _hsdp_calls(True), _hsdp_calls(False)


def test_hsdp_sums_replicas_with_an_all_to_all_and_a_gather_of_shard_sized_chunks() -> None:
    # Per group: the shard group's all-to-all (the default's reduce-scatter bytes), then the replicas'
    # all-to-all of this rank's (S,) partial sum cut into R = 2 chunks and the all-gather of the summed
    # chunks: (R - 1) * ceil(S / R) elements each, the default all-reduce's 2 (R - 1) / R * S in all
    # (up to one padding element a chunk), never the R * W * S contributions of every rank.
    for ordered, default in run_threaded(4, _hsdp_replica_step):
        plain = {fqn: (inp, sent) for kind, fqn, inp, sent in default if kind == "reduce_scatter"}
        all_reduce = {fqn: inp for kind, fqn, inp, _ in default if kind == "all_reduce"}
        assert sorted(plain) == sorted(all_reduce) == ["", "0", "2"]
        assert sum(kind in ("reduce_scatter", "all_reduce") for kind, *_ in ordered) == 0
        starts = [i for i, (kind, *_) in enumerate(ordered) if kind == "all_to_all"][::2]
        assert len(starts) == 3
        for i in starts:
            (_, fqn, *shard_step), replicas, gather = ordered[i : i + 3]
            chunk_bytes = -(-all_reduce[fqn] // 4 // 2) * 4  # ceil(S / R) fp32 elements
            assert tuple(shard_step) == plain[fqn]  # the shard group: the reduce-scatter's bytes
            assert replicas == ("all_to_all", fqn, 2 * chunk_bytes, chunk_bytes)
            assert gather == ("all_gather", fqn, chunk_bytes, chunk_bytes)
            assert 2 * chunk_bytes - all_reduce[fqn] in (0, 4)  # the all-reduce's bytes, padded


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
    assert (log["all_to_all"], log["reduce_scatter"]) == (6, 0)


def test_settings_it_cannot_honour_are_refused_before_any_change() -> None:
    run_threaded(4, _refusals)
