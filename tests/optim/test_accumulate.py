"""``fsdp2.accumulate``: gradient accumulation within a memory budget, threads as ranks.

Reference: the same sharded model syncing every micro-batch (fsdp2's default), and the unsharded
model with gradients averaged over the ranks. Checked for budgets 0, None and in between: which groups
were kept, the gradient collectives issued, the unsharded gradient bytes held after each
micro-batch (never above the budget), and the gradients and parameters after AdamW steps; with bf16
mixed precision, HSDP, CPU offload and bucketing; and the errors.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fsdp2
from tests._harness import run_threaded
from tests.shared.accumulate import MICRO, _batch, _held, _model, _run, _shard

# Groups (bytes of fp32 unsharded gradients): a 4x4 block (80), an 8x4 block (160), a 16x8 block (576)
# and the root's head, 3x16 (204).
SIZES = {"0": 80, "1": 160, "2": 576, "": 204}


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
