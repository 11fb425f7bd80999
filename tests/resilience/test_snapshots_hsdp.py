"""Memory snapshots of an HSDP model and its AdamW state restore exactly, at the same or another world.

4 gloo ranks as 2 simulated nodes train an HSDP model (mesh (replicate 2, shard 2)) 4 steps, with a
snapshot of step 2. A restart on the same 4 ranks restores step 2: its parameters and optimizer state
equal step 2's bit for bit, and 2 more steps equal the uninterrupted run's steps 3 and 4 bit for bit.
With the second node lost (its directory gone), the 2 survivors restore the same step as HSDP
(replicate 2, shard 1): the old shard dim's 2 pieces re-cut into 1, read from the copies the first node
kept for the second; and on 2 ranks as ``fsdp2.replicate`` (every rank all rows). Each restored state
equals step 2's whole tensors bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests._harness import run_multiprocess
from tests.shared.snapshot_runs import snapshots as make_snapshots
from tests.shared.snapshot_runs import train_step, whole

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300)]


def _model(layout: tuple[int, int] | None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """HSDP on a (replicate, shard) mesh of ``layout``'s sizes, or ``fsdp2.replicate`` when ``None``."""
    import fsdp2

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    if layout is None:
        fsdp2.replicate(model)
    else:
        mesh = init_device_mesh("cpu", layout, mesh_dim_names=("replicate", "shard"))
        for layer in (model[0], model[2]):
            fsdp2.fully_shard(layer, mesh=mesh)
        fsdp2.fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _first_run(root: str) -> None:
    model, optim = _model((2, 2))
    snapshots = make_snapshots(root, model, optim, "hsdp")
    states = []
    for step in (1, 2, 3, 4):
        train_step(model, optim, step)
        if step == 2:
            snapshots.save(step)
            snapshots.wait()
        if step in (2, 4):
            states.append(whole(model, optim))
    snapshots.close()
    if dist.get_rank() == 0:
        torch.save(states, f"{root}/states.pt")


def _restart(root: str, layout: tuple[int, int] | None, tag: str) -> None:
    model, optim = _model(layout)
    train_step(model, optim, 9)  # a state to be overwritten (AdamW's state exists)
    snapshots = make_snapshots(root, model, optim, "hsdp")
    restored = snapshots.restore()
    states = [restored.step, whole(model, optim)]
    if dist.get_world_size() == 4:  # the same layout: training resumes as if never stopped
        for step in (3, 4):
            train_step(model, optim, step)
        states.append(whole(model, optim))
    snapshots.close()
    if dist.get_rank() == 0:
        torch.save(states, f"{root}/{tag}.pt")


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        assert torch.equal(got[name], value), name


def test_hsdp_snapshots_restore_bit_for_bit_on_the_same_world_and_on_the_survivors(tmp_path: Path) -> None:
    root = str(tmp_path)
    run_multiprocess(4, _first_run, root)
    step2, step4 = torch.load(tmp_path / "states.pt")
    run_multiprocess(4, _restart, root, (2, 2), "same")
    step, restored, resumed = torch.load(tmp_path / "same.pt")
    assert step == 2
    _assert_equal(restored, step2)
    _assert_equal(resumed, step4)
    for path in (tmp_path / "node1").rglob("*"):  # the second node is lost
        if path.is_file():
            path.unlink()
    run_multiprocess(2, _restart, root, (2, 1), "survivors")
    step, restored = torch.load(tmp_path / "survivors.pt")
    assert step == 2
    _assert_equal(restored, step2)
    run_multiprocess(2, _restart, root, None, "replicated")
    step, restored = torch.load(tmp_path / "replicated.pt")
    assert step == 2
    _assert_equal(restored, step2)
