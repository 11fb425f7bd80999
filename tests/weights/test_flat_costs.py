"""Exports' Python work does not grow with the world size (counted in lines, not timed).

Rank 1 of 8 and of 4,096 simulated ranks (torch's fake process group, ``tests/shared/simulated``)
exports a model of three ``Linear(8, 6)`` layers (FSDP): ``save_pretrained`` (rank 1 writes what
its files hold, fewer at 4,096 ranks) and a first ``WeightSync`` call (every parameter gathered and
cut back into full tensors). A loop over every rank (a send, an expected size or a received piece per
rank) would add at least 4,088 lines at 4,096 ranks; the bound allowed is 200.
"""

from __future__ import annotations

import pytest

from tests.shared.simulated import fsdp2_lines

_MODEL = """
def _model():
    import torch, torch.nn as nn, fsdp2
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 6) for _ in range(3)])
    model.forward = lambda x: sum(layer(x) for layer in model)
    for layer in model:
        fsdp2.fully_shard(layer)
    return fsdp2.fully_shard(model)
"""

_SAVE = (
    _MODEL
    + """
def setup(world):
    import tempfile, fsdp2
    model, directory = _model(), tempfile.mkdtemp()
    return lambda: fsdp2.save_pretrained(model, directory)
"""
)

_SYNC = (
    _MODEL
    + """
def setup(world):
    import fsdp2
    model = _model()
    return lambda: list(fsdp2.WeightSync(model).updates())
"""
)


@pytest.mark.slow  # a fresh interpreter: about 10 s
@pytest.mark.parametrize("setup", [_SAVE, _SYNC], ids=["save_pretrained", "weight_sync_first_call"])
def test_an_export_runs_no_more_lines_at_4096_ranks_than_at_8(setup: str) -> None:
    lines = fsdp2_lines(setup, (8, 4096))
    assert lines[8] > 100  # the export ran fsdp2's code
    assert lines[4096] - lines[8] <= 200, lines
