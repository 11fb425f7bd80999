"""``fsdp2.load_sharded`` / ``ShardedCheckpointer.load``: a flat checkpoint read back without a plan gather.

- model and AdamW state saved at 4 ranks (13 hidden rows: uneven) load at 4, 2 and 1 ranks into
  fsdp2 and at 2 into torch's ``fully_shard``, equal to the saved values exactly, and the next step
  equals an unsharded reference (``tests/shared/checkpoint_net.py``); the model part loads into a
  plain ``nn.Module``'s ``state_dict()`` with no process group;
- the chunks that meet a box, found per mesh dim, are those trying every mesh coordinate finds;
  a saving mesh's ranks are kept as a range where they are one;
- HSDP on a (2, 2) mesh (only the first replica wrote) loads into plain FSDP at 2, and FSDP at 2 loads
  into HSDP (every replica reads the chunk it holds);
- a rank reads only the saved chunks that meet its shards: at the same world size one per sharded
  tensor, from its own file;
- the sidecar stays small (the default mesh's ranks as a range) and ``.metadata`` is written after it;
- a key missing from the checkpoint, a shape or dtype that differs, a non-tensor where a tensor was
  saved: ``ValueError`` naming the key before any tensor of the state changes; a ``dcp.save`` folder:
  ``ValueError`` pointing at ``dcp.load``.
"""

from __future__ import annotations

import json
from itertools import product
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import fsdp2
from fsdp2.weights._flat_layout import TensorLayout
from fsdp2.weights._flat_load import _candidates, _overlap, load_flat
from fsdp2.weights._flat_sidecar import MeshRanks
from tests._harness import run_threaded
from tests._training import seeded
from tests.shared.checkpoint_net import Net, adamw, assert_matches, perturbed, shard, snapshot, train


def _state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}


def _hsdp(model: torch.nn.Module) -> torch.nn.Module:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:  # type: ignore[union-attr]
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    return model


def _save(path: str, layout: str, out: dict[str, Any]) -> None:
    model = _hsdp(seeded(Net)) if layout == "hsdp" else shard(seeded(Net))
    optim = adamw(model)
    train(model, optim, range(2))
    fsdp2.save_sharded(_state(model, optim), path)
    saved = snapshot(model, optim)
    if dist.get_rank() == 0:
        out.update(saved)


def _load(impl: str, path: str, expected: dict[str, Any]) -> None:
    model = _hsdp(perturbed()) if impl == "hsdp" else shard(perturbed(), impl)
    optim = adamw(model)
    state = _state(model, optim)
    plan = load_flat(state, path)
    if dist.get_world_size() == 4 and impl == "fsdp2":  # as saved: its own chunk of each sharded tensor
        assert {piece.rank for _, pieces in plan.tensors for piece in pieces} <= {0, dist.get_rank()}
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
    assert_matches(model, optim, expected)


@pytest.mark.first_case_in_quick_loop
def test_saved_at_4_loads_at_4_2_1_and_into_torch(tmp_path: Path) -> None:
    expected: dict[str, Any] = {}
    path = str(tmp_path / "ckpt")
    run_threaded(4, _save, path, "fsdp", expected)
    for world, impl in [(4, "fsdp2"), (2, "fsdp2"), (1, "fsdp2"), (2, "torch")]:
        run_threaded(world, _load, impl, path, expected)
    plain = Net()  # no process group: a plain model's tensors are whole targets
    fsdp2.load_sharded({"model": plain.state_dict()}, path)
    torch.testing.assert_close(plain.state_dict(), expected["model"], rtol=0, atol=0)


@pytest.mark.slow  # multi-rank and costly: the whole suite runs it, the quick loop leaves it
def test_hsdp_loads_into_fsdp_and_back(tmp_path: Path) -> None:
    expected: dict[str, Any] = {}
    run_threaded(4, _save, str(tmp_path / "hsdp"), "hsdp", expected)
    run_threaded(2, _load, "fsdp2", str(tmp_path / "hsdp"), expected)
    expected.clear()
    run_threaded(2, _save, str(tmp_path / "fsdp"), "fsdp", expected)
    run_threaded(4, _load, "hsdp", str(tmp_path / "fsdp"), expected)


def _save_and_load_with_checkpointer(path: str) -> None:
    model = shard(seeded(Net))
    optim = adamw(model)
    train(model, optim, range(1))
    saver = fsdp2.ShardedCheckpointer(staging_bytes=512)
    saver.save_async(_state(model, optim), path)  # load waits for a save in flight first
    saved = snapshot(model, optim)
    fresh = shard(perturbed())
    fresh_optim = adamw(fresh)
    state = _state(fresh, fresh_optim)
    saver.load(state, path)
    set_model_state_dict(fresh, state["model"])
    set_optimizer_state_dict(fresh, fresh_optim, state["optim"])
    assert_matches(fresh, fresh_optim, saved)


def test_checkpointer_load_waits_for_its_save(tmp_path: Path) -> None:
    run_threaded(2, _save_and_load_with_checkpointer, str(tmp_path / "ckpt"))
    sidecar = json.loads((tmp_path / "ckpt" / ".fsdp2_layout").read_bytes())
    assert sidecar["meshes"] == [{"shape": [2], "start": 0, "step": 1}]  # a range, not a list of ranks
    assert sidecar["objects"][0][0] == "optim.param_groups.0.lr"  # DCP flattens the groups too
    layout, metadata = tmp_path / "ckpt" / ".fsdp2_layout", tmp_path / "ckpt" / ".metadata"
    assert layout.stat().st_mtime_ns <= metadata.stat().st_mtime_ns


def _errors(path: str) -> None:
    model = shard(perturbed())
    optim = adamw(model)
    train(model, optim, range(1))
    state = _state(model, optim)
    before = snapshot(model, optim)
    renamed = {"model": {**state["model"], "extra.weight": torch.zeros(2)}}
    with pytest.raises(ValueError, match=r"'model\.extra\.weight' is no entry in the checkpoint"):
        fsdp2.load_sharded(renamed, path)
    wrong = {"model": {**state["model"], "head.bias": torch.zeros(4)}}
    with pytest.raises(
        ValueError, match=r"'model\.head\.bias' is \(4,\) torch\.float32 in the state but \(3,\)"
    ):
        fsdp2.load_sharded(wrong, path)
    wrong = {"model": {**state["model"], "offset": torch.zeros(3, dtype=torch.float64)}}
    with pytest.raises(ValueError, match=r"'model\.offset' is \(3,\) torch\.float64"):
        fsdp2.load_sharded(wrong, path)
    with pytest.raises(
        ValueError, match=r"'optim\.param_groups\.0\.lr' is a tensor in the state but a non-t"
    ):
        fsdp2.load_sharded({"optim": {"param_groups": [{"lr": torch.zeros(1)}]}}, path)
    torch.testing.assert_close(snapshot(model, optim), before, rtol=0, atol=0)  # nothing was read
    with pytest.raises(ValueError, match=r"no \.fsdp2_layout.*torch\.distributed\.checkpoint\.load"):
        fsdp2.load_sharded(state, path + "-dcp")
    with pytest.raises(ValueError, match=r"holds no \.metadata"):
        fsdp2.load_sharded(state, path + "-none")
    with pytest.raises(TypeError, match="dict of state dicts"):
        fsdp2.load_sharded([state], path)  # type: ignore[arg-type]


def _save_both(path: str) -> None:
    model = shard(seeded(Net))
    optim = adamw(model)
    train(model, optim, range(1))
    fsdp2.save_sharded(_state(model, optim), path)
    dcp.save(_state(model, optim), checkpoint_id=path + "-dcp")


def test_errors_name_the_key_before_anything_is_read(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_threaded(2, _save_both, path)
    run_threaded(2, _errors, path)


@pytest.mark.parametrize(
    "placements",
    [
        (Shard(0),),
        (Shard(0), Shard(0)),
        (Shard(1), Shard(0)),
        (Replicate(), Shard(1)),
        (Shard(0), Replicate()),
    ],
)
def test_candidates_are_the_chunks_that_meet_a_box(placements: tuple[Any, ...]) -> None:
    """Per mesh dim only the overlapping indices: the same chunks as trying every coordinate."""
    generator = torch.Generator().manual_seed(0)
    for shape, mesh_shape in [((13, 7), (3,) * len(placements)), ((5, 9), (4,) * len(placements))]:
        layout = TensorLayout("w", shape, torch.float32, mesh_shape, placements)
        every = [c for c in product(*(range(n) for n in mesh_shape)) if layout.chunk(c) is not None]
        for _ in range(20):
            low = tuple(int(torch.randint(0, n, (1,), generator=generator)) for n in shape)
            sizes = tuple(
                int(torch.randint(1, n - at + 1, (1,), generator=generator))
                for n, at in zip(shape, low, strict=True)
            )
            box = (low, sizes)
            meets = {c for c in every if _overlap(layout.chunk(c), box) is not None}  # type: ignore[arg-type]
            found = {c for c in _candidates(layout, box) if layout.chunk(c) is not None}
            assert meets <= found, (placements, shape, box)
            assert {c for c in found if _overlap(layout.chunk(c), box) is not None} == meets  # type: ignore[arg-type]


def test_mesh_ranks_kept_as_a_range_where_they_are_one() -> None:
    assert MeshRanks.of((4,), [0, 1, 2, 3]).encode() == {"shape": [4], "start": 0, "step": 1}
    assert MeshRanks.of((2,), [1, 3]).encode() == {"shape": [2], "start": 1, "step": 2}
    custom = MeshRanks.of((2, 2), [0, 2, 1, 3])  # another order: the list, once
    assert custom.encode() == {"shape": [2, 2], "ranks": [0, 2, 1, 3]}
    assert [custom.rank_at(c) for c in [(0, 0), (0, 1), (1, 0), (1, 1)]] == [0, 2, 1, 3]
    assert [custom.coordinate_of(r) for r in range(5)] == [(0, 0), (1, 0), (0, 1), (1, 1), None]
    odd = MeshRanks.of((2,), [1, 3])
    assert [odd.coordinate_of(r) for r in range(5)] == [None, (0,), None, (1,), None]


def test_a_sidecar_of_another_version_points_at_dcp_load(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(b"")
    (tmp_path / ".fsdp2_layout").write_text(json.dumps({"format": "fsdp2-flat-layout", "version": 99}))
    with pytest.raises(ValueError, match=r"version 99; this fsdp2 reads .* version 1\. Load it with torch"):
        fsdp2.load_sharded({"model": {"w": torch.zeros(2)}}, tmp_path)
