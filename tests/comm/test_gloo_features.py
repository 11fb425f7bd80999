"""Features whose backend behaviour only real gloo shows (one spawn of 2 processes).

- ``set_gradient_divide_factor(f)``: torch 2.13 needs ``PREMUL_SUM`` for it, which gloo lacks, and
  raises; fsdp2 pre-scales and sums, so gradients equal ``sum / f`` on gloo too.
- ``CPUOffloadPolicy()`` (``pin_memory=True``) trains on a CPU-only build (torch raises there).
- Meta-device init, ``to_empty`` and ``reset_parameters()`` with the same seed in both processes: the
  full weight repeats once per rank with torch's ``fully_shard`` and with fsdp2 (DTensor's random fills
  on a CPU mesh fill each shard alone); fsdp2 warns at the first forward. Inside
  ``fsdp2.init_like_unsharded()`` the parameters equal the unsharded model built from that seed.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp2
from tests._harness import run_multiprocess
from tests._training import average_grads, forward_backward, step_all

pytestmark = pytest.mark.multiprocess  # spawns gloo processes (conftest: slow, their time limit)

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


def _reset_parameters_case(impl: str, in_context: bool) -> None:
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2))

    torch.manual_seed(0)
    ref = build()
    with torch.device("meta"):
        model = build()
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = fsdp2.fully_shard
    fully_shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)  # the same seed in every process
    context = fsdp2.init_like_unsharded() if in_context else contextlib.nullcontext()
    with context, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()
        model(torch.ones(2, 6)).sum().backward()
    repeats = [w for w in caught if "holds the same values" in str(w.message)]
    weight = model[0].weight.full_tensor()
    if in_context:
        for ref_param, param in zip(ref.parameters(), model.parameters(), strict=True):
            assert torch.equal(param.full_tensor(), ref_param)
        assert repeats == []
    else:
        assert torch.equal(weight[:2], weight[2:]), "each rank drew the same numbers for its shard"
        assert len(repeats) == (1 if impl == "fsdp2" else 0), [str(w.message) for w in caught]
    if repeats:
        assert "0.weight, 0.bias, 2.weight" in str(repeats[0].message)


def _all_cases() -> None:
    for factor in (float(WORLD_SIZE), 2.0 * WORLD_SIZE, 3.0):
        _divide_factor_case(factor)
    _torch_divide_factor_fails_on_gloo()
    _offload_case()
    for impl, in_context in (("torch", False), ("fsdp2", False), ("fsdp2", True)):
        _reset_parameters_case(impl, in_context)


@pytest.mark.multiprocess
def test_gloo_features() -> None:
    run_multiprocess(WORLD_SIZE, _all_cases)
