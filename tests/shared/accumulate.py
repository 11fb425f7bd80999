"""Budgeted accumulation's run, shared by its thread-rank and gloo tests."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2.group import held_grad_bytes
from fsdp2.runtime import groups_under
from tests._training import average_grads, fill_deterministic_

MICRO = 3


def _model() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 8), nn.Linear(8, 16), nn.Linear(16, 3))
    return fill_deterministic_(model, scale=0.5)


def _shard(model: nn.Sequential, **kwargs: Any) -> nn.Sequential:
    for block in model[:3]:
        fsdp2.fully_shard(block, **kwargs)
    fsdp2.fully_shard(model, **kwargs)
    return model


def _batch(step: int, micro: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    return torch.randn(2, 4, generator=gen)


def _held(model: nn.Module) -> int:
    return sum(held_grad_bytes(g) for g in groups_under(model))


def _run(budget: int | None, options: dict[str, Any], steps: int = 2) -> dict[str, Any]:
    mesh = None
    kwargs: dict[str, Any] = {}
    if options.get("hsdp"):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        kwargs["mesh"] = mesh
    if options.get("bf16"):
        kwargs["mp_policy"] = fsdp2.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if options.get("offload"):
        kwargs["offload_policy"] = fsdp2.CPUOffloadPolicy(pin_memory=False)
    model = _model()
    unsharded = copy.deepcopy(model)
    synced = _shard(copy.deepcopy(model), **kwargs)
    model = _shard(model, **kwargs)
    if options.get("bucketed"):
        for m in (model, synced):
            m.set_bucket_cap_mb(all_gather=1.0, reduce_scatter=1.0)
    optims = [torch.optim.AdamW(m.parameters(), lr=0.05) for m in (model, synced, unsharded)]
    out: dict[str, Any] = {"held": []}
    for step in range(steps):
        with fsdp2.accumulate(model, budget_bytes=budget) as acc:
            for micro in range(MICRO):
                x = _batch(step, micro)
                model(x).sum().backward()
                out["held"].append(_held(model))
                synced(x).sum().backward()
                if step == 0:
                    unsharded(x).sum().backward()
        if step == 0:
            average_grads(unsharded)
            out["kept"], out["reduced"] = sorted(acc.kept), sorted(acc.reduced_each_micro_batch)
            out["kept_bytes"], out["collectives"] = acc.kept_bytes, acc.collectives
            for p, s, u in zip(model.parameters(), synced.parameters(), unsharded.parameters(), strict=True):
                torch.testing.assert_close(p.grad.full_tensor(), s.grad.full_tensor(), rtol=1e-6, atol=1e-6)
                if not options.get("bf16"):
                    torch.testing.assert_close(p.grad.full_tensor(), u.grad, rtol=1e-5, atol=1e-6)
        assert _held(model) == 0, "gradients still held after the context"
        for optim in optims:
            optim.step()
            optim.zero_grad()
    for p, s in zip(model.parameters(), synced.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), s.full_tensor(), rtol=1e-5, atol=1e-6)
    return out
