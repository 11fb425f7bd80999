"""``set_bucket_cap_mb`` over real gloo processes (one spawn of 4).

- all-gather bucketing only: bit-identical to the unbucketed run (an all-gather is a copy);
- reduce-scatter bucketing too: gloo's reduce-scatter sums a position's 4 values in an order that
  depends on where it sits in the buffer, so a bucket (a longer buffer, the group at an offset)
  may round the last bit differently: close, not equal (measured: at most ~6e-8 on these grads).
  With 2 ranks (one addition per element) it is exact;
- collective counts per step (the c10d ops each rank dispatches, ``tests/_harness.py``'s
  ``C10dOps``): 2 all-gathers and 1 reduce-scatter once the order is known;
- ``set_bucket_cap_mb("auto")``: every process holds the same caps and fits (the measurement's
  times differ between processes; the agreement makes them equal), at least 1 MiB, which holds this
  model: the same buckets as 25 MiB, so bit-identical to that run.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import fsdp2
from tests._harness import C10dOps, run_multiprocess
from tests.shared.bucketing import Blocks

pytestmark = pytest.mark.multiprocess  # spawns gloo processes (conftest: slow, their time limit)

WORLD_SIZE = 4
DIMS = [16, 19, 23, 17, 31, 21, 18, 29, 22, 25, 32, 32]
STEPS = 3


def _shard(model: Blocks, caps: tuple[float | str | None, ...]) -> Blocks:
    for block in model.blocks:
        fsdp2.fully_shard(block, reshard_after_forward=True)
    fsdp2.fully_shard(model, reshard_after_forward=True)
    chosen = model.set_bucket_cap_mb(*caps)  # type: ignore[arg-type]
    if caps == ("auto",):
        everyone: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, chosen)
        assert all(c == chosen for c in everyone), everyone
        assert chosen.all_gather_fit is not None
        assert chosen.reduce_scatter_fit is not None
        assert min(chosen.all_gather or 0, chosen.reduce_scatter or 0) >= 1024 * 1024, chosen
    return model


def _full(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(model: Blocks) -> tuple[list[torch.Tensor], list[dict[str, int]]]:
    """Losses, first gradients and final parameters (flattened into one list), and counts per step."""
    rank = dist.get_rank()
    params = list(model.parameters())
    optim = torch.optim.AdamW(params, lr=1e-2)
    out: list[torch.Tensor] = []
    counts = []
    names = {
        torch.ops.c10d._allgather_base_: "all_gather",
        torch.ops.c10d._reduce_scatter_base_: "reduce_scatter",
        torch.ops.c10d.allreduce_: "all_reduce",
    }
    for step in range(STEPS):
        x = torch.randn(4, DIMS[0], generator=torch.Generator().manual_seed(100 * step + rank))
        with C10dOps() as mode:
            loss = model(x).sum()
            loss.backward()
        counts.append({names.get(op, str(op)): n for op, n in mode.counts.items() if n})
        out.append(loss.detach())
        if step == 0:
            out.extend(_full(p.grad) for p in params)
        optim.step()
        optim.zero_grad()
    out.extend(_full(p) for p in params)
    return out, counts


def _all_cases() -> None:
    torch.manual_seed(0)  # same seed in every process: identical initial parameters
    base = Blocks(DIMS)
    plain, plain_counts = _train(_shard(copy.deepcopy(base), (None, None)))
    gathered, gathered_counts = _train(_shard(copy.deepcopy(base), (25, None)))
    both, both_counts = _train(_shard(copy.deepcopy(base), (25, 25)))
    auto, auto_counts = _train(_shard(copy.deepcopy(base), ("auto",)))
    for a, b in zip(both, auto, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert auto_counts == both_counts
    for a, b in zip(plain, gathered, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    torch.testing.assert_close(both[0], plain[0], rtol=0, atol=0)  # first loss: nothing reduced yet
    for a, b in zip(plain, both, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    groups = len(DIMS)  # blocks + root
    # the first backward also agrees on which submodules ran (one small all-reduce: conditional compute)
    agreement = {"all_reduce": 1}
    plain_first = {"all_gather": 2 * groups, "reduce_scatter": groups, **agreement}
    plain_later = [{"all_gather": 2 * groups, "reduce_scatter": groups}] * (STEPS - 1)
    assert plain_counts == [plain_first, *plain_later]
    assert gathered_counts[1:] == [{"all_gather": 2, "reduce_scatter": groups}] * (STEPS - 1)
    # forward learns the order
    assert both_counts[0] == {"all_gather": groups + 1, "reduce_scatter": 1, **agreement}
    assert both_counts[1:] == [{"all_gather": 2, "reduce_scatter": 1}] * (STEPS - 1)


@pytest.mark.multiprocess
def test_bucketing_on_gloo() -> None:
    run_multiprocess(WORLD_SIZE, _all_cases)
