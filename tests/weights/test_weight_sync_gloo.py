"""``WeightSync`` with a consumer that talks on a second process group: no deadlock (2 gloo processes).

The consumer is what RL frameworks write: rank 0 sends every tensor it receives to another process
over a process group of its own. Here that process is rank 1, on a second gloo group, so a sync
that yields while rank 1 waits inside one of its gathers would hang; both groups have a short
timeout, so a hang fails the test instead. What rank 1 receives must equal the unsharded model's
weights in bf16, bit for bit.

- ``rank=0``: rank 1 iterates through nothing, then receives everything on the second group (it can
  only act after its loop, so every gather must be done before rank 0's first pair).
- ``rank=None``: both ranks get every pair; rank 0 sends each on the second group as it comes and
  rank 1 receives each as it comes (the ranks pass through the buckets in step).

Three buckets each time (a cap of 4 KiB over weights of 1-3 KiB in bf16). With the sync of one
gather per parameter, yielding in between, the ``rank=0`` case timed out (see docs/post-training.md).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import fsdp2
from tests._harness import run_multiprocess

pytestmark = pytest.mark.multiprocess  # spawns gloo processes (conftest: slow, their time limit)

WORLD_SIZE = 2
_TIMEOUT = timedelta(seconds=20)


def _model() -> nn.Module:
    torch.manual_seed(0)  # the same in both processes: the reference is built alike
    return nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 32), nn.Linear(32, 16))


def _two_groups() -> None:
    reference = {name: p.detach().bfloat16() for name, p in _model().named_parameters()}
    trainer = dist.new_group(backend="gloo", timeout=_TIMEOUT)  # the sync's gathers
    engine = dist.new_group(backend="gloo", timeout=_TIMEOUT)  # the consumer's own sends
    mesh = DeviceMesh.from_group(trainer, "cpu")
    model = _model()
    for layer in (model[0], model[2], model[3]):
        fsdp2.fully_shard(layer, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    me = dist.get_rank()
    for receiver in (0, None):
        sync = fsdp2.WeightSync(model, torch.bfloat16, rank=receiver, bucket_mb=4 / 1024)
        received: dict[str, torch.Tensor] = {}
        for name, tensor in sync.updates():
            if me == 0:
                dist.send(tensor, dst=1, group=engine)
            else:  # (only with rank=None: rank 1 gets the pairs too)
                received[name] = torch.empty_like(tensor)
                dist.recv(received[name], src=0, group=engine)
                assert torch.equal(received[name], tensor)
        if me == 1 and receiver == 0:
            for name, full in reference.items():  # what it knows of the model: names and shapes
                received[name] = torch.empty_like(full)
                dist.recv(received[name], src=0, group=engine)
        if me == 1:
            assert list(received) == list(reference)
            for name, full in reference.items():
                assert torch.equal(received[name], full), name


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_consumer_sending_on_another_group_does_not_deadlock() -> None:
    run_multiprocess(WORLD_SIZE, _two_groups)
