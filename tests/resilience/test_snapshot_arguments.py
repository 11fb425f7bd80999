"""``fsdp2.Snapshots`` refuses what it cannot keep, before it creates its process group: a cadence
that is not a positive int, a name that is not a folder name, state objects without
``state_dict``/``load_state_dict``, rows that are not ``torch.chunk``'s (a ``_StridedShard``) or a
2-D layout other than HSDP's (rows cut on the outer mesh dim, slices on a mesh not in order), a job
without an identity (a restore could take another job's snapshots), and a torchrun launch that may
restart the job on a store shared between its rounds (the restart would fail to connect); a node that
cannot write its directory is refused on every rank.
A model it accepts captures, on each rank, exactly that rank's shard of every parameter and its
optimizer state, an HSDP model its shard dim's piece, a replicated tensor all its rows and optimizer
state sharded across replicas each rank's own slice (the bytes
the restore moves; the restore itself runs in spawned gloo processes, in
tests/resilience/test_snapshots_gloo.py, test_snapshots_hsdp.py and test_snapshots_slices.py).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import fsdp2
from fsdp2.resilience._format import capture, check_layouts
from fsdp2.resilience._nodes import check_separate_storage
from fsdp2.resilience._ring import Ring
from fsdp2.resilience._store import NodeStore
from tests._harness import run_threaded


def _model(mesh: Any = None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    for layer in model:
        fsdp2.fully_shard(layer, mesh=mesh)
    return fsdp2.fully_shard(model, mesh=mesh)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"every": 0}, ValueError, "every=.*positive int"),
        ({"every": True}, ValueError, "every=.*positive int"),
        ({"every": 2, "name": "a/b"}, ValueError, "plain folder name"),
        ({"every": 2, "state": {"step": 3}}, TypeError, "int has no state_dict"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    def body() -> None:
        with pytest.raises(error, match=match):
            fsdp2.Snapshots(_model(), **kwargs)

    run_threaded(2, body)


def test_other_2d_layouts_than_hsdps_are_refused_with_the_way_out() -> None:
    def body() -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        local = torch.ones(2, 3)
        for placements in ([Shard(0), Shard(0)], [Shard(0), Replicate()], [Replicate(), Replicate()]):
            tensor = DTensor.from_local(local, mesh, placements, run_check=False)
            with pytest.raises(ValueError, match=r"HSDP.*torch\.distributed\.checkpoint"):
                check_layouts({"w": tensor})

    run_threaded(4, body)


def test_optimizer_state_sharded_across_replicas_is_captured_as_each_rank_s_slice() -> None:
    def body() -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = _model(mesh)
        optim = fsdp2.shard_optimizer_across_replicas(model, torch.optim.AdamW(model.parameters()))
        model(torch.ones(4, 3)).sum().backward()
        optim.step()
        tree = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
        snapshot = capture(tree, 1, 4, dist.get_rank())
        sliced = [i for i, leaf in enumerate(snapshot.leaves) if leaf.replicas > 1]
        assert sliced
        assert all(snapshot.leaves[i].path[-1] in ("exp_avg", "exp_avg_sq") for i in sliced)
        for i in sliced:
            leaf = snapshot.leaves[i]
            assert (leaf.shards, leaf.replicas) == (2, 2)
            _, _, name, key = leaf.path
            state = tree["optim"]["state"][name][key]
            assert state.placements == (Shard(0), Shard(0))  # DTensor's own slice, byte for byte
            assert torch.equal(snapshot.local(i), state.to_local())

    run_threaded(4, body)


def test_replicate_s_optimizer_slices_are_captured_as_fsdp_s_cut() -> None:
    def body() -> None:
        torch.manual_seed(0)
        model = fsdp2.replicate(nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2)))
        optim = fsdp2.shard_optimizer_across_replicas(model, torch.optim.AdamW(model.parameters()))
        model(torch.ones(4, 3)).sum().backward()
        optim.step()
        tree = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
        snapshot = capture(tree, 1, 2, dist.get_rank())
        for i, leaf in enumerate(snapshot.leaves):
            if leaf.path[-1] in ("exp_avg", "exp_avg_sq"):
                assert (leaf.shards, leaf.replicas) == (None, 1)  # the world's torch.chunk pieces
                state = tree["optim"]["state"][leaf.path[2]][leaf.path[3]]
                assert torch.equal(snapshot.local(i), state.to_local())

    run_threaded(2, body)


def test_only_torch_chunks_rows_on_a_1d_mesh_are_taken() -> None:
    def body() -> None:
        mesh = init_device_mesh("cpu", (2,))
        local = torch.ones(2, 3)
        placements = (Shard(0), Shard(1), Replicate())
        taken = [DTensor.from_local(local, mesh, [p], run_check=False) for p in placements]
        leaves = capture({"w": taken}, 1, 2, dist.get_rank()).leaves
        assert [(leaf.dim, leaf.shards) for leaf in leaves] == [(0, None), (1, None), (0, 1)]
        tensor = DTensor.from_local(local, mesh, [_StridedShard(0, split_factor=2)], run_check=False)
        with pytest.raises(ValueError, match=r"1-D mesh.*torch\.distributed\.checkpoint"):
            check_layouts({"w": tensor})  # interleaved rows
        scalar = DTensor.from_local(torch.tensor(1.0), mesh, [Replicate()], run_check=False)
        with pytest.raises(ValueError, match=r"1-D mesh.*torch\.distributed\.checkpoint"):
            check_layouts({"w": scalar})  # no rows to cut

    run_threaded(2, body)


def _captured(step: int, hsdp: bool = False) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    model = _model(mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(step):
        model(torch.ones(4, 3)).sum().backward()
        optim.step()
    tree = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    snapshot = capture(tree, step, dist.get_world_size(), dist.get_rank())
    names = [leaf.name for leaf in snapshot.leaves]
    assert names[:4] == ["model/0.weight", "model/0.bias", "model/1.weight", "model/1.bias"]
    for index, (name, param) in enumerate(model.named_parameters()):
        assert torch.equal(snapshot.local(index), param.to_local()), name
        assert snapshot.leaves[index].shape == tuple(param.shape), name  # the global shape
        assert snapshot.leaves[index].dim == 0, name
        assert snapshot.leaves[index].shards == (2 if hsdp else None), name
        state = optim.state[param]
        mine = names.index(f"optim/state/{name}/exp_avg")
        assert torch.equal(snapshot.local(mine), state["exp_avg"].to_local()), name
    assert snapshot.leaves[names.index("optim/state/1.bias/step")].dim is None


def test_a_capture_holds_each_ranks_shards_of_parameters_and_optimizer_state() -> None:
    run_threaded(2, functools.partial(_captured, 2))


def test_an_hsdp_capture_holds_each_ranks_shard_dim_piece() -> None:
    run_threaded(4, functools.partial(_captured, 2, hsdp=True))


@pytest.mark.parametrize(
    ("environ", "job", "match"),
    [
        ({}, None, "identity for the job.*not launched by torchrun: launch it with torchrun.*_JOB"),
        ({"TORCHELASTIC_RUN_ID": "none"}, None, r"id is 'none'\): pass torchrun --rdzv-id <job id>"),
        ({"TORCHELASTIC_RUN_ID": "x"}, " ", "job=.*non-empty string"),
    ],
)
def test_a_job_without_an_identity_is_refused(
    environ: dict[str, str], job: str | None, match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FSDP2_SNAPSHOT_JOB", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)

    def body() -> None:
        with pytest.raises(ValueError, match=match):
            fsdp2.Snapshots(_model(), every=1, job=job)

    run_threaded(2, body)


def test_a_restartable_torchrun_job_on_a_shared_store_is_refused_with_the_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "demo")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")

    def body() -> None:
        with pytest.raises(RuntimeError, match=r"--max-restarts 3.*TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
            fsdp2.Snapshots(_model(), every=1)

    run_threaded(2, body)


def test_a_node_that_cannot_write_its_directory_is_refused_on_every_rank(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")

    def body() -> None:
        rank = dist.get_rank()
        root = tmp_path / ("node0" if rank == 0 else "a-file")  # node 1's directory is under a file
        store = NodeStore(root, "train", "job")
        keys = [f"host{r}:{NodeStore(tmp_path / f'n{r}', 'train', 'job').directory}" for r in range(2)]
        with pytest.raises(RuntimeError, match=r"cannot write in its snapshot directory on host1:"):
            check_separate_storage(store, Ring.of(keys), keys[rank], rank, dist.group.WORLD)

    run_threaded(2, body)
    assert [p.name for p in (tmp_path / "node0").rglob("*") if p.is_file()] == []  # no marker left behind
