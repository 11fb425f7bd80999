"""Conditional compute never hangs: a mixture-of-experts layer whose experts get tokens on some
ranks only, threads as ranks, with fsdp2's defaults (no setter).

Reference: the unsharded model on every rank's inputs, gradients averaged over the ranks with a
parameter a rank did not use counting as zero there, and staying ``None`` where no rank used it (as
data parallelism over the unsharded model gives). fsdp2's sharded gradients and the parameters after
AdamW steps must match it: experts unused on some ranks, an expert unused on every rank (its gradient
stays ``None``, so AdamW leaves it alone), HSDP, bucketing, and ``set_reduce_scatter_unused_params``
keeping torch's zeros.
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
from tests._harness import run_threaded
from tests._training import fill_deterministic_

DIM, EXPERTS = 6, 8
UNUSED = EXPERTS - 1  # the router never picks it


class MoE(nn.Module):
    """Top-1 routing; an expert with no token on this rank is not called."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = self.router(x).softmax(-1)
        choice = gates.argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = choice == e
            if mask.any():
                out = out.index_put((mask,), expert(x[mask]) * gates[mask, e : e + 1])
        return x + out


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.moe = MoE()
        self.head = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(self.inp(x)))


def _model() -> Model:
    model = fill_deterministic_(Model(), scale=0.5)
    with torch.no_grad():
        model.moe.router.bias[UNUSED] = -100.0
    return model


def _batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(3, DIM, generator=gen)  # 3 tokens, 8 experts: most experts idle on each rank


def _reference_grads(ref: nn.Module) -> list[torch.Tensor | None]:
    world = dist.get_world_size()
    grads: list[torch.Tensor | None] = []
    for param in ref.parameters():
        used = torch.tensor([0 if param.grad is None else 1])
        dist.all_reduce(used)
        if used.item() == 0:
            grads.append(None)
            continue
        grad = torch.zeros_like(param) if param.grad is None else param.grad.clone()
        dist.all_reduce(grad)
        grads.append(grad / world)
    return grads


def _train(option: str, steps: int = 3) -> dict[str, Any]:
    model = _model()
    ref = copy.deepcopy(model)
    mesh = (
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if option == "hsdp" else None
    )
    fsdp2.fully_shard(model.moe, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    if option == "bucketed":
        model.set_bucket_cap_mb(all_gather=1.0, reduce_scatter=1.0)
    if option == "torch-zeros":
        model.set_reduce_scatter_unused_params(True)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=0.05)
    idle_somewhere = 0
    for step in range(steps):
        x = _batch(step)
        model(x).square().sum().backward()
        ref(x).square().sum().backward()
        expected = _reference_grads(ref)
        for (name, param), ref_param, want in zip(
            model.named_parameters(), ref.parameters(), expected, strict=True
        ):
            idle_somewhere += int(
                name.startswith("moe.experts") and want is not None and ref_param.grad is None
            )
            if want is None and option == "torch-zeros":
                want = torch.zeros_like(ref_param)  # torch's set_reduce_scatter_unused_params(True)
            if want is None:
                assert param.grad is None, f"step {step}: {name} was used by no rank but got a gradient"
                continue
            torch.testing.assert_close(param.grad.full_tensor(), want, rtol=1e-5, atol=1e-6)
            ref_param.grad = want.clone()
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
    for param, ref_param in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(param.full_tensor(), ref_param, rtol=1e-5, atol=1e-6)
    return {"idle_somewhere": idle_somewhere}


@pytest.mark.parametrize(
    ("world", "option"), [(2, ""), (4, ""), (4, "hsdp"), (2, "bucketed"), (2, "torch-zeros")]
)
def test_experts_idle_on_some_ranks_train_like_the_reference(world: int, option: str) -> None:
    results = run_threaded(world, _train, option)
    # The case is the one the test is about: some expert was idle on this rank but used on another.
    assert all(r["idle_somewhere"] > 0 for r in results)
