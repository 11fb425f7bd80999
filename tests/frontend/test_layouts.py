"""Group layouts of the hot path, checked against an unsharded reference and torch's fully_shard.

- packed shards: a group's local shards live in one buffer, which the all-gather reads directly;
  it survives meta-device init, ``load_state_dict`` (copy and ``assign=True``), dtype conversions and
  a deep copy; conversions and copy-loads keep the sharded parameters' identity, so an optimizer
  built before them keeps training the same objects;
- one unsharded buffer per group, rebuilt when the unsharded dtype changes between steps
  (``model.double()`` after training: torch 2.13 fails the next forward, fsdp2 trains on);
- a one-rank shard group gathers by one copy and hands each gradient over as its own shard.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import assert_sharded_parity, run_threaded
from tests._impls import get_impl, shard_blocks_then_root
from tests._training import EXACT, TIGHT, average_grads, forward_backward, seeded, train_in_lockstep
from tests.models import MLP, make_input


class _Blocks(nn.Module):
    def __init__(self, dim: int = 8, n_blocks: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLP(dim) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.norm(x)


def _groups(model: nn.Module) -> list[Any]:
    from fsdp2.runtime._state import get_state

    found = []
    for module in model.modules():
        state = get_state(module)
        if state is not None and module is state.modules[0]:
            found.extend(state.groups)
    return found


def _packed_everywhere(model: nn.Module) -> bool:
    return all(group.packed.intact(group.fsdp_params) for group in _groups(model))


def _inputs(dtype: torch.dtype = torch.float32) -> Any:
    return lambda rank, step: make_input((4, 8), rank, seed=step).to(dtype)


# ---- packed shards survive what users do to a model before and between steps -------------------


def _meta_init_then_load(assign: bool) -> None:
    impl = get_impl("fsdp2")
    ref = seeded(_Blocks)
    with torch.device("meta"):
        model = _Blocks()
    shard_blocks_then_root(impl, model, model.layers)
    model.to_empty(device="cpu")
    optim_params = list(model.parameters())  # taken before loading: must stay the trained objects
    model.load_state_dict(ref.state_dict(), assign=assign)
    assert _packed_everywhere(model)
    if not assign:
        assert all(p is q for p, q in zip(optim_params, model.parameters(), strict=True))
    train_in_lockstep(model, ref, _inputs(), 3, assert_sharded_parity)
    assert _packed_everywhere(model)


@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
def test_meta_init_then_load_trains_like_the_reference(assign: bool) -> None:
    run_threaded(2, _meta_init_then_load, assign)


def _load_between_steps() -> None:
    impl = get_impl("fsdp2")
    ref = seeded(_Blocks)
    model = copy.deepcopy(ref)
    shard_blocks_then_root(impl, model, model.layers)
    rank = dist.get_rank()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        forward_backward(make_input((4, 8), rank, seed=step), model, ref)
        average_grads(ref)
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
    # A checkpoint of the sharded model taken now, loaded back with assign=True after one more step.
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref_saved = copy.deepcopy(ref.state_dict())
    forward_backward(make_input((4, 8), rank, seed=5), model, ref)
    model.zero_grad()
    ref.zero_grad()
    model.load_state_dict(saved, assign=True)
    ref.load_state_dict(ref_saved)
    assert _packed_everywhere(model)
    train_in_lockstep(model, ref, _inputs(), 2, assert_sharded_parity)


def test_load_state_dict_assign_between_steps_trains_like_the_reference() -> None:
    run_threaded(2, _load_between_steps)


def _deepcopy_trains() -> None:
    impl = get_impl("fsdp2")
    ref = seeded(_Blocks)
    model = copy.deepcopy(ref)
    shard_blocks_then_root(impl, model, model.layers)
    copied = copy.deepcopy(model)
    for original, twin in zip(model.parameters(), copied.parameters(), strict=True):
        assert original is not twin
        torch.testing.assert_close(original.to_local(), twin.to_local(), **EXACT)
    train_in_lockstep(copied, ref, _inputs(), 2, assert_sharded_parity)
    assert _packed_everywhere(copied)


def test_deep_copy_packs_and_trains_like_the_reference() -> None:
    run_threaded(2, _deepcopy_trains)


# ---- dtype conversion between steps ---------------------------------------------------------------


def _double_after_training(impl_name: str) -> None:
    impl = get_impl(impl_name)
    ref = seeded(_Blocks)
    model = copy.deepcopy(ref)
    shard_blocks_then_root(impl, model, model.layers)
    train_in_lockstep(model, ref, _inputs(), 2, assert_sharded_parity)
    before = list(model.parameters())
    model.double()
    ref.double()
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert all(p is q for p, q in zip(before, model.parameters(), strict=True))  # optimizers keep them
    losses = train_in_lockstep(model, ref, _inputs(torch.float64), 2, assert_sharded_parity)
    assert all(isinstance(loss, float) for loss in losses)
    if impl_name == "fsdp2":
        assert _packed_everywhere(model)


def test_dtype_conversion_between_steps_keeps_training() -> None:
    run_threaded(2, _double_after_training, "fsdp2")


@pytest.mark.xfail(
    strict=True, reason="torch 2.13's fully_shard copies out into the old dtype's buffers after .double()"
)
def test_dtype_conversion_between_steps_torch() -> None:
    run_threaded(2, _double_after_training, "torch")


# ---- one rank: the same numbers as torch's fully_shard ------------------------------------------

_ONE_RANK_CASES = {
    "fp32": {},
    "bf16": {"param_dtype": torch.bfloat16},
    "bf16-fp32-reduce": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
}


def _one_rank(case: str, divide: float | None, dim: int) -> None:
    ours, theirs = get_impl("fsdp2"), get_impl("torch")
    base = seeded(lambda: _Blocks(dim))
    models = []
    for impl in (ours, theirs):
        model = copy.deepcopy(base)
        kwargs = {}
        if _ONE_RANK_CASES[case]:
            if impl.name == "fsdp2":
                import fsdp2

                kwargs["mp_policy"] = fsdp2.MixedPrecisionPolicy(**_ONE_RANK_CASES[case])
            else:
                from torch.distributed.fsdp import MixedPrecisionPolicy

                kwargs["mp_policy"] = MixedPrecisionPolicy(**_ONE_RANK_CASES[case])
        for layer in model.layers:
            impl.fully_shard(layer, **kwargs)
        impl.fully_shard(model, **kwargs)
        if divide is not None:
            model.set_gradient_divide_factor(divide)
        models.append(model)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for step in range(3):
        x = make_input((4, dim), 0, seed=step)
        losses = forward_backward(x, *models)
        torch.testing.assert_close(losses[0], losses[1], **EXACT)
        for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
            torch.testing.assert_close(p.grad.to_local(), q.grad.to_local(), **EXACT)
        for optim in optims:
            optim.step()
            optim.zero_grad()
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(p.to_local(), q.to_local(), **TIGHT)


# dim 16: every part of the unsharded buffer is a multiple of 64 bytes, so copy-out is one copy;
# dim 8: 32-byte biases leave alignment gaps, so copy-out goes part by part.
@pytest.mark.parametrize("dim", [16, 8])
@pytest.mark.parametrize("divide", [None, 4.0], ids=["mean", "divide-4"])
@pytest.mark.parametrize("case", list(_ONE_RANK_CASES))
def test_one_rank_matches_torch(case: str, divide: float | None, dim: int) -> None:
    run_threaded(1, _one_rank, case, divide, dim)


# ---- every unsharded parameter starts on a 64-byte boundary -------------------------------------


def _aligned(world_size: int) -> None:
    impl = get_impl("fsdp2")
    ref = seeded(lambda: nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 7), nn.LayerNorm(7)))
    model = copy.deepcopy(ref)
    impl.fully_shard(model)
    model.unshard()
    try:
        for name, param in model.named_parameters():
            assert not isinstance(param, torch.distributed.tensor.DTensor), name
            assert param.data_ptr() % 64 == 0, f"{name} starts at {param.data_ptr() % 64} mod 64"
    finally:
        model.reshard()
    train_in_lockstep(
        model, ref, lambda rank, step: make_input((4, 5), rank, seed=step), 2, assert_sharded_parity
    )


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_unsharded_parameters_are_aligned(world_size: int) -> None:
    run_threaded(world_size, _aligned, world_size)


# ---- freezing and unfreezing sharded parameters between steps -----------------------------------


def _freeze_between_steps() -> None:
    impl = get_impl("fsdp2")
    ref = seeded(_Blocks)
    model = copy.deepcopy(ref)
    shard_blocks_then_root(impl, model, model.layers)
    train_in_lockstep(model, ref, _inputs(), 1, assert_sharded_parity)
    for m in (model, ref):  # the registered unsharded parameters must follow at the next forward
        m.layers[1].in_proj.weight.requires_grad_(False)
        m.norm.bias.requires_grad_(False)
    model.zero_grad()
    ref.zero_grad()
    forward_backward(make_input((4, 8), dist.get_rank(), seed=7), model, ref)
    assert model.layers[1].in_proj.weight.grad is None
    assert model.norm.bias.grad is None
    average_grads(ref)
    assert_sharded_parity(ref, model, grads=True)
    for m in (model, ref):
        m.zero_grad()
        m.layers[1].in_proj.weight.requires_grad_(True)
        m.norm.bias.requires_grad_(True)
    # Unfrozen again: the first step's gradient parity covers the two parameters.
    train_in_lockstep(model, ref, _inputs(), 2, assert_sharded_parity)


def test_freezing_between_steps_takes_effect() -> None:
    run_threaded(2, _freeze_between_steps)
