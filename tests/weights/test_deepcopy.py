"""``copy.deepcopy`` of fsdp2 models, and EMA copies (``torch.optim.swa_utils.AveragedModel``).

A deep copy is an independent sharded model on the same mesh: same class, placements and forward;
training the original does not change it, and it trains on its own like the unsharded reference.
An EMA of the sharded weights equals the EMA of the unsharded model. Refused mid-iteration and for
all-gather-extension weights, with clear errors.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import fsdp2
from fsdp2.testing import run_ranks
from tests.models import ModelArgs, Transformer, make_tokens

ARGS = ModelArgs(n_layers=2)


def _sharded(base: nn.Module, **kwargs: object) -> nn.Module:
    model = copy.deepcopy(base)  # a plain deepcopy (before sharding)
    for block in model.layers:
        fsdp2.fully_shard(block, **kwargs)
    fsdp2.fully_shard(model, **kwargs)
    return model


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full values; after a forward without backward the root's parameters are still unsharded."""
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def _independent_copy(rank: int, world_size: int, base: nn.Module) -> None:
    model = _sharded(base, mp_policy=fsdp2.MixedPrecisionPolicy(reduce_dtype=torch.float32))
    model.layers[1].set_requires_gradient_sync(True)
    tokens = make_tokens(ARGS, rank)
    model(tokens).sum().backward()  # a trained-on state (lazy init done, grads present)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optim.step()
    optim.zero_grad()
    twin = copy.deepcopy(model)
    assert type(twin) is type(model)
    assert isinstance(twin.layers[0], fsdp2.FSDPModule)
    for (name, p), q in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert isinstance(q[1], DTensor), name
        assert q[1].placements == p.placements
        assert q[1].device_mesh == p.device_mesh
        assert q[1].to_local().data_ptr() != p.to_local().data_ptr()  # its own storage
    torch.testing.assert_close(twin(tokens), model(tokens), rtol=0, atol=0)
    for m in (twin, model):  # a forward without backward leaves the root unsharded: optimizers want shards
        m.reshard()
    before = _full(twin)
    for step in range(2):  # training the original leaves the copy as it was
        model(make_tokens(ARGS, rank + step)).sum().backward()
        optim.step()
        optim.zero_grad()
    after = _full(twin)
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0, msg=name)
    # The copy trains on its own, like an unsharded model with the same weights.
    ref = copy.deepcopy(base)
    ref.load_state_dict({k: v for k, v in after.items()})
    twin_optim = torch.optim.SGD(twin.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = make_tokens(ARGS, 10 + rank)
    loss, ref_loss = twin(x).sum(), ref(x).sum()
    torch.testing.assert_close(loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    for p in ref.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    twin_optim.step()
    ref_optim.step()
    for name, value in _full(twin).items():
        torch.testing.assert_close(value, dict(ref.named_parameters())[name], msg=name)


def test_deepcopy_is_an_independent_sharded_model() -> None:
    torch.manual_seed(0)
    run_ranks(2, _independent_copy, Transformer(ARGS))


def _ema(rank: int, world_size: int, base: nn.Module) -> None:
    model = _sharded(base)
    ref = copy.deepcopy(base)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ref_ema = AveragedModel(ref, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        tokens = make_tokens(ARGS, 100 * step + rank)
        model(tokens).sum().backward()
        ref(tokens).sum().backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        for o in (optim, ref_optim):
            o.step()
            o.zero_grad()
        ema.update_parameters(model)
        ref_ema.update_parameters(ref)
    for (name, p), q in zip(ema.module.named_parameters(), ref_ema.module.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q, msg=name)
    tokens = make_tokens(ARGS, rank)
    torch.testing.assert_close(ema(tokens), ref_ema(tokens))


def test_ema_of_sharded_weights_equals_ema_of_unsharded() -> None:
    torch.manual_seed(0)
    run_ranks(2, _ema, Transformer(ARGS))


def _tp_copy(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fsdp2.fully_shard(model, mesh=mesh["dp"])
    twin = copy.deepcopy(model)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(mesh.get_local_rank("dp")))
    torch.testing.assert_close(twin(x), model(x), rtol=0, atol=0)
    assert twin[0].weight.placements == model[0].weight.placements


def test_deepcopy_of_a_tensor_parallel_model() -> None:
    run_ranks(4, _tp_copy)


def _refused_mid_iteration(rank: int, world_size: int) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fsdp2.fully_shard(model[0])
    fsdp2.fully_shard(model)

    def copy_in_forward(module: nn.Module, args: object, output: torch.Tensor) -> None:
        with pytest.raises(
            RuntimeError, match=r"copy.deepcopy of FSDPSequential during a forward or backward"
        ):
            copy.deepcopy(model)

    handle = model[0].register_forward_hook(copy_in_forward)
    model(torch.ones(1, 4)).sum().backward()
    handle.remove()
    copy.deepcopy(model)(torch.ones(1, 4))  # between steps it works


def test_deepcopy_is_refused_mid_iteration() -> None:
    run_ranks(2, _refused_mid_iteration)
