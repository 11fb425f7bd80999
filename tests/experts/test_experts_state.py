"""``shard_experts`` models: what each rank gathers, checkpoints at another ``ep``, Muon, 64 simulated ranks.

Threads as ranks, the models of ``tests/shared/experts_models.py``:
- the experts' forward sees ``E / ep`` experts on each rank, never the whole stack;
- DCP (model and SGD momentum) saved at ep 2 x efsdp 2 on 4 ranks resumes at ep 4 and at ep 1 and
  trains on like the reference (to fp32 rounding: the experts' sums run in another order, which
  Adam's first steps would blow up to a full step on near-zero gradients);
- activation checkpointing around the blocks (the token exchanges replayed in backward);
- ``fsdp2.StackedMuon`` steps the expert stacks (and plain Muon's matrices) like the unsharded model;
- one rank of 64 (torch's fake process group) with 160 experts at ep 8, the rank whose efsdp shard of
  20 local experts is empty: it shards, trains and steps.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdp2
from tests._harness import assert_sharded_parity, run_threaded
from tests._training import fill_deterministic_
from tests.shared.experts_models import DIM, Net

WORLD = 4


def _batch(step: int) -> torch.Tensor:
    return torch.randn(5, DIM, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))


def _sharded(ref: Net, ep: int) -> Net:
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    model = copy.deepcopy(ref)
    fsdp2.shard_experts(model, ep=ep, mesh=mesh)
    for layer in model.layers:
        fsdp2.fully_shard(layer, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    return model


def _step(
    models: list[torch.nn.Module], optims: list[torch.optim.Optimizer], step: int, ref: bool = True
) -> None:
    """One step of the sharded model(s) and the reference (last), the reference's gradients averaged."""
    for model in models:
        model(_batch(step)).pow(2).mean().backward()
    for param in models[-1].parameters() if ref else ():
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
    for optim in optims:
        optim.step()
        optim.zero_grad()


def _seen_rows(ep: int) -> list[int]:
    ref = fill_deterministic_(Net(8), scale=0.5)
    model = _sharded(ref, ep)
    seen: list[int] = []
    experts = model.layers[0].experts

    def record(module: torch.nn.Module, args: Any) -> None:
        stack = module.gate_up_proj
        seen.append((stack.to_local() if isinstance(stack, DTensor) else stack).shape[0])

    experts.register_forward_pre_hook(record)
    model(_batch(0)).sum().backward()
    return seen


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("ep", [2, 4])
def test_each_rank_gathers_only_its_experts(ep: int) -> None:
    for seen in run_threaded(WORLD, _seen_rows, ep):
        assert seen == [8 // ep]  # the unsharded stack the forward sees: E / ep experts


def _resume(path: str) -> None:
    ref = fill_deterministic_(Net(8), scale=0.5)
    saved = _sharded(ref, ep=2)
    optim = torch.optim.SGD(saved.parameters(), lr=0.1, momentum=0.9)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    _step([saved, ref], [optim, ref_optim], 0)
    state = {"model": get_model_state_dict(saved), "optim": get_optimizer_state_dict(saved, optim)}
    dcp.save(state, checkpoint_id=path)
    for ep in (4, 1):
        # A fresh model at another ep (other weights), loaded from the checkpoint.
        model = _sharded(fill_deterministic_(Net(8), scale=0.5, seed=1), ep)
        model_optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        _step([model], [model_optim], 9, ref=False)  # optimizer state to overwrite
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, model_optim)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, model_optim, state["optim"])
        assert_sharded_parity(ref, model)
        for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            mine = model_optim.state[p]["momentum_buffer"].full_tensor()
            torch.testing.assert_close(mine, ref_optim.state[r]["momentum_buffer"], msg=f"{ep} {name}")
        reference = copy.deepcopy(ref)
        reference_optim = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        # load_state_dict keeps the given tensors: a copy, so that ref_optim's stay as saved
        reference_optim.load_state_dict(copy.deepcopy(ref_optim.state_dict()))
        _step([model, reference], [model_optim, reference_optim], 1)
        assert_sharded_parity(reference, model)


@pytest.mark.slow  # multi-rank and costly: the whole suite runs it, the quick loop leaves it
def test_dcp_saved_at_ep2_resumes_at_ep4_and_ep1(tmp_path: Path) -> None:
    run_threaded(WORLD, _resume, str(tmp_path / "ckpt"))


def _checkpointed() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    ref = fill_deterministic_(Net(8), scale=0.5)
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    fsdp2.shard_experts(model, ep=2, mesh=mesh)
    for index, layer in enumerate(model.layers):
        fsdp2.fully_shard(layer, mesh=mesh)
        model.layers[index] = checkpoint_wrapper(layer)  # the exchanges run again in backward
    fsdp2.fully_shard(model, mesh=mesh)
    _step([model, ref], [], 0)
    assert_sharded_parity(ref, model, grads=True)


def test_activation_checkpointing_replays_the_exchanges() -> None:
    run_threaded(WORLD, _checkpointed)


def _muon() -> None:
    ref = fill_deterministic_(Net(8), scale=0.5)
    model = _sharded(ref, ep=2)

    def optimizer(module: torch.nn.Module) -> torch.optim.Optimizer:
        params = [p for p in module.parameters() if p.ndim >= 2]
        return fsdp2.StackedMuon(params, lr=0.02, adjust_lr_fn="match_rms_adamw")

    rest = [p for p in model.parameters() if p.ndim < 2]
    ref_rest = [p for p in ref.parameters() if p.ndim < 2]
    optims = [optimizer(model), torch.optim.SGD(rest, lr=0.1)]
    optims += [optimizer(ref), torch.optim.SGD(ref_rest, lr=0.1)]
    for step in range(2):
        _step([model, ref], optims, step)
    for (name, ref_param), (_, param) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
        # Newton-Schulz runs in bf16 on gradients that differ from the reference's by fp32 ulps
        torch.testing.assert_close(param.full_tensor(), ref_param, rtol=0, atol=2e-3, msg=name)


@pytest.mark.slow  # multi-rank and costly: the whole suite runs it, the quick loop leaves it
def test_stacked_muon_steps_shard_experts_stacks() -> None:
    run_threaded(WORLD, _muon)


_SIMULATED = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
import fsdp2
from tests.shared.experts_models import DIM, Net

dist.init_process_group("fake", store=FakeStore(), rank=63, world_size=64)
mesh = init_device_mesh("cpu", (64,), mesh_dim_names=("dp",))
model = Net(160, top_k=2)
fsdp2.shard_experts(model, ep=8, mesh=mesh)
for layer in model.layers:
    fsdp2.fully_shard(layer, mesh=mesh)
fsdp2.fully_shard(model, mesh=mesh)
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(2):
    model(torch.randn(8, DIM)).pow(2).mean().backward()
    fsdp2.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()
    optim.zero_grad()
stack = model.layers[0].experts.gate_up_proj
print(tuple(stack.shape), stack.to_local().shape[0], [str(p) for p in stack.placements])
"""


@pytest.mark.slow  # a fresh interpreter: about 10 s
def test_an_empty_shard_of_160_experts_on_64_simulated_ranks() -> None:
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-c", _SIMULATED]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    # 20 local experts over 8 efsdp ranks: [3, 3, 3, 3, 3, 3, 2, 0]; rank 63 is efsdp rank 7
    assert out.stdout.strip().splitlines()[-1] == "(160, 6, 4) 0 ['_S(0, 8)', 'S(0)']"


def _refused() -> None:
    ref = fill_deterministic_(Net(8), scale=0.5)
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match="reshard_after_forward"):
        fsdp2.shard_experts(model, ep=2, mesh=mesh, reshard_after_forward=3)  # does not divide 2 efsdp ranks
    assert [type(m) for m in model.modules()] == before
    for (name, param), (_, original) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert not isinstance(param, DTensor), name
        assert torch.equal(param, original), name
    with pytest.raises(ValueError, match="ep=3 ranks cannot hold equally"):
        fsdp2.shard_experts(model, ep=3, mesh=mesh)
    with pytest.raises(ValueError, match="found no experts module"):
        fsdp2.shard_experts(model.head, ep=2, mesh=mesh)


def test_refused_arguments_leave_the_model_as_it_was() -> None:
    run_threaded(WORLD, _refused)
