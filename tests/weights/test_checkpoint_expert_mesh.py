"""A checkpoint of experts on an ``(efsdp, ep)`` mesh, resumed at another ``ep`` or world size.

Model (``tests/shared/ep_layout.py``): 2 mixture-of-experts blocks; stacked experts placed on ``ep``
and sharded over ``efsdp``, the rest over the dense mesh. Saved with torch's DCP
(``get_model_state_dict`` / ``get_optimizer_state_dict`` + ``dcp.save``) after 2 AdamW steps at
``ep 2 x efsdp 2`` on 4 thread ranks, loaded (``dcp.load`` + ``set_model_state_dict`` /
``set_optimizer_state_dict``) into a fresh model at ``ep 4 x efsdp 1``, at ``ep 1`` (no expert mesh,
the experts sharded over all 4 ranks like every parameter: ``efsdp 4``), and at world 2 (``ep 2 x
efsdp 1``), trained 2 more steps there: parameters equal the unsharded reference's trained on the
same global batches throughout. With 2 experts, one ``efsdp`` rank of each pair saves an empty shard of
every stack (and at ``ep 1`` two ranks load one).

``model.state_dict()`` holds DTensors of the global shapes (the stacks ``[E, ...]``), each rank its
rows.
"""

from __future__ import annotations

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
from torch.distributed.tensor import DTensor

from tests._harness import run_threaded
from tests.shared import ep_layout

SAVE_WORLD, SAVE_EP, LR = 4, 2, 1e-2


def _build(experts: int, ep: int) -> tuple[ep_layout.Net, torch.optim.Optimizer]:
    mesh, dense = ep_layout.meshes(ep)
    model = ep_layout.shard(ep_layout.build(experts), mesh, dense)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _train(model: ep_layout.Net, optim: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        ep_layout.loss_of(model(ep_layout.batch(dist.get_rank(), step))).backward()
        optim.step()
        optim.zero_grad()


def _save(experts: int, path: str) -> dict[str, Any]:
    model, optim = _build(experts, SAVE_EP)
    _train(model, optim, range(2))
    state = model.state_dict()
    layout = {name: (tuple(t.shape), t.to_local().shape[0]) for name, t in state.items()}
    assert all(isinstance(t, DTensor) for t in state.values())
    dcp.save(
        {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)},
        checkpoint_id=path,
    )
    return layout


def _resume(experts: int, ep: int, path: str) -> dict[str, torch.Tensor]:
    model, optim = _build(experts, ep)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
    _train(model, optim, range(2, 4))
    return ep_layout.full_params(model)


def _reference(experts: int, worlds: list[int]) -> dict[str, torch.Tensor]:
    """The unsharded model trained on each step's global batch (``worlds[step]`` ranks' batches)."""
    ref = ep_layout.build(experts)
    optim = torch.optim.AdamW(ref.parameters(), lr=LR)
    for step, world in enumerate(worlds):
        ep_layout.reference_backward(ref, world, step)
        optim.step()
        optim.zero_grad()
    return ep_layout.full_params(ref)


@pytest.mark.slow  # multi-rank and costly: the whole suite runs it, the quick loop leaves it
@pytest.mark.parametrize(
    ("experts", "resume_at"),
    [(4, [(4, 4), (4, 1), (2, 2)]), (2, [(4, 1), (2, 2)])],
    ids=["4-experts", "2-experts-empty-shard"],
)
def test_dcp_checkpoint_resumes_at_another_ep(
    experts: int, resume_at: list[tuple[int, int]], tmp_path: Path
) -> None:
    path = str(tmp_path / "ckpt")
    layouts = run_threaded(SAVE_WORLD, _save, experts, path)
    for name in ("blocks.0.experts.w1", "blocks.1.experts.w2"):
        shapes = {layout[name][0] for layout in layouts}
        assert len(shapes) == 1
        assert shapes.pop()[0] == experts  # the global stack [E, ...]
        rows = sorted(layout[name][1] for layout in layouts)  # FSDP's rows of each ep rank's stack
        assert rows == ([1, 1, 1, 1] if experts == 4 else [0, 0, 1, 1])
    for world, ep in resume_at:
        results = run_threaded(world, _resume, experts, ep, path)
        expected = _reference(experts, [SAVE_WORLD, SAVE_WORLD, world, world])
        for name, param in expected.items():
            torch.testing.assert_close(
                results[0][name], param, msg=lambda m, n=name, w=world, e=ep: f"world {w} ep {e} {n}: {m}"
            )
