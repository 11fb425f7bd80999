"""``fsdp2.replicate``: torch 2.13's FSDP-based ``replicate`` on fsdp2's engine, threads as ranks (world 2).

Two references on the same per-rank inputs: the unsharded model with gradients averaged over ranks,
and torch's own ``torch.distributed._composable.replicate_with_fsdp.replicate`` (with torch's
``fully_shard`` where a model mixes the two). Losses, gradients and parameters equal both bit for bit
over 3 AdamW steps (mixed precision: torch's, bit for bit; the float32 reference is not), for one
group per block, for replicated embeddings with sharded blocks, and for torchtitan's DDP pattern
before 0.3.0 (embeddings, each block, ``[norm, output]`` as one group, the root). Also checked:
the placements and meshes of the parameters (torch's), the classes ``isinstance`` sees, one all-reduce
per group per backward and no all-gather, accumulation without sync (gradient sync or all-reduce
off), the gradient divide factor, ignored parameters, activation checkpointing, deep copy, the state
dict and a DCP checkpoint saved at world 2 and loaded at world 1 and 2, and the refusals (with
torch's exception types where torch refuses the same call).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import ReplicateModule as TorchReplicateModule
from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate

import fsdp2
from fsdp2.testing import count_collectives
from tests._harness import run_threaded
from tests._training import average_grads, seeded
from tests.models import ModelArgs, Transformer, make_tokens
from tests.shared.replicate_layouts import (
    ARGS,
    LAYOUTS,
    STEPS,
    assert_same,
    full,
    mixed,
    per_block,
    train_three,
)


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_trains_like_torch_replicate_and_the_reference(layout: str) -> None:
    run_threaded(2, train_three, layout, False)


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mixed_precision_matches_torch(layout: str) -> None:
    run_threaded(2, train_three, layout, True)


def test_activation_checkpointing() -> None:
    """Each block's forward is re-run in backward (non-reentrant ``checkpoint``)."""
    run_threaded(2, train_three, "mixed", False, ModelArgs(n_layers=2, checkpoint_activations=True))


def _classes_and_placements() -> None:
    model = seeded(lambda: Transformer(ARGS))
    returned = fsdp2.replicate(model.layers[0])
    assert returned is model.layers[0]
    fsdp2.replicate([model.norm, model.output], offload_policy=fsdp2.CPUOffloadPolicy(pin_memory=False))
    fsdp2.replicate(model)
    for module in (model, model.layers[0], model.norm, model.output):
        assert type(module).__name__ == "Replicate" + type(module).__mro__[5].__name__
        for cls in (fsdp2.ReplicateModule, fsdp2.FSDPModule, TorchReplicateModule, TorchFSDPModule):
            assert isinstance(module, cls), (type(module), cls)
        assert fsdp2.replicate.state(module) is not None
    assert fsdp2.replicate.state(model.layers[1]) is None
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        assert param.placements == (Replicate(),), name
        assert param.device_mesh.mesh_dim_names == ("replicate",), name
        assert param.to_local().shape == param.shape, name
    # torch's pipelining reads the state through torch's replicate.state
    assert torch_replicate.state(model) is fsdp2.replicate.state(model)
    model(make_tokens(ARGS, dist.get_rank())).sum().backward()
    assert all(
        isinstance(p.grad, DTensor) and p.grad.placements == (Replicate(),) for p in model.parameters()
    )


def test_classes_placements_and_state() -> None:
    run_threaded(2, _classes_and_placements)


def _accumulate(mode: str) -> None:
    """Two microbatches, the first not synced: the synced backward reduces their sum.

    ``no_sync``: ``set_requires_gradient_sync(False)``; ``divide_by_one``: the same with torchtitan's
    "no gradient division" (divide factor 1: the sum over ranks); ``no_all_reduce``:
    ``set_requires_all_reduce(False)`` (also torch's numbers, checked by hand).
    """
    base = seeded(lambda: Transformer(ARGS))
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    per_block(fsdp2.replicate, None, model)
    if mode == "divide_by_one":
        for module in model.modules():
            if isinstance(module, fsdp2.FSDPModule):
                module.set_gradient_divide_factor(1.0)
    rank = dist.get_rank()
    for micro in range(2):
        if mode == "no_all_reduce":
            model.set_requires_all_reduce(micro == 1)
        else:
            model.set_requires_gradient_sync(micro == 1)
        tokens = make_tokens(ARGS, rank + 10 * micro)
        with count_collectives() as counts:
            model(tokens).sum().backward()
        ref(tokens).sum().backward()
        if micro == 0:
            assert counts["all_reduce"] == 0, dict(counts)
    for param in ref.parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM if mode == "divide_by_one" else dist.ReduceOp.AVG)
    assert_same(model, ref, grads=True)


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("mode", ["no_sync", "divide_by_one", "no_all_reduce"])
def test_accumulation_without_sync(mode: str) -> None:
    run_threaded(2, _accumulate, mode)


def _ignored() -> None:
    base = seeded(lambda: Transformer(ARGS))
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    fsdp2.replicate(model, ignored_params={model.output.weight})
    assert not isinstance(model.output.weight, DTensor)
    tokens = make_tokens(ARGS, dist.get_rank())
    model(tokens).sum().backward()
    ref(tokens).sum().backward()
    average_grads(ref, skip={"output.weight"})  # an ignored parameter keeps its local gradient
    assert_same(model, ref, grads=True)


def test_ignored_params_keep_local_gradients() -> None:
    run_threaded(2, _ignored)


def _deep_copy() -> None:
    model = seeded(lambda: Transformer(ARGS))
    mixed(fsdp2.replicate, fsdp2.fully_shard, model)
    clone = copy.deepcopy(model)
    assert isinstance(clone.tok_embeddings, fsdp2.ReplicateModule)
    assert not isinstance(clone.layers[0], fsdp2.ReplicateModule)
    assert_same(clone, model, grads=False)
    tokens = make_tokens(ARGS, dist.get_rank())
    for m in (model, clone):
        m(tokens).sum().backward()
    assert_same(clone, model, grads=True)


def test_deep_copy_replicates_the_copy() -> None:
    run_threaded(2, _deep_copy)


# ---- bucketing: consecutive replicate groups share one all-reduce --------------------------------


def _bucketed(mode: str) -> None:
    """``set_bucket_cap_mb``: one all-reduce per backward for every replicate group, torch's numbers.

    ``plain``: per-block groups; ``no_all_reduce``: two micro-batches, the first with all-reduce off
    (each group's held sum joins the shared all-reduce); ``bf16``: bf16 compute, fp32 reduction;
    ``mixed``: replicated embeddings and sharded blocks (the all-reduce stays its own, the blocks'
    reduce-scatters share one). Compared with torch's ``replicate`` (and ``fully_shard``), bit for bit.
    """
    base = seeded(lambda: Transformer(ARGS))
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    layout = mixed if mode == "mixed" else per_block
    dtypes = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if mode == "bf16" else {}
    layout(fsdp2.replicate, fsdp2.fully_shard, ours, mp_policy=fsdp2.MixedPrecisionPolicy(**dtypes))
    layout(torch_replicate, torch_fully_shard, theirs, mp_policy=TorchMixedPrecisionPolicy(**dtypes))
    ours.set_bucket_cap_mb(reduce_scatter=25.0)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    micros = 2 if mode == "no_all_reduce" else 1
    for step in range(STEPS):
        for micro in range(micros):
            last = micro == micros - 1
            for model in (ours, theirs):
                model.set_requires_all_reduce(last)
            tokens = make_tokens(ARGS, dist.get_rank() + 10 * step + 100 * micro)
            with count_collectives() as counts:
                loss = ours(tokens).sum()
                loss.backward()
            their_loss = theirs(tokens).sum()
            their_loss.backward()
            assert torch.equal(loss, their_loss), (step, micro)
            if step > 0:  # (the first backward also agrees on which parameters are used)
                expected = {"all_reduce": 1 if last else 0}
                if mode == "mixed":
                    expected["reduce_scatter"] = 1
                    expected["all_gather"] = 5 if last else 0  # the blocks regather in backward
                assert {k: v for k, v in counts.items() if v} == {k: v for k, v in expected.items() if v}, (
                    dict(counts),
                    expected,
                )
        assert_same(ours, theirs, grads=True)
        for optim in optims:
            optim.step()
            optim.zero_grad()
    assert_same(ours, theirs, grads=False)


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("mode", ["plain", "no_all_reduce", "bf16", "mixed"])
def test_bucketed_all_reduces_match_torch(mode: str) -> None:
    run_threaded(2, _bucketed, mode)


# ---- checkpoints: replicated DTensors are saved once and load at any world size ------------------


def _trained() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    model = seeded(lambda: Transformer(ARGS))
    per_block(fsdp2.replicate, None, model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        model(make_tokens(ARGS, dist.get_rank() + 10 * step)).sum().backward()
        optim.step()
        optim.zero_grad()
    return model, {k: full(v).clone() for k, v in model.state_dict().items()}


def _save(path: str, out: dict[str, torch.Tensor]) -> None:
    model, state = _trained()
    assert all(isinstance(v, DTensor) and v.placements == (Replicate(),) for v in model.state_dict().values())
    dcp.save(model.state_dict(), checkpoint_id=path)
    if dist.get_rank() == 0:
        out.update(state)


def _load(path: str, expected: dict[str, torch.Tensor]) -> None:
    model = Transformer(ARGS)  # other values: overwritten by the load
    per_block(fsdp2.replicate, None, model)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(full(value), expected[key], rtol=0, atol=0, msg=key)


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("load_world", [1, 2])
def test_dcp_saved_at_two_ranks_loads_at_any_world(load_world: int, tmp_path: Path) -> None:
    expected: dict[str, torch.Tensor] = {}
    run_threaded(2, _save, str(tmp_path / "ckpt"), expected)
    run_threaded(load_world, _load, str(tmp_path / "ckpt"), expected)


# ---- refusals --------------------------------------------------------------------------------------


def _refusals(impl: str) -> None:
    replicate = fsdp2.replicate if impl == "fsdp2" else torch_replicate
    fully_shard = fsdp2.fully_shard if impl == "fsdp2" else torch_fully_shard
    model = seeded(lambda: Transformer(ARGS))
    replicate(model.layers[0])
    with pytest.raises(AssertionError):  # torch's contract refuses a second call
        replicate(model.layers[0])
    fully_shard(model.layers[1])
    with pytest.raises(RuntimeError, match=r"(?i)already managed by .?fully_shard"):
        replicate(model.layers[1])
    mesh_2d = init_device_mesh("cpu", (1, 2), mesh_dim_names=(f"{impl}_a", f"{impl}_b"))
    with pytest.raises(ValueError, match=r"1-?D"):
        replicate(model.norm, mesh=mesh_2d)
    dims = (fsdp2.DataParallelMeshDims if impl == "fsdp2" else torch_dims())(shard=f"{impl}_b")
    # (torch's registers the module before these checks: a fresh module each)
    with pytest.raises(ValueError, match=r"replicate"):
        replicate(model.output, mesh=mesh_2d, dp_mesh_dims=dims)
    with pytest.raises(ValueError, match=r"containers" if impl == "torch" else r"ModuleList"):
        replicate(model.layers)
    assert not isinstance(model.norm.weight, DTensor)  # nothing changed by the failed calls
    assert not isinstance(model.output.weight, DTensor)
    if impl == "fsdp2":
        with pytest.raises(ValueError, match=r"already managed by replicate"):
            fsdp2.fully_shard(model.layers[0])
        with pytest.raises(TypeError, match=r"replicate expects an nn.Module"):
            fsdp2.replicate("model")  # type: ignore[call-overload]
        other = seeded(lambda: Transformer(ARGS))
        torch_replicate(other.layers[0])
        with pytest.raises(ValueError, match=r"torch's replicate"):
            fsdp2.replicate(other.layers[0])
        with pytest.raises(ValueError, match=r"cannot mix"):
            fsdp2.replicate(other)


def torch_dims() -> Any:
    from torch.distributed.fsdp import DataParallelMeshDims

    return DataParallelMeshDims


@pytest.mark.parametrize("impl", ["fsdp2", "torch"])
def test_refusals_match_torch(impl: str) -> None:
    run_threaded(2, _refusals, impl)
