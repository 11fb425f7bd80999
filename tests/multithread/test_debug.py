"""Debug mode (``fsdp2.set_debug`` / ``FSDP2_DEBUG=1``): errors and reports instead of silent hangs.

- Ranks whose models differ raise the same error on every rank at the first forward, naming the
  first parameter that differs, instead of hanging in mismatched collectives (threads here; real gloo
  processes in ``tests/multiprocess/test_debug_gloo.py``).
- A collective that does not finish within the deadline is reported with its module group, kind and
  training state while it waits.
- With debug off, the same mismatch is not checked (no extra collective).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import fsdp2
from fsdp2.testing import RanksTimeoutError, count_collectives, run_ranks


@pytest.fixture
def debug() -> Iterator[list[str]]:
    reports: list[str] = []
    lock = threading.Lock()

    def report(message: str) -> None:
        with lock:
            reports.append(message)

    fsdp2.set_debug(True, deadline=1.0, report=report)
    try:
        yield reports
    finally:
        fsdp2.set_debug(False)


def _model(rank: int, wide_on_rank: int | None) -> nn.Module:
    torch.manual_seed(0)
    width = 8 if rank == wide_on_rank else 4
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, width), nn.Linear(width, 2))
    for layer in (model[0], model[2]):
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
    return model


def test_different_models_raise_on_every_rank(debug: list[str]) -> None:
    def body(rank: int, world_size: int) -> str:
        model = _model(rank, wide_on_rank=1)
        with pytest.raises(RuntimeError, match=r"ranks manage different models") as info:
            model(torch.ones(2, 4))
        return str(info.value)

    start = time.monotonic()
    messages = run_ranks(3, body, timeout=60)
    assert time.monotonic() - start < 30
    assert len(set(messages)) == 1  # the same error on every rank
    # The root's group comes first (pre-order), and its head is where the shapes first differ.
    assert "parameter '3.weight' on rank 0 (shape (2, 4)" in messages[0]
    assert "'3.weight' on rank 1 (shape (2, 8)" in messages[0]


def test_same_models_pass_with_one_extra_collective(debug: list[str]) -> None:
    def body(rank: int, world_size: int) -> int:
        model = _model(rank, wide_on_rank=None)
        with count_collectives() as counts:
            model(torch.ones(2, 4)).sum().backward()
            model(torch.ones(2, 4)).sum().backward()  # checked once, at the first forward only
        return counts["all_gather"]

    fsdp2.set_debug(False)
    plain = run_ranks(2, body)
    fsdp2.set_debug(True, deadline=1.0)
    checked = run_ranks(2, body)
    assert checked[0] == plain[0] + 2  # all_gather_object of the fingerprint: sizes, then payloads


@pytest.mark.slow
def test_a_stuck_collective_is_reported_with_its_group_and_state(debug: list[str]) -> None:
    def body(rank: int, world_size: int) -> None:
        model = _model(rank, wide_on_rank=None)
        model(torch.ones(2, 4)).sum().backward()
        if rank == 0:
            model(torch.ones(2, 4))  # rank 1 skips this forward: rank 0 waits in the root's all-gather

    with pytest.raises(RanksTimeoutError, match=r"ranks \[0\]"):
        run_ranks(2, body, timeout=4.0)
    assert debug, "no report"
    # On a loaded machine the first forward's model check may outlast 1 s too and be reported first.
    expected = "rank 0 has waited 1 s in the all-gather of module group <root> (training state FORWARD)"
    assert any(expected in report for report in debug), debug
