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
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests._harness import run_multiprocess

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


def _train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    inputs = torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))
    model(inputs).square().sum().backward()
    optim.step()
    optim.zero_grad()


def _whole(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state entry as its whole tensor."""
    out = {}
    for name, param in model.named_parameters():
        out[name] = param.full_tensor() if isinstance(param, DTensor) else param.detach().clone()
        for key, value in optim.state[param].items():
            value = value.full_tensor() if isinstance(value, DTensor) else value
            out[f"{name}/{key}"] = value.detach().clone()
    return out


def _snapshots(root: str, model: torch.nn.Module, optim: torch.optim.Optimizer) -> Any:
    import fsdp2

    node = f"{root}/node{dist.get_rank() // 2}"  # 2 ranks a node
    return fsdp2.Snapshots(model, optim, every=2, directory=node, name="hsdp", job="j")


def _first_run(root: str) -> None:
    model, optim = _model((2, 2))
    snapshots = _snapshots(root, model, optim)
    states = []
    for step in (1, 2, 3, 4):
        _train_step(model, optim, step)
        if step == 2:
            snapshots.save(step)
            snapshots.wait()
        if step in (2, 4):
            states.append(_whole(model, optim))
    snapshots.close()
    if dist.get_rank() == 0:
        torch.save(states, f"{root}/states.pt")


def _restart(root: str, layout: tuple[int, int] | None, tag: str) -> None:
    model, optim = _model(layout)
    _train_step(model, optim, 9)  # a state to be overwritten (AdamW's state exists)
    snapshots = _snapshots(root, model, optim)
    restored = snapshots.restore()
    states = [restored.step, _whole(model, optim)]
    if dist.get_world_size() == 4:  # the same layout: training resumes as if never stopped
        for step in (3, 4):
            _train_step(model, optim, step)
        states.append(_whole(model, optim))
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
