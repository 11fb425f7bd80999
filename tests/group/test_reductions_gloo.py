"""Rank-ordered reductions and budgeted accumulation in real gloo processes (one spawn of 4).

On gloo beyond 2 ranks the reduce-scatter's summation order depends on where an element sits in the
buffer, so bucketing changes the last bits of the default reduction; the deterministic reduction must
not. The cases are the thread-rank tests' own (``tests/group/test_ordered_reduction.py``,
``tests/optim/test_accumulate.py``), run here over gloo:

- deterministic: parameters after three AdamW steps bit-identical for FSDP, FSDP bucketed, FSDP with
  explicit prefetch and no reshard after forward, HSDP 2 x 2, and a second FSDP run; first gradients
  bit-equal to the pairwise-tree sum of every rank's unsharded gradients;
- wire dtype: the bf16-wire gradient is the exact fp32 sum of the bf16 gradients (FSDP and HSDP) for
  half the bytes of the fp32 reduce-scatter;
- accumulate: a budget that keeps two groups matches syncing every micro-batch, bucketed or not, and
  never holds more than the budget;
- conditional compute (``tests/group/test_conditional_compute.py``): a mixture-of-experts layer
  whose experts get tokens on some ranks only trains like the unsharded reference with fsdp2's
  defaults, FSDP and HSDP, no hang.
"""

from __future__ import annotations

import pytest
import torch

from tests._harness import run_multiprocess
from tests._training import EXACT
from tests.shared.accumulate import _run as accumulate_run
from tests.shared.moe import _train as moe_train
from tests.shared.ordered import BF16, LAYOUTS, _deterministic, _wire

pytestmark = pytest.mark.multiprocess  # spawns gloo processes (conftest: slow, their time limit)

WORLD_SIZE = 4


def _all_cases() -> None:
    params = {layout: _deterministic(layout)[1] for layout in LAYOUTS}
    params["fsdp-again"] = _deterministic("fsdp")[1]
    for layout, values in params.items():
        for got, want in zip(values, params["fsdp"], strict=True):
            torch.testing.assert_close(got, want, **EXACT, msg=lambda m, la=layout: f"{la}: {m}")

    got, expected, sent, _ = _wire(BF16)
    *_, fp32_sent, _ = _wire(None)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, **EXACT)
    assert sent * 2 == fp32_sent
    got, expected, _, _ = _wire(BF16, True)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, **EXACT)

    for option in ("", "hsdp"):
        assert moe_train(option)["idle_somewhere"] > 0

    for options in ({}, {"bucketed": True}):
        result = accumulate_run(300, options)
        assert result["kept"] == ["0", "1"]
        assert max(result["held"]) <= 300


@pytest.mark.multiprocess
def test_reductions_in_gloo_processes() -> None:
    run_multiprocess(WORLD_SIZE, _all_cases)
