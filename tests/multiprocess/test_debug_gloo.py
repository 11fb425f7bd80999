"""Debug mode in 2 real gloo processes whose models differ: both raise within seconds.

Without debug mode the mismatched collectives would fail or hang (up to the process group timeout);
with ``FSDP2_DEBUG``-style checking on, the first forward compares the ranks' parameters and every
rank raises the same error naming the first parameter that differs.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp2
from tests._harness import run_multiprocess

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
