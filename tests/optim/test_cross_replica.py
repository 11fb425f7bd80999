"""Optimizer state sharded across HSDP's replicas: ``fsdp2.shard_optimizer_across_replicas``.

HSDP on a (replicate=2, shard=2) mesh, threads as ranks. Three copies of one model train on the same
inputs: plain HSDP, HSDP with the optimizer sharded across replicas, and the unsharded model with
gradients averaged over the four ranks. The sharded-across-replicas run must give plain HSDP's losses
and parameters bit for bit (the same reductions: two replicas sum in one order only) and the
reference's within fp32 rounding; keep half of HSDP's optimizer state per rank; send as many bytes
(the reduce-scatter across replicas plus the all-gather after the step equal HSDP's all-reduce); and
take clipping, gradient accumulation and DCP checkpoints to and from plain HSDP (also at another
world size).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import fsdp2
from fsdp2.testing import record_collectives
from tests._harness import run_threaded
from tests._training import EXACT, TIGHT, average_grads, seeded
from tests.models import MLP, make_input

WORLD = 4
DIM = 8  # every shard's rows divide by the replicas: HSDP's bytes exactly
UNEVEN = 5  # rows that do not divide: empty and short slices


def _mesh(shape: tuple[int, ...] = (2, 2)) -> Any:
    if len(shape) == 1:
        return init_device_mesh("cpu", shape, mesh_dim_names=("shard",))
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _sharded(base: nn.Module, mesh: Any) -> nn.Module:
    model = copy.deepcopy(base)
    fsdp2.fully_shard(model.in_proj, mesh=mesh)
    fsdp2.fully_shard(model.out_proj, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    return model


def _adamw(model: nn.Module, across: bool) -> torch.optim.Optimizer:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return fsdp2.shard_optimizer_across_replicas(model, optim) if across else optim


def _state_bytes(optim: torch.optim.Optimizer) -> int:
    total = 0
    for values in optim.state.values():
        for value in values.values():
            if isinstance(value, DTensor):
                value = value.to_local()
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                total += value.numel() * value.element_size()
    return total


def _input(rank: int, step: int, dim: int) -> torch.Tensor:
    return make_input((3, dim), rank, seed=step)


# ---------------------------------------------------------------------------------------------
# AdamW: plain HSDP's numbers bit for bit, the reference's, half the state, the same bytes
# ---------------------------------------------------------------------------------------------


def _adamw_three_steps(dim: int) -> dict[str, Any]:
    rank = dist.get_rank()
    mesh = _mesh()
    base = seeded(lambda: MLP(dim))
    ref = copy.deepcopy(base)
    plain, across = _sharded(base, mesh), _sharded(base, mesh)
    optims = [_adamw(plain, False), _adamw(across, True)]
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    sent = []
    for step in range(3):
        x = _input(rank, step, dim)
        logs = []
        losses = []
        for model, optim in zip((plain, across), optims, strict=True):
            with record_collectives(model) as log:
                loss = model(x).sum()
                loss.backward()
                if step == 0 and model is across:
                    for param in model.parameters():  # each rank's gradient is its slice
                        assert all(p == Shard(0) for p in param.grad.placements)
                        assert param.grad.to_local().shape[0] <= -(-param.to_local().shape[0] // 2)
                optim.step()
            optim.zero_grad()
            logs.append(log)
            losses.append(loss)
        ref(x).sum().backward()
        average_grads(ref)
        ref_optim.step()
        ref_optim.zero_grad()
        torch.testing.assert_close(losses[1], losses[0], **EXACT)
        sent.append([log.sent_bytes() for log in logs] + [log["all_reduce"] for log in logs])
    for p_plain, p_across, p_ref in zip(plain.parameters(), across.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p_across.to_local(), p_plain.to_local(), **EXACT)
        torch.testing.assert_close(p_across.full_tensor(), p_ref, **TIGHT)
    return {"bytes": [_state_bytes(o) for o in optims], "sent": sent}


@pytest.mark.parametrize("dim", [DIM, UNEVEN], ids=["even", "uneven"])
def test_adamw_equals_plain_hsdp_and_the_unsharded_model(dim: int) -> None:
    results = run_threaded(WORLD, _adamw_three_steps, dim)
    for rank, result in enumerate(results):
        plain_bytes, across_bytes = result["bytes"]
        if dim == DIM:
            assert across_bytes * 2 == plain_bytes, (rank, result["bytes"])
            for plain_sent, across_sent, plain_ar, across_ar in result["sent"]:
                assert (plain_ar, across_ar) == (2, 0)  # one all-reduce per group (two), none across replicas
                assert across_sent == plain_sent, (rank, result["sent"])
    total = [sum(r["bytes"][i] for r in results) for i in range(2)]
    assert total[1] * 2 == total[0], total  # the replicas' state is cut in two, uneven or not
