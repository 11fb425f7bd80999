"""``fsdp2.shard_experts``: expert parallelism in one line, against the single-process model.

Threads as ranks. Each rank routes its own batch; ``shard_experts(model, ep=...)`` keeps ``E / ep``
experts per rank, exchanges the tokens, shards the local stacks over ``efsdp``; then the blocks and the
root are sharded as usual. Losses, gradients and parameters over 3 SGD steps must equal the reference
(the unsharded model, gradients of the mean over every rank's batch), with no divisor set, to fp32's
rounding: an expert's rows from every ``ep`` rank meet in one matmul here and in one per rank there,
so the sums run in another order (SGD keeps such ulps ulps; Adam's normalisation would blow a
near-zero gradient's up to a full step).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp2
from tests._harness import assert_sharded_parity, run_threaded
from tests._training import fill_deterministic_
from tests.shared.experts_models import DIM, Net

TOKENS = 5


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(experts: int, ep: int, top_k: int, counted: bool, hsdp: bool) -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    names = ("replicate", "shard") if hsdp else ("dp",)
    mesh = init_device_mesh("cpu", (2, world // 2) if hsdp else (world,), mesh_dim_names=names)
    ref = fill_deterministic_(Net(experts, top_k, counted), scale=0.5)
    model = copy.deepcopy(ref)
    fsdp2.shard_experts(model, ep=ep, mesh=mesh)
    for layer in model.layers:
        fsdp2.fully_shard(layer, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    stack = model.layers[0].experts.down_proj if not counted else model.layers[0].experts.w2
    assert isinstance(stack, DTensor)
    out = {"placements": tuple(map(str, stack.placements)), "local": tuple(stack.to_local().shape)}
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x = _batch(rank, step)
        loss, ref_loss = model(x).pow(2).mean(), ref(x).pow(2).mean()
        loss.backward()
        ref_loss.backward()
        for param in ref.parameters():
            if param.grad is None:  # an expert no token of this rank reached
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
        assert_sharded_parity(ref, model, grads=True)
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
    assert_sharded_parity(ref, model)
    return out


CASES = {
    # (experts, ep, top_k, counted, hsdp, world)
    "routed-ep2-efsdp2-top2": (8, 2, 2, False, False, 4),
    "counted-ep2-efsdp2-top1": (8, 2, 1, True, False, 4),
    "routed-ep4-efsdp1": (8, 4, 2, False, False, 4),
    "routed-uneven-3-over-2": (6, 2, 2, False, False, 4),  # 3 local experts over 2 efsdp ranks: [2, 1]
    "routed-ep1": (8, 1, 2, False, False, 4),
    "routed-hsdp-ep2": (8, 2, 2, False, True, 4),
    "routed-hsdp-ep2-efsdp2": (8, 2, 2, False, True, 8),
    # 2 local experts over 4 efsdp ranks: w2 on Shard(1); w1 (3 rows) on Shard(0), two empty shards
    "counted-short-stack-shard1": (4, 2, 1, True, False, 8),
    # 160 experts, 40 tokens in all: most experts (and some ep ranks' every expert) get no token anywhere
    "routed-160-ep8-top1": (160, 8, 1, False, False, 8),
    "counted-160-ep4-efsdp2-top2": (160, 4, 2, True, False, 8),
}


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("case", list(CASES))
def test_shard_experts_trains_like_the_reference(case: str) -> None:
    experts, ep, top_k, counted, hsdp, world = CASES[case]
    results = run_threaded(world, _train, experts, ep, top_k, counted, hsdp)
    assert results


def _glm_layout() -> int:
    """160 experts at ep 8 on 64 ranks (GLM-4.6's layout): 20 local experts over 8 efsdp ranks."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (64,), mesh_dim_names=("dp",))
    ref = fill_deterministic_(Net(160, top_k=2, layers=1), scale=0.5)
    model = copy.deepcopy(ref)
    fsdp2.shard_experts(model, ep=8, mesh=mesh)
    fsdp2.fully_shard(model.layers[0], mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    x = torch.randn(3, DIM, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    for param in ref.parameters():
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
    assert_sharded_parity(ref, model, grads=True)
    return int(model.layers[0].experts.gate_up_proj.to_local().shape[0])


@pytest.mark.slow  # 64 thread ranks: about 15 s
def test_160_experts_at_ep8_on_64_ranks_with_empty_shards() -> None:
    rows = run_threaded(64, _glm_layout)
    # efsdp rank = rank // 8: torch.chunk's [3, 3, 3, 3, 3, 3, 2, 0] rows of the 20 local experts
    assert rows == [n for n in (3, 3, 3, 3, 3, 3, 2, 0) for _ in range(8)]
