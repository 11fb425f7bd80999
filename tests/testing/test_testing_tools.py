"""``fsdp2.testing``: ranks as threads, the unsharded-parity check and collective counts.

Each tool is checked for what it reports on correct code and on broken code: results in rank order,
a failing rank named, a hang turned into an error naming the ranks still waiting, a sharding mistake
caught by ``assert_matches_unsharded``, and exact collective counts.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp2
from fsdp2.testing import RankError, RanksTimeoutError, assert_matches_unsharded, count_collectives, run_ranks


def test_run_ranks_returns_results_in_rank_order() -> None:
    def body(rank: int, world_size: int, scale: int) -> tuple[int, int, float]:
        value = torch.tensor([float(rank)])
        dist.all_reduce(value)
        return rank, world_size, value.item() * scale

    assert run_ranks(3, body, 10) == [(0, 3, 30.0), (1, 3, 30.0), (2, 3, 30.0)]


def test_run_ranks_names_the_failing_rank() -> None:
    class BoomError(Exception):
        pass

    def body(rank: int, world_size: int) -> None:
        if rank == 1:
            raise BoomError("rank one broke")
        dist.barrier()  # the others wait for rank 1, then stop when it fails

    with pytest.raises(RankError, match=r"(?s)rank 1 of 2 failed:.*BoomError: rank one broke") as info:
        run_ranks(2, body)
    assert info.value.rank == 1
    assert isinstance(info.value.__cause__, BoomError)


def test_run_ranks_turns_a_hang_into_an_error_naming_the_ranks() -> None:
    def body(rank: int, world_size: int) -> None:
        if rank != 2:
            dist.all_reduce(torch.ones(1))  # rank 2 never joins: ranks 0 and 1 wait forever

    start = time.monotonic()
    # The ranks that had returned are named as they were at the timeout (not after waking the others).
    match = r"ranks \[0, 1\] of 3 did not finish within 2 s \(ranks \[2\] had returned\)"
    with pytest.raises(RanksTimeoutError, match=match) as info:
        run_ranks(3, body, timeout=2.0)
    assert info.value.ranks == [0, 1]
    assert time.monotonic() - start < 30
    assert run_ranks(2, lambda rank, world: rank) == [0, 1]  # and the next run works


def test_run_ranks_rejects_bad_world_sizes() -> None:
    with pytest.raises(ValueError, match=r"world_size >= 1, got 0"):
        run_ranks(0, lambda rank, world: None)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _shard(model: nn.Module) -> None:
    for block in model.blocks:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * rank + step))


def test_assert_matches_unsharded_passes_for_fsdp2() -> None:
    losses = run_ranks(2, lambda rank, world: assert_matches_unsharded(_Net, _shard, _batch, steps=3))
    assert len(losses[0]) == 3
    assert losses[0] != losses[1]  # different data per rank


def test_assert_matches_unsharded_catches_a_sharding_mistake() -> None:
    def broken_shard(model: nn.Module) -> None:
        _shard(model)
        with torch.no_grad():  # e.g. a bad checkpoint load on one rank
            if dist.get_rank() == 1:
                model.head.bias.to_local().add_(1.0)

    with pytest.raises(RankError, match=r"loss at step 0"):
        run_ranks(2, lambda rank, world: assert_matches_unsharded(_Net, broken_shard, _batch))


def test_count_collectives_counts_a_training_step() -> None:
    def body(rank: int, world_size: int) -> tuple[Counter[str], Counter[str]]:
        torch.manual_seed(0)
        model = _Net()
        _shard(model)
        with count_collectives() as forward:
            loss = model(_batch(rank, 0)).sum()
        with count_collectives() as backward:
            loss.backward()
        return forward, backward

    forward, backward = run_ranks(2, body)[0]
    assert forward == Counter({"all_gather": 3})  # two blocks and the root
    # the root keeps its parameters; the first backward agrees on which submodules ran (all_reduce)
    assert backward == Counter({"all_gather": 2, "reduce_scatter": 3, "all_reduce": 1})


def test_the_docs_example_runs() -> None:
    """docs/testing-your-model.md's snippet, executed as written."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "testing-your-model.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, object] = {}
    exec(compile(code, "testing-your-model.md", "exec"), namespace)
    for name in ("test_sharded_net_trains_like_the_plain_one", "test_one_all_gather_per_block"):
        namespace[name]()  # type: ignore[operator]
