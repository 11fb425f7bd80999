"""Gradient accumulation and sync controls, threads as ranks (docs/accumulation.md).

- ``set_requires_gradient_sync(False)`` over the first micro-steps (optionally with
  ``set_is_last_backward(False)``): no reduce-scatter, the sharded ``.grad`` stays ``None``, and
  the synced micro-step's gradients equal the micro-batch sum averaged over ranks;
- with ``param_dtype=bf16, reduce_dtype=fp32`` the unsynced accumulation happens in fp32;
- ``set_reshard_after_backward(False)``: plain unsharded parameters stay registered and the next
  forward issues no all-gather;
- ``set_unshard_in_backward(False)`` on an embedding: no backward all-gather, same gradients;
- ``reset_iter_state()`` after an exception in forward or in backward: the next step equals a
  clean step exactly.

Reference: an unsharded copy of the model run on the same per-rank inputs, gradients summed over
micro-batches by autograd and averaged over ranks with an all-reduce.
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

from tests._harness import count_collectives, run_threaded
from tests._impls import Impl, get_impl, torch_impl
from tests._training import EXACT, TIGHT, average_grads, mp_policy, seeded, step_all
from tests.models import MLP, ModelArgs, Transformer, make_input, make_tokens
from tests.shared.grad_sync import BoomError, Stack

MICRO_STEPS = 4


@dataclass(frozen=True)
class Spec:
    build: Callable[[], nn.Module]
    blocks: Callable[[nn.Module], list[nn.Module]]
    inputs: Callable[[int, int], torch.Tensor]  # (rank, call index) -> input


MLP_DIM = 13
TF_ARGS = ModelArgs(n_layers=2, dim=8, n_heads=2)
MLP_SPEC = Spec(
    build=lambda: MLP(MLP_DIM),
    blocks=lambda m: [m.in_proj],
    inputs=lambda rank, i: make_input((3, MLP_DIM), rank, seed=i),
)
TF_SPEC = Spec(
    build=lambda: Transformer(TF_ARGS),
    blocks=lambda m: list(m.layers),
    inputs=lambda rank, i: make_tokens(TF_ARGS, 100 * i + rank),
)
SPECS = [pytest.param(MLP_SPEC, id="mlp"), pytest.param(TF_SPEC, id="transformer")]


def _shard(impl: Impl, spec: Spec, model: nn.Module, **kwargs: Any) -> None:
    for block in spec.blocks(model):
        impl.fully_shard(block, **kwargs)
    impl.fully_shard(model, **kwargs)


def _assert_parity(ref: nn.Module, model: nn.Module, *, grads: bool, tol: dict[str, float] = TIGHT) -> None:
    for (name, ref_param), (sharded_name, param) in zip(
        ref.named_parameters(), model.named_parameters(), strict=True
    ):
        assert name == sharded_name
        assert isinstance(param, DTensor), name
        torch.testing.assert_close(param.full_tensor(), ref_param, **tol, msg=lambda m, n=name: f"{n}: {m}")
        if grads:
            if ref_param.grad is None:
                assert param.grad is None, name
                continue
            assert isinstance(param.grad, DTensor), name
            torch.testing.assert_close(
                param.grad.full_tensor(), ref_param.grad, **tol, msg=lambda m, n=name: f"{n} grad: {m}"
            )


# ---------------------------------------------------------------------------------------------
# set_requires_gradient_sync(False) over micro-steps
# ---------------------------------------------------------------------------------------------


def _accumulate(impl_name: str, spec: Spec, toggle_last_backward: bool, steps: int) -> list[int]:
    rank = dist.get_rank()
    impl = get_impl(impl_name)
    model = seeded(spec.build)
    ref = copy.deepcopy(model)
    _shard(impl, spec, model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    reduce_scatters = []
    for step in range(steps):
        for micro in range(MICRO_STEPS):
            last = micro == MICRO_STEPS - 1
            model.set_requires_gradient_sync(last)
            if toggle_last_backward:
                model.set_is_last_backward(last)
            x = spec.inputs(rank, 10 * step + micro)
            loss = model(x).sum()
            with count_collectives() as counts:
                loss.backward()
            reduce_scatters.append(counts["reduce_scatter"])
            ref_loss = ref(x).sum()
            ref_loss.backward()
            torch.testing.assert_close(loss, ref_loss, **(EXACT if step == 0 else TIGHT))
            if not last:
                for name, param in model.named_parameters():
                    assert isinstance(param, DTensor), name
                    assert param.grad is None, f"{name}: sharded grad set during a no-sync micro-step"
        average_grads(ref)
        _assert_parity(ref, model, grads=True)
        step_all(optim, ref_optim)
    _assert_parity(ref, model, grads=False)
    return reduce_scatters


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("toggle_last_backward", [False, True], ids=["sync_only", "with_is_last_backward"])
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("world_size", [2])
def test_no_sync_accumulation_matches_reference(
    impl: Impl, world_size: int, spec: Spec, toggle_last_backward: bool
) -> None:
    model = spec.build()
    n_groups = len(spec.blocks(model)) + 1
    results = run_threaded(world_size, _accumulate, impl.name, spec, toggle_last_backward, 2)
    want = ([0] * (MICRO_STEPS - 1) + [n_groups]) * 2  # one reduce-scatter per group, last micro only
    assert results == [want] * world_size


# ---------------------------------------------------------------------------------------------
# No-sync accumulation in reduce_dtype (fp32) under bf16 compute
# ---------------------------------------------------------------------------------------------


def _reference_fp32_accumulation(master: nn.Module, xs: list[torch.Tensor]) -> None:
    """bf16 forward/backward per micro-batch, each gradient cast to fp32 and summed in fp32."""
    low = copy.deepcopy(master).to(torch.bfloat16)
    sums = [torch.zeros_like(p) for p in master.parameters()]
    for x in xs:
        low.zero_grad(set_to_none=True)
        low(x.to(torch.bfloat16) if x.is_floating_point() else x).sum().backward()
        for total, low_param in zip(sums, low.parameters(), strict=True):
            total.add_(low_param.grad.float())
    for param, total in zip(master.parameters(), sums, strict=True):
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        param.grad = total


def _accumulate_mixed(spec: Spec) -> None:
    rank = dist.get_rank()
    fsdp2, theirs_impl = get_impl("fsdp2"), torch_impl()
    base = seeded(spec.build)
    master, ours, theirs = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    policy = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    _shard(fsdp2, spec, ours, mp_policy=mp_policy(fsdp2, **policy))
    _shard(theirs_impl, spec, theirs, mp_policy=mp_policy(theirs_impl, **policy))
    xs = [spec.inputs(rank, micro) for micro in range(MICRO_STEPS)]
    for micro, x in enumerate(xs):
        last = micro == MICRO_STEPS - 1
        for model in (ours, theirs):
            model.set_requires_gradient_sync(last)
            model.set_is_last_backward(last)
            model(x).sum().backward()
        if not last:
            assert all(p.grad is None for p in ours.parameters())
    _reference_fp32_accumulation(master, xs)
    for (name, ours_p), theirs_p, ref_p in zip(
        ours.named_parameters(), theirs.parameters(), master.parameters(), strict=True
    ):
        assert ours_p.grad.dtype == torch.float32, name
        # fp32 accumulation of the same bf16 micro-gradients: bf16 accumulation would be ~1e-2 off.
        torch.testing.assert_close(
            ours_p.grad.full_tensor(),
            theirs_p.grad.full_tensor(),
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m, n=name: f"{n} vs torch: {m}",
        )
        torch.testing.assert_close(
            ours_p.grad.full_tensor(),
            ref_p.grad,
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m, n=name: f"{n} vs reference: {m}",
        )


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("world_size", [2])
def test_no_sync_accumulates_in_reduce_dtype(world_size: int, spec: Spec) -> None:
    run_threaded(world_size, _accumulate_mixed, spec)


# ---------------------------------------------------------------------------------------------
# set_reshard_after_backward(False)
# ---------------------------------------------------------------------------------------------


def _keep_unsharded(impl_name: str, world_size: int) -> list[int]:
    rank = dist.get_rank()
    impl = get_impl(impl_name)
    model = seeded(MLP_SPEC.build)
    ref = copy.deepcopy(model)
    _shard(impl, MLP_SPEC, model)
    forward_gathers = []
    for micro in range(3):
        last = micro == 2
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)
        x = MLP_SPEC.inputs(rank, micro)
        with count_collectives() as counts:
            loss = model(x).sum()
        forward_gathers.append(counts["all_gather"])
        loss.backward()
        ref(x).sum().backward()
        if last:
            for name, param in model.named_parameters():
                assert isinstance(param, DTensor), name
        else:
            for name, param in model.named_parameters():
                assert type(param) is nn.Parameter, f"{name}: {type(param)}"
                assert param.shape == dict(ref.named_parameters())[name].shape
    average_grads(ref)
    _assert_parity(ref, model, grads=True)
    return forward_gathers


@pytest.mark.parametrize("world_size", [2])
def test_reshard_after_backward_false_skips_next_all_gather(impl: Impl, world_size: int) -> None:
    results = run_threaded(world_size, _keep_unsharded, impl.name, world_size)
    # First forward gathers both groups (root + in_proj); later forwards find them unsharded.
    assert results == [[2, 0, 0]] * world_size


# ---------------------------------------------------------------------------------------------
# set_unshard_in_backward(False) on an embedding
# ---------------------------------------------------------------------------------------------


class EmbedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(19, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(tokens)))


def _skip_backward_unshard(impl_name: str, unshard_in_backward: bool) -> int:
    rank = dist.get_rank()
    impl = get_impl(impl_name)
    model = seeded(EmbedHead)
    ref = copy.deepcopy(model)
    impl.fully_shard(model.emb)
    impl.fully_shard(model)
    model.emb.set_unshard_in_backward(unshard_in_backward)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gathers = 0
    for step in range(2):
        tokens = torch.randint(0, 19, (24,), generator=torch.Generator().manual_seed(rank + 10 * step))
        loss = model(tokens).sum()
        with count_collectives() as counts:
            loss.backward()
        gathers += counts["all_gather"]
        ref(tokens).sum().backward()
        average_grads(ref)
        _assert_parity(ref, model, grads=True)
        step_all(optim, ref_optim)
    _assert_parity(ref, model, grads=False)
    return gathers


@pytest.mark.parametrize("unshard_in_backward", [True, False], ids=["default", "skip"])
@pytest.mark.parametrize("world_size", [2])
def test_unshard_in_backward_false_on_embedding(
    impl: Impl, world_size: int, unshard_in_backward: bool
) -> None:
    results = run_threaded(world_size, _skip_backward_unshard, impl.name, unshard_in_backward)
    # The root keeps its parameters after forward; only the embedding would re-gather (2 steps).
    assert results == [2 if unshard_in_backward else 0] * world_size


# ---------------------------------------------------------------------------------------------
# reset_iter_state()
# ---------------------------------------------------------------------------------------------


def _forward_backward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).sum()
    loss.backward()
    return loss.detach()


def _reset_after_exception(impl_name: str, where: str) -> None:
    rank = dist.get_rank()
    impl = get_impl(impl_name)
    base = seeded(Stack)
    ref, model, clean = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    for sharded in (model, clean):
        for block in sharded.blocks:
            impl.fully_shard(block)
        impl.fully_shard(sharded)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model, clean)]
    xs = [make_input((4, 6), rank, seed=i) for i in range(3)]

    # One clean step for everyone, so the failure hits a model in its steady state.
    for m in (ref, model, clean):
        _forward_backward(m, xs[0])
    average_grads(ref)
    for optim in optims:
        optim.step()
        optim.zero_grad()

    # The failing iteration: only `model` runs it.
    model.blocks[1].raiser.fail = where
    with pytest.raises(BoomError, match=where):
        model(xs[1]).sum().backward()
    model.blocks[1].raiser.fail = None
    model.reset_iter_state()
    optims[1].zero_grad(set_to_none=True)
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{name} not resharded by reset_iter_state"

    # The next step must equal the clean model's step exactly, and the reference's.
    losses = [_forward_backward(m, xs[2]) for m in (ref, model, clean)]
    torch.testing.assert_close(losses[1], losses[2], **EXACT)
    torch.testing.assert_close(losses[1], losses[0], **TIGHT)
    average_grads(ref)
    for (name, param), clean_param in zip(model.named_parameters(), clean.parameters(), strict=True):
        torch.testing.assert_close(
            param.grad.full_tensor(),
            clean_param.grad.full_tensor(),
            **EXACT,
            msg=lambda m, n=name: f"{n}: {m}",
        )
    _assert_parity(ref, model, grads=True)
    for optim in optims:
        optim.step()
        optim.zero_grad()
    _assert_parity(ref, model, grads=False)
    # And training goes on normally.
    for m in (ref, model):
        _forward_backward(m, xs[0])
    average_grads(ref)
    _assert_parity(ref, model, grads=True)


@pytest.mark.parametrize("world_size", [2])
def test_reset_iter_state_after_forward_exception(impl: Impl, world_size: int) -> None:
    run_threaded(world_size, _reset_after_exception, impl.name, "forward")


@pytest.mark.parametrize("world_size", [2])
def test_reset_iter_state_after_backward_exception(world_size: int) -> None:
    # fsdp2 only: torch keeps the unsharded gradients of groups whose post-backward never ran
    # (the root's head, block 1's lin2) and adds them into the next step's reduction.
    run_threaded(world_size, _reset_after_exception, "fsdp2", "backward")


def _forward_raises_mid_accumulation(prefetch: bool) -> None:
    """A micro-batch's forward raises, the loop catches it and goes on without reset_iter_state()."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    rank = dist.get_rank()
    impl = get_impl("fsdp2")
    base = seeded(Stack)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    for block in model.blocks:
        impl.fully_shard(block)
    impl.fully_shard(model)
    if prefetch:  # an all-gather of the next block is in flight when block 1 raises
        for block, after in zip(model.blocks, model.blocks[1:], strict=False):
            block.set_modules_to_forward_prefetch([after])
    xs = [make_input((4, 6), rank, seed=i) for i in range(2)]

    model.set_requires_gradient_sync(False)
    _forward_backward(model, xs[0])  # micro-batch 0: held, unreduced
    model.blocks[1].raiser.fail = "forward"
    with pytest.raises(BoomError, match="forward"):
        model(xs[1])
    model.blocks[1].raiser.fail = None
    # The usual save-on-crash handler sees the sharded parameters, as after any step.
    for key, value in [*model.state_dict().items(), *get_model_state_dict(model).items()]:
        assert isinstance(value, DTensor), f"state_dict()[{key!r}] is a plain {tuple(value.shape)} tensor"
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{name} still registered unsharded"

    # The loop retries the micro-batch: the held gradients of micro-batch 0 are still summed in.
    model.set_requires_gradient_sync(True)
    _forward_backward(model, xs[1])
    for x in xs:
        _forward_backward(ref, x)
    average_grads(ref)
    _assert_parity(ref, model, grads=True)


@pytest.mark.parametrize("prefetch", [False, True], ids=["implicit", "explicit_prefetch"])
def test_forward_exception_leaves_sharded_parameters(prefetch: bool) -> None:
    # torch: state_dict() is sharded (its pre-hook), named_parameters() still yields the gathered tensors.
    run_threaded(2, _forward_raises_mid_accumulation, prefetch)


def _reset_on_non_root(impl_name: str) -> None:
    impl = get_impl(impl_name)
    model = seeded(Stack)
    for block in model.blocks:
        impl.fully_shard(block)
    impl.fully_shard(model)
    model(make_input((2, 6), dist.get_rank())).sum().backward()
    with pytest.raises(RuntimeError, match=r"(?i)root"):
        model.blocks[0].reset_iter_state()
    model.reset_iter_state()  # the root may


def test_reset_iter_state_on_non_root_raises(impl: Impl) -> None:
    run_threaded(2, _reset_on_non_root, impl.name)
