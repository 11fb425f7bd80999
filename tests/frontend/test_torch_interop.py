"""fsdp2 modules are FSDP modules to torch's own code (threaded ranks).

Covers: ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` and that every method of torch's class is
fsdp2's; the loops libraries run over ``isinstance`` hits (torchtitan's divide-factor loop), torch's
``register_fsdp_forward_method`` and ``share_comm_ctx`` given fsdp2 modules, the manual end of
backward torch's pipelining drives through ``fully_shard.state(m)`` after no-sync micro-batches, the
refusal of a model that mixes the two implementations, and ``patch_torch_fsdp``. Numbers are compared
with torch's ``fully_shard`` running the same code, or with the unsharded model.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.tensor import DTensor

import fsdp2
from tests._harness import run_threaded
from tests._impls import Impl, get_impl
from tests._training import fill_deterministic_

DIM = 6


def _model() -> nn.Module:
    return fill_deterministic_(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM)), scale=0.3)


def _shard(impl: Impl, model: nn.Module) -> nn.Module:
    impl.fully_shard(model[0])
    impl.fully_shard(model[2])
    impl.fully_shard(model)
    return model


def _input() -> torch.Tensor:
    return torch.arange(4 * DIM, dtype=torch.float32).reshape(4, DIM).div(7) + dist.get_rank()


def test_every_torch_method_is_fsdp2s() -> None:
    torch_names = {n for n in vars(torch_fsdp.FSDPModule) if not n.startswith("__")}
    assert torch_names - set(vars(fsdp2.FSDPModule)) == set()
    assert issubclass(fsdp2.FSDPModule, torch_fsdp.FSDPModule)


def _divide_factor_loop(impl: Impl) -> None:
    model, ref = _shard(impl, _model()), _model()
    # torchtitan's disable_fsdp_gradient_division, verbatim in effect: it finds modules by torch's class.
    found = 0
    for module in model.modules():
        if isinstance(module, torch_fsdp.FSDPModule):
            module.set_gradient_divide_factor(1.0)
            found += 1
    assert found == 3
    model(_input()).sum().backward()
    ref(_input()).sum().backward()
    for param, ref_param in zip(model.parameters(), ref.parameters(), strict=True):
        summed = ref_param.grad.clone()
        dist.all_reduce(summed)  # divide factor 1.0: the sum over ranks, not the mean
        torch.testing.assert_close(param.grad.full_tensor(), summed)


def test_library_isinstance_loop_reaches_fsdp2_modules() -> None:
    # torch's own fully_shard needs PREMUL_SUM for a divide factor, which the threaded backend lacks;
    # the reference is the unsharded model's summed gradients.
    run_threaded(2, _divide_factor_loop, get_impl("fsdp2"))


def _torch_helpers_on_fsdp2() -> None:
    model, ref = _model(), _model()
    _shard(get_impl("fsdp2"), model)
    model.forward_twice = lambda x: model[2](model[0](x)) * 2  # type: ignore[attr-defined]
    ref_out = ref[2](ref[0](_input())) * 2
    torch_fsdp.register_fsdp_forward_method(model, "forward_twice")
    out = model.forward_twice(_input())  # type: ignore[attr-defined]
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    # torch's share_comm_ctx reads and writes the state's _comm_ctx and each group's comm_ctx.
    a, b = _shard(get_impl("fsdp2"), _model()), _shard(get_impl("fsdp2"), _model())
    torch_fsdp.share_comm_ctx([a, b])
    assert a._get_fsdp_state().comm_ctx is b._get_fsdp_state().comm_ctx
    assert all(g.comm_ctx is a._get_fsdp_state().comm_ctx for g in b._get_fsdp_state().groups)


def test_torch_helpers_work_on_fsdp2_modules() -> None:
    run_threaded(2, _torch_helpers_on_fsdp2)


def _pipelining_protocol(impl: Impl, microbatches: int) -> list[torch.Tensor]:
    """What torch's pipelining does to an FSDP stage: no-sync micro-batches, then a manual reduce."""
    model = _shard(impl, _model())
    for index in range(microbatches):
        model.set_is_last_backward(False)
        model.set_reshard_after_backward(False)
        model.set_requires_gradient_sync(False)
        (model(_input() * (index + 1)).sum() / microbatches).backward()
    # _PipelineStageBase.perform_reduce_grad, step by step (torch 2.13).
    model.set_is_last_backward(True)
    model.set_reshard_after_backward(True)
    model.set_requires_gradient_sync(True)
    state = torch_fsdp.fully_shard.state(model)
    for member in state._state_ctx.all_states:
        for group in member._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()
    assert all(isinstance(p, DTensor) for p in model.parameters())  # resharded after the reduce
    return [p.grad.full_tensor() for p in model.parameters()]


@pytest.mark.parametrize("microbatches", [1, 3])
def test_pipelining_manual_reduce_matches_torch(microbatches: int) -> None:
    theirs = run_threaded(2, _pipelining_protocol, get_impl("torch"), microbatches)
    ours = run_threaded(2, _pipelining_protocol, get_impl("fsdp2"), microbatches)
    for rank in range(2):
        for mine, reference in zip(ours[rank], theirs[rank], strict=True):
            torch.testing.assert_close(mine, reference, rtol=0, atol=0)


def _mixed_models() -> None:
    model = _model()
    torch_fsdp.fully_shard(model[0])
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match="cannot mix the two implementations"):
        fsdp2.fully_shard(model)
    assert [type(m) for m in model.modules()] == before
    assert not isinstance(model, fsdp2.FSDPModule)
    with pytest.raises(ValueError, match="cannot mix the two implementations"):
        fsdp2.fully_shard(model[0])


def test_mixing_with_torch_fully_shard_is_refused() -> None:
    run_threaded(2, _mixed_models)


def _patched() -> None:
    import torch.distributed._composable.fsdp as composable

    original = torch_fsdp.fully_shard
    by_torch = torch_fsdp.fully_shard(_model())  # sharded by torch before the patch
    torch_state = torch_fsdp.fully_shard.state(by_torch)
    assert torch_state is not None
    with fsdp2.patch_torch_fsdp():
        # Code that reads the state through the patched name (pipelining) still finds torch's.
        assert torch_fsdp.fully_shard.state(by_torch) is torch_state
        assert torch_fsdp.fully_shard.state(nn.Linear(2, 2)) is None
        assert torch_fsdp.fully_shard is fsdp2.fully_shard
        assert composable.fully_shard is fsdp2.fully_shard
        model, ref = torch_fsdp.fully_shard(_model()), _model()
        assert isinstance(model, fsdp2.FSDPModule)
        assert torch_fsdp.fully_shard.state(model) is model._get_fsdp_state()
        torch.testing.assert_close(model(_input()), ref(_input()), rtol=0, atol=0)
    assert torch_fsdp.fully_shard is original
    assert composable.fully_shard is original


def test_patch_torch_fsdp_swaps_and_restores() -> None:
    run_threaded(1, _patched)


def _async_unshard() -> None:
    model, ref = _shard(get_impl("fsdp2"), _model()), _model()
    with pytest.raises(TypeError, match="expects a bool"):
        model._set_unshard_async_op(1)  # type: ignore[arg-type]
    model._set_unshard_async_op(True)
    model(_input()).sum().backward()
    ref(_input()).sum().backward()
    for param, ref_param in zip(model.parameters(), ref.parameters(), strict=True):
        grad = ref_param.grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.AVG)
        torch.testing.assert_close(param.grad.full_tensor(), grad)
    twin = copy.deepcopy(model)  # the torch-state entry is not copied with the modules
    assert torch_fsdp.fully_shard.state(twin) is twin._get_fsdp_state()


def test_set_unshard_async_op() -> None:
    run_threaded(2, _async_unshard)
