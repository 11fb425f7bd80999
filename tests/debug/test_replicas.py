"""``fsdp2.check_replicas``: HSDP replicas compared bit for bit after training, one flipped bit found.

The reference is the replicas themselves: after identical training they agree (``None`` on every
rank); after one bit of one parameter's shard flips on one replica, every rank raises, naming that
parameter and the replica that differs.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from tests._harness import run_threaded


def _base() -> nn.Sequential:
    torch.manual_seed(0)  # built once, in the main thread
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4))


def _flip_one_bit(tensor: torch.Tensor) -> None:
    with torch.no_grad():
        tensor.view(-1).view(torch.int32)[3] ^= 1 << 7


def _sharded(base: nn.Module, replicas: int) -> tuple[nn.Module, Any]:
    """``base`` sharded on a (replicas, rest) HSDP mesh, its first block a group of its own."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
    model = copy.deepcopy(base)
    fsdp2.fully_shard(model[0], mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    return model, mesh


def _step(model: nn.Module, shard_rank: int, step: int) -> None:
    """Forward and backward of this shard's batch (the replicas of a shard see the same)."""
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * shard_rank + step))
    model(x).pow(2).sum().backward()


def _check(base: nn.Module, replicas: int, flip_on: int | None) -> str:
    model, mesh = _sharded(base, replicas)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    shard_rank = mesh.get_local_rank("shard")
    for step in range(2):
        _step(model, shard_rank, step)
        optim.step()
        optim.zero_grad()
    assert fsdp2.check_replicas(model) is None
    if flip_on is None:
        return ""
    if mesh.get_local_rank("replicate") == flip_on and shard_rank == 0:
        _flip_one_bit(model[0].weight.to_local())
    with pytest.raises(RuntimeError, match="check_replicas: parameters differ") as error:
        fsdp2.check_replicas(model)
    return str(error.value)


def test_replicas_agree_after_training_and_a_flipped_bit_is_named_on_every_rank() -> None:
    messages = run_threaded(4, _check, _base(), 2, 1)
    assert len(set(messages)) == 1  # the same error on every rank
    assert "0.weight: replicas [0, 1] do not agree (no majority) on mesh dim 'replicate'" in messages[0]
    assert "2.weight" not in messages[0]


def test_with_three_replicas_the_odd_one_is_named() -> None:
    messages = run_threaded(3, _check, _base(), 3, 2)
    assert "0.weight: replica(s) [2] differ from the other 2 on mesh dim 'replicate'" in messages[0]


def _uneven() -> nn.Sequential:
    """Odd sizes: ``2.weight``'s shards are 3 and 2 rows of 9, so ``2.bias``'s shard starts 108 bytes into
    the root's packed buffer on shard rank 0 (not a whole number of 64-bit words)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 5))


def test_uneven_shards_at_unaligned_offsets_are_compared() -> None:
    messages = run_threaded(4, _check, _uneven(), 2, 1)
    assert len(set(messages)) == 1
    assert "0.weight: replicas [0, 1] do not agree (no majority) on mesh dim 'replicate'" in messages[0]
    assert "0.bias" not in messages[0]


def test_without_replicas_or_a_process_group_there_is_nothing_to_compare() -> None:
    assert fsdp2.check_replicas(_base()) is None  # no process group, plain parameters
    run_threaded(2, _check, _base(), 1, None)  # FSDP only: no replicated dim


def _debug_mode_checks_every_two_steps(base: nn.Module) -> str:
    model, mesh = _sharded(base, 2)
    optim = torch.optim.SGD(model.parameters(), lr=1e-2)
    shard_rank = mesh.get_local_rank("shard")
    for step in range(4):
        _step(model, shard_rank, step)
        if step == 2 and mesh.get_local_rank("replicate") == 1 and shard_rank == 1:
            _flip_one_bit(model[2].weight.to_local())
        try:
            optim.step()  # the step counter's post-step hook compares the replicas at steps 2 and 4
        except RuntimeError as error:
            return f"step {step}: {error}"
        optim.zero_grad()
    return "never raised"


def test_debug_mode_compares_the_replicas_every_n_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp2.trace import _debug

    monkeypatch.setattr(_debug._Settings, "replicas_every", 2)
    fsdp2.set_debug(True)
    try:
        messages = run_threaded(4, _debug_mode_checks_every_two_steps, _base())
    finally:
        fsdp2.set_debug(False)
    for message in messages:
        assert message.startswith("step 3: check_replicas: parameters differ"), message
        assert "2.weight: replicas [0, 1] do not agree" in message
