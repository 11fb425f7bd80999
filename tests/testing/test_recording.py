"""``fsdp2.testing.record_collectives``: a model's FSDP collectives, recorded through the engine.

Threads as ranks. The recorder must see exactly what the backend sees (the backend counter
``count_collectives`` is the reference), change nothing (bucketing stays on, the numbers are
bit-equal to an unrecorded run), give each call's bytes, and put the original collectives back.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2.runtime._state import get_state
from fsdp2.testing import record_collectives
from tests._harness import count_collectives, run_threaded
from tests._training import EXACT, fill_deterministic_

DIM = 8


def _model(n_blocks: int = 4) -> nn.Sequential:
    # The same values in every run and on every rank (threads share torch's global RNG).
    return fill_deterministic_(nn.Sequential(*(nn.Linear(DIM, DIM) for _ in range(n_blocks))))


def _shard(model: nn.Sequential, mesh: object = None) -> nn.Sequential:
    for block in model:
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    return model


def _step(model: nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10 * step + dist.get_rank())
    loss = model(torch.randn(3, DIM, generator=gen)).square().sum()
    loss.backward()
    return loss.detach()


def _recorded_like_the_backend(hsdp: bool) -> tuple[Counter[str], Counter[str], list[int]]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard")) if hsdp else None
    model = _shard(_model(), mesh)
    model.set_bucket_cap_mb(all_gather=1.0)  # all four blocks share one all-gather (HSDP: gathers only)
    _step(model, 0)  # the first step records the execution order the bucket plan needs
    with count_collectives() as backend, record_collectives(model) as log:
        _step(model, 1)
    return +backend, +log, [c.group_size for c in log.calls]


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp", "hsdp"])
def test_recorded_calls_equal_the_backend_and_bucketing_stays_on(hsdp: bool) -> None:
    for backend, recorded, sizes in run_threaded(4, _recorded_like_the_backend, hsdp):
        assert recorded == backend
        # The root owns no parameters. Forward: one bucketed all-gather for the four blocks; backward:
        # one again. Not one per block: bucketing stays on.
        assert recorded["all_gather"] == 2
        assert recorded["reduce_scatter"] == 4
        assert recorded["all_reduce"] == (4 if hsdp else 0)
        assert set(sizes) == ({2} if hsdp else {4})


def _values(record: bool) -> list[torch.Tensor]:
    model = _shard(_model())
    model.set_bucket_cap_mb(all_gather=1.0, reduce_scatter=1.0)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step in range(3):
        if record:
            with record_collectives(model):
                _step(model, step)
        else:
            _step(model, step)
        optim.step()
        optim.zero_grad()
    return [p.full_tensor() for p in model.parameters()]


def test_recording_changes_no_number() -> None:
    plain = run_threaded(2, _values, False)
    recorded = run_threaded(2, _values, True)
    for a, b in zip(plain, recorded, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, **EXACT)


def _comms(module: nn.Module) -> object:
    state = get_state(module)
    assert state is not None
    return state.groups[0].comms


def _bytes_and_undo() -> tuple[list[tuple[str, str, int, int, int]], bool]:
    model = _shard(_model(n_blocks=1))
    originals = copy.copy(_comms(model[0]))
    with record_collectives(model) as log:
        _step(model, 0)
    rows = [(c.kind, c.module_fqn, c.input_bytes, c.output_bytes, c.sent_bytes) for c in log.calls]
    after = _comms(model[0])
    restored = after.all_gather is originals.all_gather and after.reduce_scatter is originals.reduce_scatter
    return rows, restored


def test_bytes_per_call_and_originals_put_back() -> None:
    # One Linear(8, 8) block at world 2: 72 elements, 36 per rank (fp32: 144 bytes per rank). Each
    # reduce-scatter row also carries one usage element per parameter (2 here; see fsdp2/group/_usage.py).
    for rows, restored in run_threaded(2, _bytes_and_undo):
        assert restored
        shard = 36 * 4
        assert rows == [
            ("all_gather", "0", shard, 2 * shard, shard),  # sends its block to the other rank
            ("all_gather", "0", shard, 2 * shard, shard),  # re-gathered for backward
            ("reduce_scatter", "0", 2 * (shard + 8), shard + 8, shard + 8),  # the other rank's half
        ]


def test_a_model_without_fully_shard_is_refused() -> None:
    match = r"no fully_shard module in its tree; pass the sharded model"
    with pytest.raises(ValueError, match=match), record_collectives(nn.Linear(2, 2)):
        pass
