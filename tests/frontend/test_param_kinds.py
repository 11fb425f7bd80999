"""Kinds of parameters and buffers a group can hold, threads as ranks.

- ``shard_placement_fn`` returning ``Shard(1)`` (or ``Shard(-1)``): local shapes, placements, full
  tensors, training parity; uneven ``Shard(1)`` is refused at ``fully_shard``;
- ``ignored_params``: left plain and local, their gradients unreduced;
- frozen parameters next to trainable ones in one group; an int64 frozen parameter;
- tied weights, in a grouped call and inside one call: one object through training;
- buffers: plain, not sharded, not cast;
- parameters of two floating dtypes in one group (fsdp2 extension: torch refuses this);
- a Hypothesis property: random stacks of frozen/trainable Linear layers train like the reference.

The reference is an unsharded copy on the same per-rank inputs, gradients averaged over ranks
(except for ignored parameters, whose gradients stay local).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from tests._harness import run_threaded
from tests._impls import Impl, get_impl, torch_impl
from tests._training import EXACT, TIGHT, Inputs, mp_policy, seeded, train_in_lockstep
from tests.models import MLP, ModelArgs, Transformer, make_input, make_tokens


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _assert_parity(ref: nn.Module, model: nn.Module, *, grads: bool, tol: dict[str, float] = TIGHT) -> None:
    for (name, ref_param), (sharded_name, param) in zip(
        ref.named_parameters(), model.named_parameters(), strict=True
    ):
        assert name == sharded_name
        assert param.dtype == ref_param.dtype, name
        torch.testing.assert_close(_full(param), ref_param, **tol, msg=lambda m, n=name: f"{n}: {m}")
        if grads:
            if ref_param.grad is None:
                assert param.grad is None, f"{name}: unexpected grad"
                continue
            assert param.grad is not None, f"{name}: missing grad"
            assert param.grad.dtype == ref_param.dtype, name
            torch.testing.assert_close(
                _full(param.grad), ref_param.grad, **tol, msg=lambda m, n=name: f"{n} grad: {m}"
            )


def _train(model: nn.Module, ref: nn.Module, inputs: Inputs, steps: int = 3, **kwargs: Any) -> list[float]:
    """AdamW steps on both models, gradients compared after the first backward, params at the end."""
    return train_in_lockstep(model, ref, inputs, steps, _assert_parity, **kwargs)


def _mlp_inputs(dim: int) -> Callable[[int, int], torch.Tensor]:
    return lambda rank, step: make_input((3, dim), rank, seed=step)


# ---------------------------------------------------------------------------------------------
# shard_placement_fn: Shard(1)
# ---------------------------------------------------------------------------------------------

SHARD1_DIM, SHARD1_HIDDEN = 8, 12  # weights (12, 8) and (8, 12): dim 1 divides by 2 and 4


def _shard_dim1(impl_name: str, placement_dim: int) -> None:
    world = dist.get_world_size()
    rank = dist.get_rank()
    impl = get_impl(impl_name)
    model = seeded(lambda: MLP(SHARD1_DIM, hidden_dim=SHARD1_HIDDEN))
    ref = copy.deepcopy(model)
    originals = {n: p.detach().clone() for n, p in model.named_parameters()}

    def placement(param: nn.Parameter) -> Shard | None:
        return Shard(placement_dim) if param.ndim == 2 else None

    impl.fully_shard(model.in_proj, shard_placement_fn=placement)
    impl.fully_shard(model, shard_placement_fn=placement)
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        original = originals[name]
        if original.ndim == 2:
            assert tuple(param.placements) == (Shard(1),), (name, param.placements)
            assert param.to_local().shape == (original.size(0), original.size(1) // world), name
            want = torch.chunk(original, world, dim=1)[rank]
        else:
            assert tuple(param.placements) == (Shard(0),), (name, param.placements)
            want = torch.chunk(original, world, dim=0)[rank]
        torch.testing.assert_close(param.to_local(), want, **EXACT)
        torch.testing.assert_close(param.full_tensor(), original, **EXACT)
    _train(model, ref, _mlp_inputs(SHARD1_DIM))
    for name, param in model.named_parameters():
        assert isinstance(param.grad, DTensor) or param.grad is None
        assert tuple(param.placements) == ((Shard(1),) if originals[name].ndim == 2 else (Shard(0),)), name


@pytest.mark.parametrize("placement_dim", [1, -1], ids=["Shard(1)", "Shard(-1)"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_shard_dim1_placement(impl: Impl, world_size: int, placement_dim: int) -> None:
    run_threaded(world_size, _shard_dim1, impl.name, placement_dim)


def _shard_dim1_grads_placement() -> None:
    impl = get_impl("fsdp2")
    model = seeded(lambda: MLP(SHARD1_DIM, hidden_dim=SHARD1_HIDDEN))
    theirs = copy.deepcopy(model)

    def placement(param: nn.Parameter) -> Shard | None:
        return Shard(1) if param.ndim == 2 else None

    impl.fully_shard(model, shard_placement_fn=placement)
    torch_impl().fully_shard(theirs, shard_placement_fn=placement)
    x = make_input((3, SHARD1_DIM), dist.get_rank())
    model(x).sum().backward()
    theirs(x).sum().backward()
    for (name, ours), their in zip(model.named_parameters(), theirs.parameters(), strict=True):
        assert isinstance(ours.grad, DTensor), name
        assert tuple(ours.grad.placements) == tuple(their.grad.placements), name
        assert ours.grad.to_local().shape == their.grad.to_local().shape, name
        torch.testing.assert_close(ours.grad.to_local(), their.grad.to_local(), **TIGHT)


@pytest.mark.parametrize("world_size", [2, 4])
def test_shard_dim1_grads_match_torch(world_size: int) -> None:
    run_threaded(world_size, _shard_dim1_grads_placement)


def _shard_dim1_uneven(impl_name: str) -> None:
    impl = get_impl(impl_name)
    model = seeded(lambda: nn.Linear(6, 4))  # weight (4, 6): 6 does not divide by 4
    with pytest.raises(NotImplementedError, match=r"(?i)divisible|evenly|even"):
        impl.fully_shard(model, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)


def test_shard_dim1_uneven_raises(impl: Impl) -> None:
    run_threaded(4, _shard_dim1_uneven, impl.name)


# ---------------------------------------------------------------------------------------------
# ignored_params
# ---------------------------------------------------------------------------------------------


def _ignored(impl_name: str) -> None:
    impl = get_impl(impl_name)
    model = seeded(lambda: MLP(7, hidden_dim=10))
    ref = copy.deepcopy(model)
    ignored = {model.out_proj.weight, model.in_proj.bias}
    originals = {n: p.detach().clone() for n, p in model.named_parameters()}
    impl.fully_shard(model.in_proj, ignored_params=ignored)
    impl.fully_shard(model, ignored_params=ignored)
    names = {"out_proj.weight", "in_proj.bias"}
    for name, param in model.named_parameters():
        if name in names:
            assert type(param) is nn.Parameter, (name, type(param))
            assert param.shape == originals[name].shape
            torch.testing.assert_close(param, originals[name], **EXACT)
        else:
            assert isinstance(param, DTensor), name
    assert model.out_proj.weight is next(p for p in ignored if p.shape == originals["out_proj.weight"].shape)
    # Ignored parameters' gradients are this rank's own: never reduced.
    _train(model, ref, _mlp_inputs(7), local_grads=names)
    for name, param in model.named_parameters():
        if name in names:
            assert type(param) is nn.Parameter, (name, type(param))


@pytest.mark.parametrize("world_size", [2])
def test_ignored_params_stay_local(impl: Impl, world_size: int) -> None:
    run_threaded(world_size, _ignored, impl.name)


# ---------------------------------------------------------------------------------------------
# Frozen parameters in a trainable group; an int64 frozen parameter
# ---------------------------------------------------------------------------------------------


def _frozen(impl_name: str) -> None:
    impl = get_impl(impl_name)
    model = seeded(lambda: MLP(7, hidden_dim=10))
    model.in_proj.weight.requires_grad_(False)
    model.out_proj.bias.requires_grad_(False)
    ref = copy.deepcopy(model)
    impl.fully_shard(model.in_proj)
    impl.fully_shard(model)
    for name, param in model.named_parameters():
        assert param.requires_grad == (name not in ("in_proj.weight", "out_proj.bias")), name
    _train(model, ref, _mlp_inputs(7))
    assert model.in_proj.weight.grad is None
    assert model.out_proj.bias.grad is None


@pytest.mark.parametrize("world_size", [2])
def test_frozen_and_trainable_in_one_group(impl: Impl, world_size: int) -> None:
    run_threaded(world_size, _frozen, impl.name)


class WithIntParam(nn.Module):
    """An fp32 Linear plus a frozen int64 permutation parameter applied to its output."""

    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.perm = nn.Parameter(torch.randperm(dim), requires_grad=False)
        self.out = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.lin(x))[:, self.perm])


def _int_param(impl_name: str) -> None:
    impl = get_impl(impl_name)
    model = seeded(WithIntParam)
    ref = copy.deepcopy(model)
    impl.fully_shard(model)  # one group: fp32 weights and the int64 parameter
    perm = model.perm
    assert isinstance(perm, DTensor)
    assert perm.dtype == torch.int64
    torch.testing.assert_close(perm.full_tensor(), ref.perm, **EXACT)
    _train(model, ref, _mlp_inputs(6))
    assert model.perm.grad is None
    torch.testing.assert_close(model.perm.full_tensor(), ref.perm, **EXACT)


@pytest.mark.parametrize("world_size", [2])
def test_int64_frozen_param_alongside_fp32(impl: Impl, world_size: int) -> None:
    run_threaded(world_size, _int_param, impl.name)


# ---------------------------------------------------------------------------------------------
# Tied weights
# ---------------------------------------------------------------------------------------------

TIED_ARGS = ModelArgs(n_layers=2, weight_tying=True)


def _tied(impl_name: str, grouped: bool) -> None:
    impl = get_impl(impl_name)
    model = seeded(lambda: Transformer(TIED_ARGS))
    ref = copy.deepcopy(model)
    assert ref.output.weight is ref.tok_embeddings.weight
    for layer in model.layers:
        impl.fully_shard(layer)
    if grouped:
        impl.fully_shard([model.tok_embeddings, model.output])
    impl.fully_shard(model)
    assert model.output.weight is model.tok_embeddings.weight
    assert isinstance(model.output.weight, DTensor)
    seen: list[bool] = []
    model.output.register_forward_pre_hook(
        lambda m, args: seen.append(
            m.weight is model.tok_embeddings.weight and not isinstance(m.weight, DTensor)
        )
    )

    def still_tied() -> None:
        assert model.output.weight is model.tok_embeddings.weight

    _train(model, ref, lambda rank, step: make_tokens(TIED_ARGS, 100 * step + rank), during=still_tied)
    assert seen == [True] * 3  # tied and unsharded during every forward
    still_tied()
    assert len(list(model.parameters())) == len(list(ref.parameters()))


@pytest.mark.parametrize("grouped", [True, False], ids=["list_call", "one_call"])
@pytest.mark.parametrize("world_size", [2])
def test_tied_weights(impl: Impl, world_size: int, grouped: bool) -> None:
    run_threaded(world_size, _tied, impl.name, grouped)


# ---------------------------------------------------------------------------------------------
# Buffers
# ---------------------------------------------------------------------------------------------


class WithBuffers(nn.Module):
    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.bn = nn.BatchNorm1d(dim)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))
        self.out = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.lin(x).float()).to(x.dtype)  # BatchNorm in fp32 (its buffers' dtype)
        return self.out(h * self.scale.to(h.dtype))


def _buffers(impl_name: str, param_dtype: torch.dtype | None) -> None:
    impl = get_impl(impl_name)
    model = seeded(WithBuffers)
    model.bn.float()
    ref = copy.deepcopy(model)
    buffers = {n: b for n, b in model.named_buffers()}
    policy = mp_policy(impl, param_dtype=param_dtype)
    impl.fully_shard(model.bn, mp_policy=mp_policy(impl))  # BatchNorm keeps fp32 parameters
    impl.fully_shard(model, mp_policy=policy)

    def check_buffers() -> None:
        for name, buffer in model.named_buffers():
            assert type(buffer) is torch.Tensor, (name, type(buffer))
            assert buffer is buffers[name], name  # the same object: not re-registered
            assert buffer.dtype == ref.get_buffer(name).dtype, name

    check_buffers()
    seen: list[torch.dtype] = []
    model.register_forward_pre_hook(lambda m, args: seen.append(m.scale.dtype))
    if param_dtype is None:
        _train(model, ref, _mlp_inputs(6), during=check_buffers)
        # Running statistics are per rank, like the reference's.
        for name, buffer in model.named_buffers():
            torch.testing.assert_close(
                buffer, ref.get_buffer(name), **TIGHT, msg=lambda m, n=name: f"{n}: {m}"
            )
    else:
        out = model(make_input((3, 6), dist.get_rank()))
        assert out.dtype == param_dtype
        out.float().sum().backward()
        check_buffers()
    assert seen
    assert all(d == torch.float32 for d in seen)


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("world_size", [2])
def test_buffers_stay_plain_and_uncast(impl: Impl, world_size: int, param_dtype: torch.dtype | None) -> None:
    run_threaded(world_size, _buffers, impl.name, param_dtype)


# ---------------------------------------------------------------------------------------------
# Two floating dtypes in one group (fsdp2 only)
# ---------------------------------------------------------------------------------------------


class TwoDtypes(nn.Module):
    def __init__(self, dim: int = 7) -> None:
        super().__init__()
        self.lin32 = nn.Linear(dim, 9)
        self.lin64 = nn.Linear(9, 5).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin64(torch.tanh(self.lin32(x)).double()).float()


def _two_dtypes(nested: bool) -> None:
    impl = get_impl("fsdp2")
    model = seeded(TwoDtypes)
    ref = copy.deepcopy(model)
    if nested:
        impl.fully_shard([model.lin32, model.lin64])
    impl.fully_shard(model)
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        assert param.dtype == (torch.float32 if "32" in name else torch.float64), name
    _train(model, ref, _mlp_inputs(7))
    for name, param in model.named_parameters():
        assert param.dtype == (torch.float32 if "32" in name else torch.float64), name


@pytest.mark.parametrize("nested", [False, True], ids=["root_call", "list_call"])
@pytest.mark.parametrize("world_size", [2])
def test_two_dtypes_in_one_group(world_size: int, nested: bool) -> None:
    run_threaded(world_size, _two_dtypes, nested)


# ---------------------------------------------------------------------------------------------
# Property: random stacks of frozen / trainable Linear layers
# ---------------------------------------------------------------------------------------------


class Stack(nn.Module):
    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


@st.composite
def stacks(draw: st.DrawFn) -> dict[str, Any]:
    n_layers = draw(st.integers(min_value=1, max_value=4))
    widths = draw(
        st.lists(st.integers(min_value=1, max_value=9), min_size=n_layers + 1, max_size=n_layers + 1)
    )
    frozen = draw(
        st.lists(st.sampled_from(["none", "weight", "bias", "both"]), min_size=n_layers, max_size=n_layers)
    )
    if all(f == "both" for f in frozen):
        frozen[draw(st.integers(min_value=0, max_value=n_layers - 1))] = "none"  # something trains
    wrap = draw(st.lists(st.booleans(), min_size=n_layers, max_size=n_layers))
    world_size = draw(st.sampled_from([2, 4]))
    return {"widths": widths, "frozen": frozen, "wrap": wrap, "world_size": world_size}


def _random_stack(case: dict[str, Any]) -> None:
    impl = get_impl("fsdp2")
    model = seeded(lambda: Stack(case["widths"]))
    for layer, frozen in zip(model.layers, case["frozen"], strict=True):
        if frozen in ("weight", "both"):
            layer.weight.requires_grad_(False)
        if frozen in ("bias", "both"):
            layer.bias.requires_grad_(False)
    ref = copy.deepcopy(model)
    for layer, wrap in zip(model.layers, case["wrap"], strict=True):
        if wrap:
            impl.fully_shard(layer)
    impl.fully_shard(model)
    _train(model, ref, lambda rank, step: make_input((3, case["widths"][0]), rank, seed=step), steps=2)


@pytest.mark.slow
@settings(max_examples=10, deadline=None)
@given(case=stacks())
def test_random_frozen_trainable_stacks(case: dict[str, Any]) -> None:
    run_threaded(case["world_size"], _random_stack, case)
