"""Peak memory of full-weight export and import (one spawn of 2 gloo processes).

Each rank measures the most tensor bytes held at once by storages allocated while it runs (a dispatch
mode records each new output storage and a weakref callback forgets it when it is freed)

- ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` (rank 0 ends up holding the whole
  model) against ``fsdp2.save_full_state_dict`` (one full tensor at a time);
- ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`` against
  ``fsdp2.load_full_state_dict``.

fsdp2's helpers must stay within the largest group's unsharded bytes on every rank, and the loads
must restore the saved parameters exactly (``broadcast_from_rank0`` needs real gloo, not threads).
"""

from __future__ import annotations

import gc
import os
import tempfile
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fsdp2
from tests._harness import run_multiprocess

pytestmark = pytest.mark.multiprocess  # spawns gloo processes (conftest: slow, their time limit)

pytest.importorskip("safetensors")

WORLD_SIZE = 2
DIM = 256
BLOCKS = 8


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)  # same seed in every process: identical parameters
    model = nn.Sequential(*(nn.Linear(DIM, DIM) for _ in range(BLOCKS)), nn.Linear(DIM, 3))
    for block in list(model)[:BLOCKS]:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    return model


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops allocate while active, held at once (``peak``); views are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.held = 0
        self.peak = 0
        self._live: set[int] = set()

    def _forget(self, key: int, nbytes: int) -> None:
        self._live.discard(key)
        self.held -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(t) for t in tree_flatten((args, kwargs))[0]}
        for tensor in tree_flatten(out)[0]:
            storage = _storage(tensor)
            if storage is None:
                continue
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if storage in inputs or key in self._live or nbytes == 0:
                continue  # a view or in-place result, or already counted
            if self.held + nbytes > self.peak:
                # Storages held only by reference cycles (a collective's bookkeeping) wait for the
                # cyclic collector, whose timing depends on everything else the process allocated:
                # before counting a new peak, collect them, so the peak counts what is reachable
                # (without it, one run in three under a loaded xdist worker counted the previous
                # gathered tensor as still held).
                gc.collect()
            self._live.add(key)
            self.held += nbytes
            self.peak = max(self.peak, self.held)
            weakref.finalize(storage, self._forget, key, nbytes)
        return out


def _storage(value: Any) -> torch.UntypedStorage | None:
    """The storage behind ``value`` (a DTensor's local one); ``None``: no tensor, meta, or no data."""
    if not isinstance(value, torch.Tensor) or value.is_meta:
        return None
    try:
        storage = (value._local_tensor if isinstance(value, DTensor) else value).untyped_storage()
        storage.data_ptr()
    except RuntimeError:  # e.g. a wrapper subclass without data of its own
        return None
    return storage


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: v.full_tensor() if isinstance(v, DTensor) else v.clone() for k, v in model.state_dict().items()
    }


def _measure(directory: str) -> None:
    rank = dist.get_rank()
    model = _model(0)
    expected = _full(model)
    model_bytes = sum(t.numel() * t.element_size() for t in expected.values())
    group_bytes = (DIM * DIM + DIM) * 4  # one block, unsharded: the largest group
    path = os.path.join(directory, "model.safetensors")
    peaks: dict[str, int] = {}

    with _LiveBytes() as live:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    peaks["get_model_state_dict(full, cpu_offload)"] = live.peak
    with _LiveBytes() as live:
        fsdp2.save_full_state_dict(model, path)
    peaks["fsdp2.save_full_state_dict"] = live.peak

    target = _model(1)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    with _LiveBytes() as live:
        set_model_state_dict(target, full, options=options)
    peaks["set_model_state_dict(full, broadcast_from_rank0)"] = live.peak
    torch.testing.assert_close(_full(target), expected, rtol=0, atol=0)

    target = _model(2)
    with _LiveBytes() as live:
        fsdp2.load_full_state_dict(target, path)
    peaks["fsdp2.load_full_state_dict"] = live.peak
    torch.testing.assert_close(_full(target), expected, rtol=0, atol=0)

    print(f"[rank {rank}] model {model_bytes} B, largest group {group_bytes} B, peaks {peaks}", flush=True)
    assert peaks["fsdp2.save_full_state_dict"] <= group_bytes, peaks
    assert peaks["fsdp2.load_full_state_dict"] <= group_bytes, peaks
    if rank == 0:  # torch's full gather holds the whole model on rank 0
        assert peaks["get_model_state_dict(full, cpu_offload)"] >= model_bytes, peaks


@pytest.mark.multiprocess
def test_full_weight_export_import_peak_memory() -> None:
    with tempfile.TemporaryDirectory() as directory:
        run_multiprocess(WORLD_SIZE, _measure, directory)
