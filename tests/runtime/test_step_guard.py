"""Optimizer steps that were silent mistakes with torch's ``fully_shard`` (and fsdp2 before).

Side by side with torch's ``fully_shard`` and the unsharded reference, 2 thread ranks:

- ``set_requires_gradient_sync(False)`` never turned back on: torch's steps train nothing (the
  gradients stay unreduced); fsdp2's ``optimizer.step()`` raises before changing anything;
- ``set_reshard_after_backward(False)`` then ``optimizer.step()``: torch's next forward reuses the
  stale unsharded parameters; fsdp2 reshards after the step, so training matches the reference;
- ``optimizer.step()`` between a forward and its backward: the unsharded model's backward fails
  (autograd's in-place check), torch's silently differentiates with the new parameters; fsdp2's
  backward raises, and ``reset_iter_state()`` makes the next step clean;
- ``optimizer.zero_grad()`` / ``model.zero_grad()`` after a no-sync micro-batch: torch still sums that
  micro-batch into the next synced reduction; fsdp2 drops it, as the unsharded model does.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests._harness import run_threaded
from tests._impls import get_impl
from tests._training import EXACT, average_grads, fill_deterministic_
from tests.models import MLP, make_input

DIM = 8


def _model() -> nn.Module:
    return fill_deterministic_(nn.Sequential(MLP(DIM), MLP(DIM)), scale=0.3)


def _shard(impl_name: str, model: nn.Module) -> nn.Module:
    impl = get_impl(impl_name)
    for block in model:
        impl.fully_shard(block)
    impl.fully_shard(model)
    return model


def _full(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().clone() for p in model.parameters()]


# ---- gradient sync never turned back on -----------------------------------------------------------


def _sync_left_off(impl_name: str) -> bool:
    model = _shard(impl_name, _model())
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    model.set_requires_gradient_sync(False)
    before = _full(model)
    for step in range(3):
        model(make_input((2, DIM), 0, seed=step)).sum().backward()
        if impl_name == "fsdp2":
            with pytest.raises(RuntimeError, match=r"set_requires_gradient_sync\(True\) before the last"):
                optim.step()
            for a, b in zip(_full(model), before, strict=True):  # refused before any change
                torch.testing.assert_close(a, b, **EXACT)
            # The fix the message names: a synced backward reduces everything held, then the step trains.
            model.set_requires_gradient_sync(True)
            model(make_input((2, DIM), 0, seed=9)).sum().backward()
            optim.step()
            return any(not torch.equal(a, b) for a, b in zip(_full(model), before, strict=True))
        optim.step()
        optim.zero_grad()
    return any(not torch.equal(a, b) for a, b in zip(_full(model), before, strict=True))


def test_step_with_gradients_never_reduced() -> None:
    assert run_threaded(2, _sync_left_off, "torch") == [False, False]  # silently trains nothing
    assert run_threaded(2, _sync_left_off, "fsdp2") == [True, True]  # raised, then trained once synced


# ---- kept unsharded after backward, then a step ---------------------------------------------------


def _kept_unsharded_then_stepped(impl_name: str) -> float:
    import torch.distributed as dist

    ref = _model()
    model = _shard(impl_name, copy.deepcopy(ref))
    model.set_reshard_after_backward(False)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    worst = 0.0
    for step in range(3):
        x = make_input((2, DIM), dist.get_rank(), seed=step)
        loss, ref_loss = model(x).sum(), ref(x).sum()
        worst = max(worst, (loss - ref_loss).abs().item())
        loss.backward()
        ref_loss.backward()
        average_grads(ref)
        for o in (optim, ref_optim):
            o.step()
            o.zero_grad()
    return worst


def test_step_after_backward_that_kept_parameters_unsharded() -> None:
    assert run_threaded(2, _kept_unsharded_then_stepped, "torch")[0] > 1e-3  # stale parameters
    assert run_threaded(2, _kept_unsharded_then_stepped, "fsdp2")[0] < 1e-5  # the reference's losses


# ---- a step between forward and backward ----------------------------------------------------------


def _step_inside_the_iteration() -> None:
    import torch.distributed as dist

    ref = _model()
    unsharded = copy.deepcopy(ref)
    x = make_input((2, DIM), dist.get_rank(), seed=0)
    ref_optim = torch.optim.SGD(unsharded.parameters(), lr=0.1)
    unsharded(x).sum().backward()  # gradients for the step below
    loss = unsharded(x).sum()
    ref_optim.step()  # updates in place the weights this loss's backward needs
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation"):
        loss.backward()

    model = _shard("fsdp2", copy.deepcopy(ref))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).sum().backward()  # a first step, so the optimizer has gradients to apply
    loss = model(x).sum()
    optim.step()
    with pytest.raises(RuntimeError, match=r"after the forward this backward differentiates"):
        loss.backward()
    model.reset_iter_state()
    optim.zero_grad()
    # Afterwards a clean step matches the unsharded model stepped the same way.
    reference = copy.deepcopy(ref)
    reference_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(x).sum().backward()
    average_grads(reference)
    reference_optim.step()
    reference_optim.zero_grad()
    model(x).sum().backward()
    reference(x).sum().backward()
    average_grads(reference)
    for param, ref_param in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad)


def test_step_between_forward_and_backward_raises_at_backward() -> None:
    run_threaded(2, _step_inside_the_iteration)


# ---- zero_grad after a no-sync backward ---------------------------------------------------------


def _zero_grad_between_micro_batches(impl_name: str, how: str) -> float:
    import torch.distributed as dist

    ref = _model()
    model = _shard(impl_name, copy.deepcopy(ref))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = dist.get_rank()
    model.set_requires_gradient_sync(False)
    model(make_input((2, DIM), rank, seed=0)).sum().backward()  # a micro-batch the user then discards
    if how == "optimizer":
        optim.zero_grad()
    else:
        model.zero_grad()
    model.set_requires_gradient_sync(True)
    x = make_input((2, DIM), rank, seed=1)
    model(x).sum().backward()
    ref(x).sum().backward()  # the unsharded model: zero_grad cleared the first micro-batch
    average_grads(ref)
    return max(
        (p.grad.full_tensor() - q.grad).abs().max().item()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True)
    )


@pytest.mark.parametrize("how", ["optimizer", "module"])
def test_zero_grad_drops_gradients_held_by_a_no_sync_backward(how: str) -> None:
    assert run_threaded(2, _zero_grad_between_micro_batches, "torch", how)[0] > 1e-3  # summed in anyway
    assert run_threaded(2, _zero_grad_between_micro_batches, "fsdp2", how)[0] < 1e-6
