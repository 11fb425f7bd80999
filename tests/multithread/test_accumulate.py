"""``fsdp2.accumulate``: gradient accumulation within a memory budget, threads as ranks.

Reference: the same sharded model syncing every micro-batch (fsdp2's default), and the unsharded
model with gradients averaged over the ranks. Checked for budgets 0, None and in between: which groups
were kept, the gradient collectives issued, the unsharded gradient bytes held after each
micro-batch (never above the budget), and the gradients and parameters after AdamW steps; with bf16
mixed precision, HSDP, CPU offload and bucketing; and the errors.
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
from fsdp2.group import held_grad_bytes
from fsdp2.runtime import groups_under
from tests._harness import run_threaded
from tests._training import average_grads, fill_deterministic_

MICRO = 3
# Groups (bytes of fp32 unsharded gradients): a 4x4 block (80), an 8x4 block (160), a 16x8 block (576)
# and the root's head, 3x16 (204).
SIZES = {"0": 80, "1": 160, "2": 576, "": 204}


def _model() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 8), nn.Linear(8, 16), nn.Linear(16, 3))
    return fill_deterministic_(model, scale=0.5)


def _shard(model: nn.Sequential, **kwargs: Any) -> nn.Sequential:
    for block in model[:3]:
        fsdp2.fully_shard(block, **kwargs)
    fsdp2.fully_shard(model, **kwargs)
    return model


def _batch(step: int, micro: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    return torch.randn(2, 4, generator=gen)


def _held(model: nn.Module) -> int:
    return sum(held_grad_bytes(g) for g in groups_under(model))


def _run(budget: int | None, options: dict[str, Any], steps: int = 2) -> dict[str, Any]:
    mesh = None
    kwargs: dict[str, Any] = {}
    if options.get("hsdp"):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        kwargs["mesh"] = mesh
    if options.get("bf16"):
        kwargs["mp_policy"] = fsdp2.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if options.get("offload"):
        kwargs["offload_policy"] = fsdp2.CPUOffloadPolicy(pin_memory=False)
    model = _model()
    unsharded = copy.deepcopy(model)
    synced = _shard(copy.deepcopy(model), **kwargs)
    model = _shard(model, **kwargs)
    if options.get("bucketed"):
        for m in (model, synced):
            m.set_bucket_cap_mb(all_gather=1.0, reduce_scatter=1.0)
    optims = [torch.optim.AdamW(m.parameters(), lr=0.05) for m in (model, synced, unsharded)]
    out: dict[str, Any] = {"held": []}
    for step in range(steps):
        with fsdp2.accumulate(model, budget_bytes=budget) as acc:
            for micro in range(MICRO):
                x = _batch(step, micro)
                model(x).sum().backward()
                out["held"].append(_held(model))
                synced(x).sum().backward()
                if step == 0:
                    unsharded(x).sum().backward()
        if step == 0:
            average_grads(unsharded)
            out["kept"], out["reduced"] = sorted(acc.kept), sorted(acc.reduced_each_micro_batch)
            out["kept_bytes"], out["collectives"] = acc.kept_bytes, acc.collectives
            for p, s, u in zip(model.parameters(), synced.parameters(), unsharded.parameters(), strict=True):
                torch.testing.assert_close(p.grad.full_tensor(), s.grad.full_tensor(), rtol=1e-6, atol=1e-6)
                if not options.get("bf16"):
                    torch.testing.assert_close(p.grad.full_tensor(), u.grad, rtol=1e-5, atol=1e-6)
        assert _held(model) == 0, "gradients still held after the context"
        for optim in optims:
            optim.step()
            optim.zero_grad()
    for p, s in zip(model.parameters(), synced.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), s.full_tensor(), rtol=1e-5, atol=1e-6)
    return out


BUDGETS = [
    pytest.param(None, ["", "0", "1", "2"], 4, id="None-keeps-all"),
    pytest.param(0, [], 4 * MICRO, id="0-keeps-none"),
    # 300 bytes hold the two smallest groups (80 + 160); the root's 204 would exceed it.
    pytest.param(300, ["0", "1"], 2 + 2 * MICRO, id="300-keeps-the-two-smallest"),
    pytest.param(500, ["", "0", "1"], 3 + MICRO, id="500-keeps-three"),
]


@pytest.mark.parametrize(("budget", "kept", "collectives"), BUDGETS)
def test_kept_groups_collectives_and_held_bytes(
    budget: int | None, kept: list[str], collectives: int
) -> None:
    for result in run_threaded(2, _run, budget, {}):
        assert result["kept"] == kept
        assert result["reduced"] == sorted(set(SIZES) - set(kept))
        assert result["kept_bytes"] == sum(SIZES[name] for name in kept)
        assert result["collectives"] == collectives  # reduce-scatters: MICRO per reduced group, 1 per kept
        assert max(result["held"]) == result["kept_bytes"]
        if budget is not None:
            assert max(result["held"]) <= budget


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("option", ["bf16", "hsdp", "offload", "bucketed"])
def test_accumulation_composes(option: str) -> None:
    world = 4 if option == "hsdp" else 2
    for result in run_threaded(world, _run, 300, {option: True}):
        # bf16 params with an fp32 reduce dtype: gradients kept in fp32 (same bytes as fp32 params).
        assert result["kept"] == ["0", "1"]
        assert max(result["held"]) <= 300


def _errors() -> None:
    model = _shard(_model())
    for bad, error in (("1MB", TypeError), (True, TypeError), (1.5, TypeError), (-1, ValueError)):
        with pytest.raises(error, match=r"budget_bytes must be"), fsdp2.accumulate(model, budget_bytes=bad):  # type: ignore[arg-type]
            pass
    with (
        pytest.raises(ValueError, match=r"no fully_shard module in its tree"),
        fsdp2.accumulate(nn.Linear(2, 2)),
    ):
        pass
    optim = torch.optim.SGD(model.parameters(), lr=0.1)

    def failing_micro_batch(budget: int | None) -> None:
        with fsdp2.accumulate(model, budget_bytes=budget):
            model(_batch(0, 0)).sum().backward()
            raise KeyError("a failing micro-batch")

    for budget, zero_grad in ((None, optim.zero_grad), (0, model.zero_grad)):
        before = [p.full_tensor().clone() for p in model.parameters()]
        with pytest.raises(KeyError):
            failing_micro_batch(budget)
        # Kept (None) or reduced (0), the gradients hold a partial accumulation: the step refuses it.
        with pytest.raises(RuntimeError, match=rf"budget_bytes={budget}\) raised.*partial accumulation"):
            optim.step()
        for param, old in zip(model.parameters(), before, strict=True):
            torch.testing.assert_close(param.full_tensor(), old, rtol=0, atol=0)
        zero_grad()
        assert all(p.grad is None for p in model.parameters())
        model(_batch(0, 1)).sum().backward()  # syncs again, as before the context
        assert _held(model) == 0
        optim.step()
        for param, old in zip(model.parameters(), before, strict=True):
            assert not torch.equal(param.full_tensor(), old)


def test_errors_and_an_exception_inside() -> None:
    run_threaded(2, _errors)
