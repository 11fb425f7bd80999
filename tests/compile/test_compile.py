"""torch.compile of each block: FSDP hooks run eagerly, the compiled blocks give the same numbers.

The common pattern compiles each block after fully_shard (the root's eager hooks prefetch across
blocks). The ``aot_eager`` backend traces forward and backward through dynamo and AOTAutograd without
generating kernels, so it checks the composition in seconds. Compiling the whole model takes the
compiled path (the collectives in the graph), which thread ranks cannot run (torch's threaded process
group has no functional reduce-scatter): ``tests/compile/test_compile_gloo.py``. ``replicate`` composes
the same way: compiled blocks of a replicated model give torch's ``replicate``'s numbers bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp2
from fsdp2.compile import _compiled
from fsdp2.runtime._state import get_state as fsdp2_state
from tests._harness import assert_sharded_parity, broadcast_module_, run_threaded
from tests._training import average_grads, forward_backward, step_all


def _model() -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)], nn.Linear(8, 3))


def _train_compiled(reshard_after_forward: bool) -> None:
    model = broadcast_module_(_model())
    ref = copy.deepcopy(model)
    for block in model:
        fsdp2.fully_shard(block, reshard_after_forward=reshard_after_forward)
    fsdp2.fully_shard(model, reshard_after_forward=reshard_after_forward)
    for block in model:
        block.compile(backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        x = torch.randn(4, 8, generator=gen)
        loss, ref_loss = forward_backward(x, model, ref)
        average_grads(ref)
        torch.testing.assert_close(loss, ref_loss)
        assert_sharded_parity(ref, model, grads=True)
        step_all(opt, ref_opt)
    assert_sharded_parity(ref, model)


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["reshard", "keep"])
def test_compiled_blocks_match_reference(reshard_after_forward: bool) -> None:
    torch._dynamo.reset()
    run_threaded(2, _train_compiled, reshard_after_forward)


def _train_compiled_replicate() -> None:
    """``replicate`` per block and root, each block compiled: torch's replicate's numbers, bit for bit."""
    from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate

    base = broadcast_module_(_model())
    ref, theirs, ours = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    for model, replicate in ((ours, fsdp2.replicate), (theirs, torch_replicate)):
        for block in model:
            replicate(block)
        replicate(model)
        for block in model:
            block.compile(backend="aot_eager")
    models = (ours, theirs, ref)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        x = torch.randn(4, 8, generator=gen)
        loss, their_loss, ref_loss = forward_backward(x, *models)
        average_grads(ref)
        assert torch.equal(loss, their_loss), (loss, their_loss)
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            assert torch.equal(p.grad.full_tensor(), q.grad.full_tensor())
        torch.testing.assert_close(loss, ref_loss)
        assert_sharded_parity(ref, ours, grads=True)
        step_all(*optims)
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(p.full_tensor(), q.full_tensor())


def test_compiled_replicated_blocks_match_torch_replicate() -> None:
    torch._dynamo.reset()
    run_threaded(2, _train_compiled_replicate)


class _PlainAllGather(fsdp2.AllGather):
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(tuple(size), dtype=dtype, device=device)

    def __call__(self, output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool = False) -> Any:
        return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)


def _untraceable_reasons() -> None:
    """Each setting the whole-model compiled path does not trace is named, with its module."""

    def reason(setup: Any, *, several: bool = False) -> str | None:
        model = broadcast_module_(_model())
        if several:
            fsdp2.fully_shard([model[0], model[1]])
        else:
            for block in model[:3]:
                fsdp2.fully_shard(block)
        fsdp2.fully_shard(model)
        setup(model)
        state = fsdp2_state(model)
        return _compiled.untraceable([state, *state.descendants])

    assert reason(lambda m: None) is None
    cases = {
        "module '1': gradient sync": lambda m: m[1].set_requires_gradient_sync(False, recurse=False),
        "module '<root>': a gradient divide factor": lambda m: m.set_gradient_divide_factor(3.0),
        "module '2': a gradient divide factor or sum": lambda m: m[2].set_force_sum_reduction_for_comms(True),
        "module '<root>': deterministic reduction": lambda m: m.set_deterministic_reduction(),
        "reduce-scatter of unused parameters": lambda m: m.set_reduce_scatter_unused_params(True),
        "an all-reduce hook": lambda m: m.set_all_reduce_hook(lambda grad: None),
        "custom collectives": lambda m: m[0].set_custom_all_gather(_PlainAllGather()),
        "its parameters are unsharded (call model.reshard() first)": lambda m: m.unshard(),
    }
    for expected, setup in cases.items():
        got = reason(setup)
        assert got is not None, expected
        assert expected in got, (expected, got)
    several = reason(lambda m: None, several=True)
    assert several is not None
    assert "modules '0', '1': fully_shard([...])" in several, several


def test_untraceable_names_each_setting_and_module() -> None:
    run_threaded(2, _untraceable_reasons)


def test_untraceable_names_a_torch_too_old(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled path is tested on torch 2.11 and 2.13: on older torch fullgraph=True names the
    torch version instead of failing somewhere inside dynamo."""
    assert _compiled.torch_too_old("2.10.0+cu128")
    assert _compiled.torch_too_old("1.13.1")
    assert not _compiled.torch_too_old("2.11.0+cu130")
    assert not _compiled.torch_too_old("2.13.0+cpu")
    assert not _compiled.torch_too_old("2.14.0a0+git1234")
    assert not _compiled.torch_too_old("3.0.0")
    monkeypatch.setattr(torch, "__version__", "2.10.0+cu128")
    problem = _compiled.untraceable([])
    assert problem == "torch 2.10.0+cu128 is too old for them: whole-model compile needs torch 2.11+"


def _cache_keys() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fsdp2.compile import _compile_fixes

    mesh = init_device_mesh("cpu", (2,))
    uneven = distribute_tensor(torch.ones(3, 4), mesh, [Shard(0)])  # 2 rows on rank 0, 1 on rank 1
    torch_key = _compile_fixes._SPEC_HASHES[0](uneven)  # the same on every rank of a job
    rows = 2 - dist.get_rank()
    assert uneven._stable_hash_for_caching() == f"{torch_key}:({rows}, 4):(4, 1)"


def test_compile_cache_keys_a_dtensor_by_its_local_shape() -> None:
    """Ranks on one host share torch's compile caches: an uneven shard must not load another rank's
    graph (torch 2.13 keys a DTensor by its global spec only; fsdp2 adds the local shape)."""
    run_threaded(2, _cache_keys)
