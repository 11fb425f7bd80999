"""Debug mode's divergence guard in real gloo processes (4 ranks), faults seeded per rank.

Four ranks, so that a side of each fault can hold several ranks (every rank must still raise the same
text); a world of 2 would run the same faults with one rank a side, which this one shows as well.

Without debug mode each fault below hangs until the process group's timeout or aborts the process
(mismatched buffer sizes in gloo). With it, every rank raises ``fsdp2.DivergenceError`` within 10 s
of the fault, the same text on every rank, naming the module, the iteration, the phase and the ranks
on each side; a rank that leaves training is named by the ranks that waited for it, and every process
exits (the spawner joins them all). Each fault runs on a fresh process group, so the ranks' sequence
numbers start equal again after the previous fault.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import fsdp2
from tests._harness import run_multiprocess
from tests._training import mlp_step, small_sharded_mlp

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

Fault = Callable[[nn.Module, int, int], None]  # (model, rank, world)


def _unshard_on_last(model: nn.Module, rank: int, world: int) -> None:
    if rank == world - 1:
        model[2].unshard()


def _forward_twice_on_0(model: nn.Module, rank: int, world: int) -> None:
    if rank == 0:
        model(torch.ones(2, 4))


def _eval_on_0(model: nn.Module, rank: int, world: int) -> None:
    if rank == 0:
        with torch.no_grad():
            model(torch.ones(2, 4))


def _export_on_0(model: nn.Module, rank: int, world: int) -> None:
    if rank == 0:
        fsdp2.save_full_state_dict(model, "/nonexistent/never-written.safetensors")


def _no_sync_on_1(model: nn.Module, rank: int, world: int) -> None:
    if rank == 1:
        model.set_requires_gradient_sync(False)


def _frozen_on_last(model: nn.Module, rank: int, world: int) -> None:
    if rank == world - 1:
        model[4].weight.requires_grad_(False)


def _micro_batches_differ(model: nn.Module, rank: int, world: int) -> None:
    model.set_requires_gradient_sync(False)
    for _ in range(3 if rank == 1 else 2):
        mlp_step(model, rank)
    model.set_requires_gradient_sync(True)


def _accumulate_more_on_0(model: nn.Module, rank: int, world: int) -> None:
    with fsdp2.accumulate(model):  # the others reduce at its exit while rank 0 runs a third forward
        for _ in range(3 if rank == 0 else 2):
            mlp_step(model, rank)


def _synced_micro_batches_more_on_0(model: nn.Module, rank: int, world: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3 if rank == 0 else 2):  # every micro-batch syncs
        mlp_step(model, rank)
    optimizer.step()  # the others' next forward must not pair with rank 0's third micro-batch
    optimizer.zero_grad()


# (fault, text every rank's error must contain)
FAULTS: list[tuple[Fault, str]] = [
    (_unshard_on_last, "gather module '2' outside forward and backward"),
    (_forward_twice_on_0, "different points of training"),
    (_eval_on_0, "without gradients"),
    (_export_on_0, "ranks [0]: the entry of fsdp2.save_full_state_dict()"),
    (_no_sync_on_1, "Gradient sync differs between ranks"),
    (_frozen_on_last, "Parameter '4.weight' has requires_grad="),
    (_micro_batches_differ, "gradient sync off"),
    (_accumulate_more_on_0, "reduce the gradients of module '0' (a reduce-scatter) outside forward and"),
    (_synced_micro_batches_more_on_0, "ranks [0] are at their 4th forward before any optimizer step, ranks"),
]


def _fault_then_step(fault: Fault, model: nn.Module, rank: int, world: int) -> None:
    fault(model, rank, world)
    mlp_step(model, rank, seed=1)


def _all_faults() -> None:
    fsdp2.set_debug(True, timeout=4.0)
    rank, world = dist.get_rank(), dist.get_world_size()
    for fault, expected in FAULTS:
        group = dist.new_group(backend="gloo")
        model = small_sharded_mlp(DeviceMesh.from_group(group, "cpu"))
        mlp_step(model, rank)
        start = time.monotonic()
        with pytest.raises(fsdp2.DivergenceError) as info:
            _fault_then_step(fault, model, rank, world)
        assert time.monotonic() - start < 10, fault.__name__
        message = str(info.value)
        assert expected in message, (fault.__name__, message)
        everyone: list[str | None] = [None] * world
        dist.all_gather_object(everyone, message)
        assert len(set(everyone)) == 1, (fault.__name__, everyone)  # the same error on every rank

    # The last rank leaves training (its data ran out) and waits at the end of the job.
    group = dist.new_group(backend="gloo")
    model = small_sharded_mlp(DeviceMesh.from_group(group, "cpu"))
    mlp_step(model, rank)
    if rank != world - 1:
        start = time.monotonic()
        with pytest.raises(
            fsdp2.DivergenceError, match=rf"waited 4 s for ranks \[{world - 1}\] at the all-gather"
        ):
            mlp_step(model, rank)
        assert time.monotonic() - start < 10
    dist.barrier()
    fsdp2.set_debug(False)


def test_every_fault_raises_on_every_rank() -> None:
    run_multiprocess(4, _all_faults)
