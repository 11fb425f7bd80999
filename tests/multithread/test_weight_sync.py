"""``fsdp2.WeightSync``: a plain "inference" copy kept equal to the trainer's weights, in bf16.

The reference is the trainer itself: after every sync the consumer's parameters equal the trainer's
full parameters cast to bf16, bit for bit, whatever mix of dense and sparse updates arrived. The
trainer is a plain fp32 model sharded with fsdp2 and trained with a small learning rate, so most bf16
values stay put between steps and the changed-only updates are sparse.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from tests._harness import run_threaded


def _model() -> nn.Module:
    torch.manual_seed(0)  # built once, in the main thread
    model = nn.Sequential(nn.Embedding(40, 16), nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 40))
    model[1].weight.requires_grad_(False)  # a frozen weight: sent once
    return model


def _load(consumer: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """What an inference engine's ``load_weights`` does with one pair (dense, or sparse values)."""
    target = consumer.get_parameter(name)
    with torch.no_grad():
        if tensor.is_sparse:
            target[tuple(tensor.indices())] = tensor.values()  # coalesced
        else:
            target.copy_(tensor)


def _sync_steps(base: nn.Module, hsdp: bool, only_rank0: bool) -> list[tuple[list[str], list[bool], int]]:
    world = dist.get_world_size()
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    model = copy.deepcopy(base)
    for layer in (model[0], model[1], model[3]):
        fsdp2.fully_shard(layer, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    consumer = copy.deepcopy(base).bfloat16()
    with torch.no_grad():
        for param in consumer.parameters():
            param.zero_()  # it learns everything from the sync
    optim = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sync = fsdp2.WeightSync(model, torch.bfloat16, rank=0 if only_rank0 else None)
    receives = not only_rank0 or dist.get_rank() == 0
    names = [name for name, _ in model.named_parameters()]
    calls = []
    for step in range(3):
        if step:
            tokens = torch.tensor([[step, 2 * step, 3]]) + dist.get_rank()  # a few embedding rows
            model(tokens).sum().backward()
            optim.step()
            optim.zero_grad()
        received = list(sync.updates())
        for name, tensor in received:
            _load(consumer, name, tensor)
        calls.append(([n for n, _ in received], [t.is_sparse for _, t in received], sync.bytes_sent))
        fulls = [param.full_tensor().bfloat16() for param in model.parameters()]  # every rank gathers
        if receives:
            for name, plain, full in zip(names, consumer.parameters(), fulls, strict=True):
                assert torch.equal(plain, full), f"step {step}: {name}"
        else:
            assert received == []
            assert sync.bytes_sent == 0
    return calls


@pytest.mark.parametrize(("world", "hsdp"), [(2, False), (4, True)], ids=["fsdp", "hsdp"])
def test_the_consumer_equals_the_trainer_after_every_sync(world: int, hsdp: bool) -> None:
    base = _model()
    names = [name for name, _ in base.named_parameters()]
    dense_bytes = sum(p.numel() * 2 for p in base.parameters())
    for calls in run_threaded(world, _sync_steps, base, hsdp, False):
        first, second, _ = calls
        assert first[0] == names  # the plain model's names, every parameter
        assert not any(first[1])
        assert first[2] == dense_bytes
        assert "1.weight" not in second[0]  # frozen: sent once
        assert "0.weight" in second[0]  # embedding rows changed: sparse
        assert second[1][second[0].index("0.weight")]
        sizes = dict((name, p.numel() * 2) for name, p in base.named_parameters())
        assert second[2] < sum(sizes[name] for name in second[0])  # the sparse ones cost less


def test_one_receiving_rank_and_the_others_take_part() -> None:
    run_threaded(2, _sync_steps, _model(), False, True)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(TypeError, match=r"nn\.Module"):
        fsdp2.WeightSync(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dtype"):
        fsdp2.WeightSync(nn.Linear(2, 2), "bfloat16")  # type: ignore[arg-type]
    for dtype in (torch.int8, torch.bool, torch.float8_e4m3fn, torch.complex64):
        with pytest.raises(ValueError, match=f"cannot send weights as {dtype}"):
            fsdp2.WeightSync(nn.Linear(2, 2), dtype)
    for rank in (1, -1, True, "0"):  # no process group: the one process is rank 0
        with pytest.raises(ValueError, match="rank must be None"):
            fsdp2.WeightSync(nn.Linear(2, 2), rank=rank)  # type: ignore[arg-type]
    fsdp2.WeightSync(nn.Linear(2, 2), torch.float16, rank=0)


def _rank_out_of_range() -> None:
    model = fsdp2.fully_shard(nn.Linear(4, 4))
    for rank in (2, 5, -1):
        with pytest.raises(ValueError, match=r"a rank of this job, 0 to 1; got"):
            fsdp2.WeightSync(model, rank=rank)


def test_a_rank_outside_the_job_is_refused() -> None:
    run_threaded(2, _rank_out_of_range)
