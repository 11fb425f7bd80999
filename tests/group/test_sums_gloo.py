"""fsdp2's sums equal torch's on 4 gloo ranks when its reduce-scatter rows carry a usage row (issue 51).

gloo's reduce-scatter sums an element in an order set by the ring chunk that holds it (see [Note: Ring
summation order] in ``fsdp2/comm/_collectives.py``). fsdp2's rows end with a usage row
(``group/_usage.py``); rows of odd length moved the first elements of ranks 1-3 into the previous
chunk, so those elements of a block's first gradient (a fused ``wqkv``) differed from torch's by an
ulp (torchtitan's qwen3 ``debugmodel_moe``: rows of 9,834,688 + 11, 38 segments a chunk; fixed with 27
zeros). One spawn of 4 processes:

- a block whose usage row has 5 elements (rows of 392 + 5 in fsdp2, 392 in torch): every gradient
  bit-identical to torch's ``fully_shard``'s after each of two steps;
- the raw collective: ``[gradients | usage row]`` rows sum the gradient columns unlike torch's
  ``[gradients]`` rows; with ``same_order_tail``'s zeros between they sum them alike, also for a
  buffer of over 8 MiB (more than two segments per chunk);
- the all-reduce of HSDP and ``replicate`` (one row of gradients, then the usage row):
  ``all_reduce_before_tail`` sums the gradients as an all-reduce of them alone, with one collective
  where the tail keeps every cut (1,001 + 3) and two where it moves one (144 + 1: torchtitan's
  position embeddings in a ``replicate`` test; 8 MiB + 7); a plain all-reduce of the same buffer
  sums some of them otherwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp2
from fsdp2.comm._collectives import all_reduce_before_tail, same_order_tail
from tests._harness import run_multiprocess
from tests._training import EXACT

pytestmark = pytest.mark.multiprocess  # spawns gloo processes (conftest: slow, their time limit)

WORLD_SIZE = 4


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Linear(16, 48, bias=False)  # fused q, k, v: the first gradient of the group
        self.norm = nn.RMSNorm(16)
        self.wo = nn.Linear(48, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(torch.tanh(self.wqkv(self.norm(x))))


def _local_grads(impl: str) -> list[dict[str, torch.Tensor]]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    shard = fsdp2.fully_shard if impl == "fsdp2" else torch_fully_shard
    torch.manual_seed(0)  # same seed in every process: identical initial parameters
    model = nn.Sequential(_Block(), _Block())
    for block in model:
        shard(block)
    shard(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for step in range(2):
        torch.manual_seed(100 + 10 * step + dist.get_rank())
        model(torch.randn(8, 16)).square().sum().backward()
        steps.append({n: p.grad.to_local().clone() for n, p in model.named_parameters()})
        optim.step()
        optim.zero_grad()
    return steps


def _reduced(rows: torch.Tensor) -> torch.Tensor:
    output = torch.empty(rows.size(1))
    dist.reduce_scatter_tensor(output, rows.reshape(-1).contiguous(), op=dist.ReduceOp.AVG)
    return output


def _raw_collective(width: int, usage: int) -> tuple[bool, bool]:
    """(without zeros, with zeros): whether the gradient columns sum as without a usage row."""
    generator = torch.Generator().manual_seed(width + dist.get_rank())
    grads = torch.randn(WORLD_SIZE, width, generator=generator) * 1e3
    want = _reduced(grads)
    ones = torch.ones(WORLD_SIZE, usage)
    bare = _reduced(torch.cat([grads, ones], 1))[:width]
    tail = same_order_tail(WORLD_SIZE, width, usage, 4)
    zeros = torch.zeros(WORLD_SIZE, tail - usage)
    padded = _reduced(torch.cat([grads, zeros, ones], 1))[:width]
    return torch.equal(bare, want), torch.equal(padded, want)


def _all_reduced(width: int, tail: int) -> tuple[bool, bool, int]:
    """(plain all-reduce, ``all_reduce_before_tail``): whether the gradients sum as alone; collectives."""
    generator = torch.Generator().manual_seed(width + dist.get_rank())
    grads = torch.randn(width, generator=generator) * 1e3
    want = grads.clone()
    dist.all_reduce(want)
    plain = torch.cat([grads, torch.ones(tail)])
    dist.all_reduce(plain)
    kept = torch.cat([grads, torch.ones(tail)])
    group = dist.group.WORLD
    issued = all_reduce_before_tail(kept, tail, group, dist.ReduceOp.SUM, _plain_all_reduce)
    assert torch.equal(kept[width:], torch.full((tail,), float(WORLD_SIZE)))
    return torch.equal(plain[:width], want), torch.equal(kept[:width], want), issued


def _plain_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp.RedOpType) -> None:
    dist.all_reduce(tensor, op=op, group=group)


def _all_cases() -> None:
    for got, want in zip(_local_grads("fsdp2"), _local_grads("torch"), strict=True):
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, **EXACT, msg=lambda m, n=name: f"{n}: {m}")
    bare, padded = _raw_collective(1000, 3)
    assert padded
    # the cause: without the zeros the first elements of ranks 1-3 sum in another order
    flags = [None] * WORLD_SIZE
    dist.all_gather_object(flags, bare)
    assert not all(flags)
    for width, usage in ((999, 2), (600_001, 5)):  # odd rows; over 8 MiB: more than 2 segments a chunk
        assert _raw_collective(width, usage)[1], (width, usage)
    assert _all_reduced(1001, 3) == (True, True, 1)  # 1,004 keeps the cuts of 1,001 (chunks of 252)
    for width, tail in ((144, 1), (1 << 21, 7)):  # chunks of 36 -> 38; 8 MiB: 8 segments -> 12
        plain, kept, issued = _all_reduced(width, tail)
        assert kept, (width, tail)
        assert issued == 2, (width, tail)
        flags = [None] * WORLD_SIZE
        dist.all_gather_object(flags, plain)
        assert not all(flags), (width, tail)  # the cause: one all-reduce sums some elements otherwise


def test_sums_equal_torchs_with_a_usage_row() -> None:
    run_multiprocess(WORLD_SIZE, _all_cases)
