"""Features whose backend behaviour only real gloo shows (one spawn of 2 processes).

- ``set_gradient_divide_factor(f)``: torch 2.13 needs ``PREMUL_SUM`` for it, which gloo lacks, and
  raises; fsdp2 pre-scales and sums, so gradients equal ``sum / f`` on gloo too.
- ``CPUOffloadPolicy()`` (``pin_memory=True``) trains on a CPU-only build (torch raises there).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp2
from tests._harness import run_multiprocess
from tests._training import average_grads, forward_backward, step_all

WORLD_SIZE = 2


def _model() -> nn.Module:
    torch.manual_seed(0)  # same seed in every process: identical initial parameters
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def _divide_factor_case(factor: float) -> None:
    model = _model()
    ref = copy.deepcopy(model)
    for layer in (model[0], model[2]):
        fsdp2.fully_shard(layer)
        layer.set_gradient_divide_factor(factor)
    fsdp2.fully_shard(model)
    model.set_gradient_divide_factor(factor)
    x = torch.full((4, 6), float(dist.get_rank() + 1))
    model(x).sum().backward()
    ref(x).sum().backward()
    for ref_param, param in zip(ref.parameters(), model.parameters(), strict=True):
        dist.all_reduce(ref_param.grad)
        torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad / factor)


def _torch_divide_factor_fails_on_gloo() -> None:
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(_model())
    model.set_gradient_divide_factor(2.0 * WORLD_SIZE)
    with pytest.raises(RuntimeError):
        model(torch.ones(4, 6)).sum().backward()


def _offload_case() -> None:
    model = _model()
    ref = copy.deepcopy(model)
    fsdp2.fully_shard(model, offload_policy=fsdp2.CPUOffloadPolicy())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.full((4, 6), float(dist.get_rank() + 1))
    for _ in range(3):
        loss, ref_loss = forward_backward(x, model, ref)
        average_grads(ref)
        torch.testing.assert_close(loss, ref_loss)
        step_all(opt, ref_opt)
    for ref_param, param in zip(ref.parameters(), model.parameters(), strict=True):
        assert param.to_local().device.type == "cpu"
        torch.testing.assert_close(param.full_tensor(), ref_param)


def _all_cases() -> None:
    for factor in (float(WORLD_SIZE), 2.0 * WORLD_SIZE, 3.0):
        _divide_factor_case(factor)
    _torch_divide_factor_fails_on_gloo()
    _offload_case()


@pytest.mark.multiprocess
def test_gloo_features() -> None:
    run_multiprocess(WORLD_SIZE, _all_cases)
