"""``MixedPrecisionPolicy``, threads as ranks (docs/precision.md).

Three kinds of checks:

- dtypes, for fsdp2 and torch alike: the unsharded parameters registered during forward have
  ``param_dtype``; sharded parameters and their gradients keep the original fp32; outputs are cast
  to ``output_dtype``; integer inputs are never cast; ``cast_forward_inputs=False`` leaves inputs;
- numbers against an unsharded reference that does by hand what the policy says: a low-precision
  copy of the fp32 master model computes forward and backward, its gradients are cast to fp32 and
  averaged over ranks, and the fp32 master takes the optimizer step;
- differential: fsdp2 and torch's ``fully_shard`` with the same policy on the same inputs, losses
  every step and parameters after three AdamW steps.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tests._harness import run_threaded
from tests._impls import Impl, get_impl, torch_impl
from tests._training import mp_policy, seeded, step_all
from tests.models import MLP, ModelArgs, Transformer, make_input, make_tokens

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# Same algorithm on both sides: low-precision numbers may still differ by rounding of a
# reduction order, which AdamW turns into at most ~lr * ulp(bf16) on the fp32 parameters.
LOW_PRECISION = {"rtol": 1.6e-2, "atol": 1e-5}
PARAMS_AFTER_STEPS = {"rtol": 1e-3, "atol": 1e-4}


@dataclass(frozen=True)
class Spec:
    build: Callable[[], nn.Module]
    blocks: Callable[[nn.Module], list[nn.Module]]
    inputs: Callable[[int, int], torch.Tensor]  # (rank, step) -> input


MLP_DIM = 13
TF_ARGS = ModelArgs(n_layers=2, dim=8, n_heads=2)
MLP_SPEC = Spec(
    build=lambda: MLP(MLP_DIM),
    blocks=lambda m: [m.in_proj],
    inputs=lambda rank, step: make_input((3, MLP_DIM), rank, seed=step),
)
TF_SPEC = Spec(
    build=lambda: Transformer(TF_ARGS),
    blocks=lambda m: list(m.layers),
    inputs=lambda rank, step: make_tokens(TF_ARGS, 100 * step + rank),
)
SPECS = [pytest.param(MLP_SPEC, id="mlp"), pytest.param(TF_SPEC, id="transformer")]


def _shard(impl: Impl, spec: Spec, model: nn.Module, **policy: Any) -> None:
    # output_dtype goes on the root only: blocks feed unsharded root-owned modules (norm, head).
    block_policy = {**policy, "output_dtype": None}
    for block in spec.blocks(model):
        impl.fully_shard(block, mp_policy=mp_policy(impl, **block_policy))
    impl.fully_shard(model, mp_policy=mp_policy(impl, **policy))


# ---------------------------------------------------------------------------------------------
# dtypes (both implementations)
# ---------------------------------------------------------------------------------------------


def _dtypes(impl: Impl, param_dtype: torch.dtype, reduce_dtype: Any, output_dtype: Any) -> None:
    model = seeded(lambda: MLP(8, hidden_dim=6))
    policy = {"param_dtype": param_dtype, "reduce_dtype": reduce_dtype, "output_dtype": output_dtype}
    # output_dtype on the root only: the root's plain out_proj consumes in_proj's output.
    impl.fully_shard(model.in_proj, mp_policy=mp_policy(impl, **{**policy, "output_dtype": None}))
    impl.fully_shard(model, mp_policy=mp_policy(impl, **policy))
    seen: dict[str, Any] = {}

    def capture(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            # Registered after FSDP's (prepended) pre-forward hook: sees what forward computes with.
            seen[name] = ([(type(p), p.dtype) for p in module.parameters(recurse=False)], args[0].dtype)

        return hook

    model.in_proj.register_forward_pre_hook(capture("in_proj"))
    model.out_proj.register_forward_pre_hook(capture("out_proj"))
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        assert param.dtype == FP32, name
    x = make_input((3, 8), dist.get_rank())
    out = model(x)
    assert out.dtype == (output_dtype or param_dtype)
    assert x.dtype == FP32  # the caller's tensor is not modified
    for name in ("in_proj", "out_proj"):
        params, arg_dtype = seen[name]
        assert params == [(nn.Parameter, param_dtype)] * 2, (name, params)
        assert arg_dtype == param_dtype, name
    # The child resharded after forward: its sharded parameters are fp32 again.
    for name, param in model.in_proj.named_parameters():
        assert isinstance(param, DTensor), name
        assert param.dtype == FP32, name
    out.float().sum().backward()
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        assert param.dtype == FP32, name
        assert isinstance(param.grad, DTensor), name
        assert param.grad.dtype == FP32, (name, param.grad.dtype)
        assert param.grad.to_local().dtype == FP32, name


@pytest.mark.parametrize(
    ("param_dtype", "reduce_dtype", "output_dtype"),
    [
        pytest.param(BF16, None, None, id="bf16"),
        pytest.param(BF16, FP32, None, id="bf16-reduce_fp32"),
        pytest.param(FP16, FP32, FP32, id="fp16-reduce_fp32-out_fp32"),
        pytest.param(BF16, BF16, FP16, id="bf16-reduce_bf16-out_fp16"),
    ],
)
def test_param_grad_and_output_dtypes(
    impl: Impl, param_dtype: torch.dtype, reduce_dtype: Any, output_dtype: Any
) -> None:
    run_threaded(2, _dtypes, impl, param_dtype, reduce_dtype, output_dtype)


class EmbedAdd(nn.Module):
    """Token embedding plus a float input: one int and one float argument."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.lin = nn.Linear(8, 5)

    def forward(self, tokens: torch.Tensor, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(tokens) + x) * scale


def _input_casts(impl: Impl, cast_forward_inputs: bool) -> None:
    rank = dist.get_rank()
    model = seeded(EmbedAdd)
    ref = copy.deepcopy(model).to(BF16)
    impl.fully_shard(
        model, mp_policy=mp_policy(impl, param_dtype=BF16, cast_forward_inputs=cast_forward_inputs)
    )
    seen: list[tuple[torch.dtype, ...]] = []
    model.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append((args[0].dtype, args[1].dtype, kwargs["scale"].dtype)),
        with_kwargs=True,
    )
    tokens = torch.randint(0, 11, (4, 3), generator=torch.Generator().manual_seed(rank))
    x = make_input((4, 3, 8), rank)
    scale = torch.full((1,), 0.5, dtype=torch.float64)
    if cast_forward_inputs:
        out = model(tokens, x, scale=scale)
        assert seen == [(torch.int64, BF16, BF16)]
    else:
        # Inputs are left alone: the user feeds the compute dtype.
        out = model(tokens, x.to(BF16), scale=scale.to(BF16))
        assert seen == [(torch.int64, BF16, BF16)]
    assert tokens.dtype == torch.int64
    assert out.dtype == BF16
    want = ref(tokens, x.to(BF16), scale=scale.to(BF16))
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    out.float().sum().backward()
    want.float().sum().backward()
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters(), strict=True):
        grad = ref_param.grad.float()
        dist.all_reduce(grad, op=dist.ReduceOp.AVG)
        torch.testing.assert_close(
            param.grad.full_tensor(), grad, **LOW_PRECISION, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize("cast_forward_inputs", [True, False], ids=["cast", "no_cast"])
def test_int_inputs_untouched_float_inputs_cast(impl: Impl, cast_forward_inputs: bool) -> None:
    run_threaded(2, _input_casts, impl, cast_forward_inputs)


@dataclass(frozen=True)
class _Batch:
    x: torch.Tensor
    extra: list[torch.Tensor]


class _BatchLinear(nn.Linear):
    def forward(self, batch: _Batch) -> torch.Tensor:  # type: ignore[override]
        return super().forward(batch.x) + batch.extra[0]


def _dataclass_inputs(impl: Impl) -> None:
    """Floats inside a (frozen) dataclass input are cast, in a copy: the caller's object is unchanged."""
    model = seeded(lambda: _BatchLinear(6, 4))
    ref = copy.deepcopy(model).to(BF16)
    impl.fully_shard(model, mp_policy=mp_policy(impl, param_dtype=BF16))
    rank = dist.get_rank()
    batch = _Batch(make_input((2, 6), rank), [make_input((2, 4), rank, 1)])
    out = model(batch)
    assert batch.x.dtype == FP32
    assert batch.extra[0].dtype == FP32
    want = ref(_Batch(batch.x.to(BF16), [batch.extra[0].to(BF16)]))
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_dataclass_inputs_cast_in_a_copy(impl: Impl) -> None:
    run_threaded(2, _dataclass_inputs, impl)


def _no_cast_leaves_inputs(impl: Impl) -> None:
    model = seeded(lambda: nn.Linear(6, 4))
    impl.fully_shard(model, mp_policy=mp_policy(impl, param_dtype=BF16, cast_forward_inputs=False))
    seen: list[torch.dtype] = []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    # fp32 input against bf16 parameters: the policy does not cast, so the matmul refuses it.
    with pytest.raises(RuntimeError, match=r"(?i)dtype|type"):
        model(make_input((2, 6), dist.get_rank()))
    assert seen == [FP32]


def test_cast_forward_inputs_false_leaves_fp32_input(impl: Impl) -> None:
    run_threaded(2, _no_cast_leaves_inputs, impl)


# ---------------------------------------------------------------------------------------------
# Numbers against the unsharded reference (fp32 reduction)
# ---------------------------------------------------------------------------------------------


def _reference_step(master: nn.Module, x: torch.Tensor, param_dtype: torch.dtype) -> torch.Tensor:
    """What FSDP does for one step: low-precision compute, fp32 gradients averaged over ranks."""
    low = copy.deepcopy(master).to(param_dtype)
    loss = low(x.to(param_dtype) if x.is_floating_point() else x).sum()
    loss.backward()
    for param, low_param in zip(master.parameters(), low.parameters(), strict=True):
        grad = low_param.grad.to(FP32)
        dist.all_reduce(grad, op=dist.ReduceOp.AVG)
        param.grad = grad
    return loss.detach()


def _against_reference(spec: Spec, param_dtype: torch.dtype, steps: int) -> list[float]:
    rank = dist.get_rank()
    fsdp2 = get_impl("fsdp2")
    model = seeded(spec.build)
    master = copy.deepcopy(model)
    _shard(fsdp2, spec, model, param_dtype=param_dtype, reduce_dtype=FP32)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.AdamW(master.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x = spec.inputs(rank, step)
        loss = model(x).sum()
        assert loss.dtype == param_dtype
        loss.backward()
        ref_loss = _reference_step(master, x, param_dtype)
        torch.testing.assert_close(loss, ref_loss, **LOW_PRECISION)
        if step == 0:
            for (name, param), ref_param in zip(model.named_parameters(), master.parameters(), strict=True):
                assert param.grad.dtype == FP32, name
                torch.testing.assert_close(
                    param.grad.full_tensor(),
                    ref_param.grad,
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda m, n=name: f"{n}: {m}",
                )
        step_all(optim, ref_optim)
        losses.append(loss.item())
    for (name, param), ref_param in zip(model.named_parameters(), master.parameters(), strict=True):
        assert param.dtype == FP32
        torch.testing.assert_close(
            param.full_tensor(), ref_param, **PARAMS_AFTER_STEPS, msg=lambda m, n=name: f"{n}: {m}"
        )
    return losses


@pytest.mark.parametrize("param_dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("world_size", [2])
def test_fp32_reduce_matches_unsharded_reference(
    world_size: int, spec: Spec, param_dtype: torch.dtype
) -> None:
    losses = run_threaded(world_size, _against_reference, spec, param_dtype, 3)
    assert len({tuple(r) for r in losses}) == world_size  # ranks really saw different data


# ---------------------------------------------------------------------------------------------
# Differential: fsdp2 vs torch with the same policy
# ---------------------------------------------------------------------------------------------


def _differential(spec: Spec, policy: dict[str, Any], steps: int) -> None:
    rank = dist.get_rank()
    ours_impl, theirs_impl = get_impl("fsdp2"), torch_impl()
    ours = seeded(spec.build)
    theirs = copy.deepcopy(ours)
    _shard(ours_impl, spec, ours, **policy)
    _shard(theirs_impl, spec, theirs, **policy)
    our_optim = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    their_optim = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    expected_out = policy.get("output_dtype") or policy["param_dtype"]
    for step in range(steps):
        x = spec.inputs(rank, step)
        our_out, their_out = ours(x), theirs(x)
        assert our_out.dtype == their_out.dtype == expected_out
        our_loss, their_loss = our_out.sum(), their_out.sum()
        our_loss.backward()
        their_loss.backward()
        torch.testing.assert_close(our_loss, their_loss, **LOW_PRECISION)
        if step == 0:
            for (name, ours_p), theirs_p in zip(ours.named_parameters(), theirs.parameters(), strict=True):
                assert ours_p.grad.dtype == theirs_p.grad.dtype == FP32, name
                torch.testing.assert_close(
                    ours_p.grad.full_tensor(),
                    theirs_p.grad.full_tensor(),
                    **LOW_PRECISION,
                    msg=lambda m, n=name: f"{n}: {m}",
                )
        step_all(our_optim, their_optim)
    for (name, ours_p), theirs_p in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(
            ours_p.full_tensor(),
            theirs_p.full_tensor(),
            **PARAMS_AFTER_STEPS,
            msg=lambda m, n=name: f"{n}: {m}",
        )


POLICIES = [
    pytest.param({"param_dtype": BF16}, id="bf16"),
    pytest.param({"param_dtype": BF16, "reduce_dtype": FP32}, id="bf16-reduce_fp32"),
    pytest.param({"param_dtype": FP16}, id="fp16"),
    pytest.param({"param_dtype": FP16, "reduce_dtype": FP32}, id="fp16-reduce_fp32"),
    pytest.param({"param_dtype": BF16, "reduce_dtype": FP32, "output_dtype": FP32}, id="bf16-out_fp32"),
    pytest.param({"param_dtype": BF16, "reduce_dtype": BF16}, id="bf16-reduce_bf16"),
]


def _differential_cases() -> list[Any]:
    """Every policy at world 2; at world 4 the one whose reduction the world changes: fp16 gradients
    reduced in fp16 are divided before and after the sum, by 2 and 2 (at world 2: by 2 before only);
    the other policies reduce in an AVG-safe dtype (bf16, fp32) at any world."""
    cases = []
    for world in (2, 4):
        for spec in SPECS:
            for policy in POLICIES:
                if world == 2 or policy.id == "fp16":
                    name = f"{world}-{spec.id}-{policy.id}"
                    cases.append(pytest.param(world, *spec.values, *policy.values, id=name))
    return cases


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize(("world_size", "spec", "policy"), _differential_cases())
def test_differential_against_torch(world_size: int, spec: Spec, policy: dict[str, Any]) -> None:
    run_threaded(world_size, _differential, spec, policy, 3)


# ---------------------------------------------------------------------------------------------
# reduce_dtype == param_dtype is no reduce cast at all
# ---------------------------------------------------------------------------------------------


def _grads_with(base: nn.Module, reduce_dtype: Any, param_dtype: torch.dtype) -> list[torch.Tensor]:
    fsdp2 = get_impl("fsdp2")
    model = copy.deepcopy(base)
    _shard(fsdp2, MLP_SPEC, model, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    model(MLP_SPEC.inputs(dist.get_rank(), 0)).sum().backward()
    return [p.grad.full_tensor() for p in model.parameters()]


def _same_as_no_reduce_cast(param_dtype: torch.dtype) -> None:
    # One build, copied: threads share the RNG, so two builds could differ.
    base = seeded(MLP_SPEC.build)
    same = _grads_with(base, param_dtype, param_dtype)
    none = _grads_with(base, None, param_dtype)
    for a, b in zip(same, none, strict=True):
        assert a.dtype == b.dtype == FP32
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("param_dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("world_size", [2])
def test_reduce_dtype_equal_to_param_dtype_is_no_cast(world_size: int, param_dtype: torch.dtype) -> None:
    run_threaded(world_size, _same_as_no_reduce_cast, param_dtype)


# ---------------------------------------------------------------------------------------------
# Different policies per call: an fp32-output inner module feeding a bf16 module
# ---------------------------------------------------------------------------------------------


def _per_call_policies(impl: Impl) -> None:
    rank = dist.get_rank()
    model = seeded(lambda: MLP(MLP_DIM))
    low = copy.deepcopy(model).to(BF16)
    impl.fully_shard(model.in_proj, mp_policy=mp_policy(impl, param_dtype=BF16, output_dtype=FP32))
    impl.fully_shard(model.out_proj, mp_policy=mp_policy(impl, param_dtype=BF16))
    impl.fully_shard(model, mp_policy=mp_policy(impl, param_dtype=BF16))
    seen: dict[str, torch.dtype] = {}
    model.in_proj.register_forward_hook(lambda m, a, out: seen.__setitem__("in_proj", out.dtype))
    model.out_proj.register_forward_pre_hook(lambda m, args: seen.__setitem__("out_proj_in", args[0].dtype))
    x = make_input((3, MLP_DIM), rank)
    out = model(x)
    # in_proj's output is fp32; out_proj's own state casts its input back to bf16.
    assert seen == {"in_proj": FP32, "out_proj_in": BF16}
    assert out.dtype == BF16
    hidden = low.in_proj(x.to(BF16)).float()
    want = low.out_proj(torch.relu(hidden).to(BF16))
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_per_call_policies_output_dtype_feeds_next_module(impl: Impl) -> None:
    run_threaded(2, _per_call_policies, impl)
