"""``fsdp2.ShardedCheckpointer`` / ``fsdp2.save_sharded``: DCP checkpoints planned from the layout alone.

- model and AdamW state saved at 4 ranks (synchronously, and in the background within a staging budget)
  load with torch's ``dcp.load`` at 4, 2 and 1 ranks into fsdp2 and at 2 into torch's ``fully_shard``,
  equal to the saved values exactly, and the next step equals an unsharded reference;
- the files hold the same entries as ``dcp.save``'s (keys, shapes, dtypes, chunks);
- an async save never holds more than its budget in staged copies, and returns before writing; a
  second one reuses the staging buffers and saves the new values;
- staged in the background, it returns before the shards are copied and the next optimizer step waits
  for the copy: the file holds the values of the call, though the step ran right after it; a copy
  that fails raises on every rank at ``wait()``;
- HSDP: only the first replica writes; every slot holds ``torch.save``'s output of its chunk;
- ``_StridedShard`` layouts (FSDP over tensor parallelism with uneven rows, experts over ``ep``) give
  ``dcp.save``'s entries, and ``dcp.load`` and ``fsdp2.load_sharded`` read back the values saved;
- a failed write leaves no ``.metadata`` and raises on every rank; bad input raises before any file.
"""

from __future__ import annotations

import io
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import fsdp2
from fsdp2.weights._flat_layout import slot_bytes
from fsdp2.weights._staged_writer import StagedWriter
from tests._harness import run_threaded
from tests._training import fill_deterministic_, seeded
from tests.shared.checkpoint_net import Net, adamw, dcp_load, shard, snapshot, train


def _state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}


def _save(path: str, mode: str, out: dict[str, Any]) -> None:
    model = shard(seeded(Net))
    optim = adamw(model)
    train(model, optim, range(2))
    state = _state(model, optim)
    saved = snapshot(model, optim)
    if mode == "sync":
        fsdp2.save_sharded(state, path)
    else:
        saver = fsdp2.ShardedCheckpointer(staging_bytes=256)
        pending = saver.save_async(state, path)
        assert not (Path(path) / ".metadata").exists()  # written only at wait()
        train(model, optim, range(2, 3))  # the caller may change the tensors once save_async returned
        pending.wait()
        largest = max(v.to_local().nbytes for v in state["model"].values() if isinstance(v, DTensor))
        assert pending.peak_staged_bytes <= max(256, largest)
        # a second save reuses the staging buffers the first one returned, and saves the new values
        again = saver.save_async(_state(model, optim), path + "-2")
        later = snapshot(model, optim)
        again.wait()
        if dist.get_rank() == 0:
            out["later"] = later
    if dist.get_rank() == 0:
        out["saved"] = saved


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_saved_at_4_loads_with_dcp_at_4_2_1_and_into_torch(mode: str, tmp_path: Path) -> None:
    expected: dict[str, Any] = {}
    path = str(tmp_path / "ckpt")
    run_threaded(4, _save, path, mode, expected)
    for world, impl in [(2, "fsdp2"), (1, "fsdp2"), (2, "torch")] if mode == "sync" else [(4, "fsdp2")]:
        run_threaded(world, dcp_load, impl, path, expected["saved"])
    if mode == "async":
        run_threaded(2, dcp_load, "fsdp2", path + "-2", expected["later"])


class _SlowStager:
    """``StagedWriter.put`` on the staging thread: held until released, then slow (a racing step wins)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_on: str = "") -> None:
        self.released: dict[str, threading.Event] = {}
        self.fail_on = fail_on
        put = StagedWriter.put

        def held_put(writer: StagedWriter, item: Any, tensor: torch.Tensor, *, stage: bool) -> None:
            if threading.current_thread().name == "fsdp2-checkpoint-stager":
                assert self.release_for(writer.path.name).wait(timeout=60)
                time.sleep(0.01)
                if self.fail_on and item.key == self.fail_on:
                    raise RuntimeError("out of pinned memory")
            put(writer, item, tensor, stage=stage)

        monkeypatch.setattr(StagedWriter, "put", held_put)

    def release_for(self, file_name: str) -> threading.Event:
        return self.released.setdefault(file_name, threading.Event())


def _save_in_background(path: str, stager: _SlowStager, out: dict[str, Any]) -> None:
    model = shard(seeded(Net))
    optim = adamw(model)
    train(model, optim, range(2))
    saver = fsdp2.ShardedCheckpointer(staging_bytes=256)
    pending = saver.save_async(_state(model, optim), path, stage_in_background=True)
    saved = snapshot(model, optim)
    assert not pending.staged()  # the call returned before copying the shards
    stager.release_for(f"__{dist.get_rank()}_0.distcp").set()
    train(model, optim, range(2, 3))  # the step waits for the copy
    assert pending.staged()
    pending.wait()
    assert not torch.equal(snapshot(model, optim)["model"]["head.weight"], saved["model"]["head.weight"])
    if dist.get_rank() == 0:
        out.update(saved)


@pytest.mark.first_case_in_quick_loop
def test_background_staging_saves_the_values_of_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected: dict[str, Any] = {}
    path = str(tmp_path / "ckpt")
    run_threaded(2, _save_in_background, path, _SlowStager(monkeypatch), expected)
    run_threaded(2, dcp_load, "fsdp2", path, expected)


def _failed_staging(path: str, stager: _SlowStager) -> None:
    model = shard(seeded(Net))
    pending = fsdp2.ShardedCheckpointer().save_async(
        {"model": get_model_state_dict(model)}, path, stage_in_background=True
    )
    stager.release_for(f"__{dist.get_rank()}_0.distcp").set()
    with pytest.raises(OSError, match=r"staging 'model\.head\.weight' failed: RuntimeError: out of pinned"):
        pending.wait()
    assert not (Path(path) / ".metadata").exists()


def test_a_failed_background_copy_raises_everywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_threaded(
        2, _failed_staging, str(tmp_path / "ckpt"), _SlowStager(monkeypatch, fail_on="model.head.weight")
    )


def _save_hsdp(path: str, out: dict[str, Any]) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = seeded(Net)
    for block in model.blocks:
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    optim = adamw(model)
    train(model, optim, range(2))
    assert get_model_state_dict(model)["head.weight"].placements == (Replicate(), Shard(0))
    fsdp2.save_sharded(_state(model, optim), path)
    saved = snapshot(model, optim)
    if dist.get_rank() == 0:
        out.update(saved)


@pytest.mark.slow  # multi-rank and costly: the whole suite runs it, the quick loop leaves it
def test_hsdp_first_replica_writes_and_loads_at_2(tmp_path: Path) -> None:
    """(2 replicas, 2 shards): only replica 0's ranks write chunks; dcp.load at 2 (plain FSDP) reads them."""
    expected: dict[str, Any] = {}
    path = str(tmp_path / "ckpt")
    run_threaded(4, _save_hsdp, path, expected)
    assert sorted(p.name for p in Path(path).iterdir()) == [
        ".fsdp2_layout",
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    run_threaded(2, dcp_load, "fsdp2", path, expected)


def _strided(path: str, kind: str) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from tests.shared.experts_models import DIM
    from tests.shared.experts_models import Net as MoENet

    torch.manual_seed(0)
    if kind == "tensor parallel":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model: torch.nn.Module = torch.nn.Sequential(
            torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 7)
        )  # 10 rows: 5 per tp rank, 3 and 2 over dp
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fsdp2.fully_shard(model, mesh=mesh["dp"])
        inputs = torch.randn(3, 6)
    else:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        model = fill_deterministic_(MoENet(6), scale=0.5)  # stacks start as torch.empty
        fsdp2.shard_experts(model, ep=2, mesh=mesh)
        fsdp2.fully_shard(model, mesh=mesh)
        inputs = torch.randn(5, DIM, generator=torch.Generator().manual_seed(dist.get_rank()))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(inputs).pow(2).mean().backward()
    optim.step()
    state = _state(model, optim)
    placements = {str(v.placements) for v in state["model"].values() if isinstance(v, DTensor)}
    assert any("_StridedShard" in p for p in placements), placements
    fsdp2.save_sharded(state, path + "/flat")
    dcp.save(state, checkpoint_id=path + "/dcp")
    saved = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state["model"].items()}
    for flat_loader in (False, True):  # torch's dcp.load, then fsdp2's load_sharded (enumerates the mesh)
        with torch.no_grad():
            for param in model.parameters():
                param.zero_()
        fresh = {"model": get_model_state_dict(model)}
        if flat_loader:
            fsdp2.load_sharded(fresh, path + "/flat")
        else:
            dcp.load(fresh, checkpoint_id=path + "/flat")
        for key, value in fresh["model"].items():
            got = value.full_tensor() if isinstance(value, DTensor) else value
            torch.testing.assert_close(got, saved[key], rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.slow  # multi-rank and costly: the whole suite runs it, the quick loop leaves it
@pytest.mark.parametrize("kind", ["tensor parallel", "experts"])
def test_strided_shards_match_dcp_save_and_load_back(kind: str, tmp_path: Path) -> None:
    run_threaded(4, _strided, str(tmp_path), kind)
    assert _entries(tmp_path / "flat") == _entries(tmp_path / "dcp")


def test_slots_hold_torch_save_of_any_shape() -> None:
    """A chunk's slot (its bytes plus the archive's framing) holds ``torch.save``'s output of it."""
    shapes = [(), (0,), (1,), (3, 5), (70000, 1), (1,) * 8, (2, 3, 4, 5, 1, 2)]
    for shape in shapes:
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float8_e4m3fn):
            buffer = io.BytesIO()
            torch.save(torch.zeros(shape, dtype=dtype), buffer)
            assert len(buffer.getvalue()) <= slot_bytes(shape, dtype), (shape, dtype)


def _both(path: str) -> None:
    model = shard(seeded(Net))
    optim = adamw(model)
    train(model, optim, range(1))
    state = _state(model, optim)
    saver = fsdp2.ShardedCheckpointer()
    saver.save(state, path + "/flat")
    saver.save(state, path + "/flat2")  # the plan is reused: built once
    assert saver.plans_built == 1
    dcp.save(state, checkpoint_id=path + "/dcp")


def _entries(path: Path) -> dict[str, Any]:
    with open(path / ".metadata", "rb") as handle:
        metadata = pickle.load(handle)
    found: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks if all(c.sizes))
            found[key] = (tuple(entry.size), entry.properties.dtype, chunks)
        else:
            found[key] = "bytes"
    return found


@pytest.mark.slow  # multi-rank and costly: the whole suite runs it, the quick loop leaves it
def test_metadata_matches_dcp_save(tmp_path: Path) -> None:
    run_threaded(4, _both, str(tmp_path))
    assert _entries(tmp_path / "flat") == _entries(tmp_path / "dcp")
    assert sorted(p.name for p in (tmp_path / "flat").iterdir()) == [
        ".fsdp2_layout",  # the flat loader's sidecar: dcp.load reads only .metadata and the data files
        ".metadata",
        *(f"__{rank}_0.distcp" for rank in range(4)),
    ]


def _failing(path: str, mode: str) -> None:
    model = shard(seeded(Net))
    state = {"model": get_model_state_dict(model)}
    target = Path(path)
    target.mkdir(exist_ok=True)
    if dist.get_rank() == 1:  # rank 1 cannot create its file: a directory is in the way
        (target / "__1_0.distcp").mkdir(exist_ok=True)
    dist.barrier()
    if mode == "sync":
        with pytest.raises(OSError, match=r"__1_0\.distcp"):
            fsdp2.save_sharded(state, path)
    else:  # the writer thread fails; wait() raises on every rank
        pending = fsdp2.ShardedCheckpointer(staging_bytes=64).save_async(state, path)
        with pytest.raises(OSError, match=r"__1_0\.distcp"):
            pending.wait()
    assert not (target / ".metadata").exists()


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_failed_write_raises_everywhere_and_leaves_no_metadata(mode: str, tmp_path: Path) -> None:
    run_threaded(2, _failing, str(tmp_path / "ckpt"), mode)


def _bad_input(path: str) -> None:
    model = shard(seeded(Net))
    mesh = next(model.parameters()).device_mesh
    partial = DTensor.from_local(torch.ones(2), mesh, [Partial()])
    with pytest.raises(ValueError, match=r"Partial.*torch\.distributed\.checkpoint\.save"):
        fsdp2.save_sharded({"x": partial}, path)
    with pytest.raises(ValueError, match=r"flatten to the key 'a\.b'"):
        fsdp2.save_sharded({"a": {"b": 1}, "a.b": 2}, path)
    with pytest.raises(TypeError, match="dict of state dicts"):
        fsdp2.save_sharded([model.state_dict()], path)  # type: ignore[arg-type]
    name = "x" if dist.get_rank() == 0 else "y"  # rank 0 could not place rank 1's entries
    with pytest.raises(ValueError, match="state dicts differ in keys"):
        fsdp2.save_sharded({"model": {name: torch.ones(2)}}, path)
    assert not Path(path).exists()


def test_bad_input_raises_before_any_file(tmp_path: Path) -> None:
    run_threaded(2, _bad_input, str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="staging_bytes must be a positive int"):
        fsdp2.ShardedCheckpointer(staging_bytes=0)
