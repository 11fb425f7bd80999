"""Debug mode's divergence guard: ranks about to issue different FSDP collectives raise, never hang.

Each fault runs on thread ranks with a short timeout; every rank that reaches an FSDP collective must
raise ``fsdp2.DivergenceError`` naming the module, the iteration, the phase and the ranks on each side
(the same text on every rank), and a rank that never arrives is named by the ranks that waited. Real
gloo processes (2 and 4 ranks, faults seeded per rank) are in ``tests/multiprocess/test_divergence_gloo.py``.
Training without a fault gives the numbers of a run without debug mode, bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2 import _board as fsdp2_board
from fsdp2 import _guard as fsdp2_guard
from fsdp2.testing import run_ranks
from tests._training import fill_deterministic_, mlp_step, small_sharded_mlp


@pytest.fixture(params=["board", "store"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Where ranks meet: the shared-memory board (same host), or the store (as across hosts)."""
    if request.param == "store":
        monkeypatch.setattr(fsdp2_board, "_map", lambda path, size, token: None)  # no rank maps it
    return str(request.param)


@pytest.fixture
def debug() -> Iterator[None]:
    fsdp2.set_debug(True, timeout=3.0, report=lambda message: None)
    try:
        yield
    finally:
        fsdp2.set_debug(False, timeout=8.0)


def _faulty(fault: Callable[[nn.Module, int], None]) -> Callable[[int, int], str | None]:
    """A rank body: one clean step, then ``fault``; returns the DivergenceError's text (None if none)."""

    def body(rank: int, world_size: int) -> str | None:
        model = small_sharded_mlp()
        mlp_step(model, rank)
        try:
            fault(model, rank)
            mlp_step(model, rank, seed=1)
        except fsdp2.DivergenceError as exc:
            return str(exc)
        return None

    return body


def _raised_everywhere(fault: Callable[[nn.Module, int], None], world: int = 2) -> str:
    start = time.monotonic()
    messages = run_ranks(world, _faulty(fault), timeout=60)
    assert time.monotonic() - start < 10
    assert all(m is not None for m in messages), messages
    assert len(set(messages)) == 1, messages  # every rank explains it the same way
    return str(messages[0])


def _unshard_on_rank_0(model: nn.Module, rank: int) -> None:
    if rank == 0:
        model[2].unshard()  # e.g. to read a weight on rank 0 only


def _forward_twice_on_rank_1(model: nn.Module, rank: int) -> None:
    if rank == 1:
        model(torch.ones(2, 4))


def _eval_on_rank_0(model: nn.Module, rank: int) -> None:
    if rank == 0:
        with torch.no_grad():
            model(torch.ones(2, 4))


def _no_sync_on_rank_1(model: nn.Module, rank: int) -> None:
    if rank == 1:
        model.set_requires_gradient_sync(False)


def _frozen_on_rank_1(model: nn.Module, rank: int) -> None:
    if rank == 1:
        model[2].weight.requires_grad_(False)


def _extra_micro_batch_on_rank_0(model: nn.Module, rank: int) -> None:
    model.set_requires_gradient_sync(False)
    for _ in range(2 if rank == 0 else 1):
        mlp_step(model, rank)
    model.set_requires_gradient_sync(True)


def test_a_module_unsharded_on_some_ranks_only(debug: None) -> None:
    message = _raised_everywhere(_unshard_on_rank_0)
    assert "ranks [0]: the all-gather of module '2' (36 float32 elements) in iteration 1 (outside" in message
    assert (
        "ranks [1]: the all-gather of module '<root>' (9 float32 elements) in iteration 2 (forward)"
        in message
    )
    assert "Ranks [0] gather module '2' outside forward and backward (an explicit unshard()" in message


def test_a_forward_run_twice_on_one_rank(debug: None) -> None:
    message = _raised_everywhere(_forward_twice_on_rank_1)
    # rank 0 is in the backward of iteration 2, rank 1 runs the forward of iteration 3
    assert "ranks [0]: the all-gather of module '2' (36 float32 elements) in iteration 2 (backward" in message
    assert "ranks [1]: the all-gather of module '0' (20 float32 elements) in iteration 3 (forward)" in message
    assert "different points of training" in message


def test_an_evaluation_forward_on_rank_0_only(debug: None) -> None:
    message = _raised_everywhere(_eval_on_rank_0)
    assert (
        "ranks [0]: the all-gather of module '<root>' (9 float32 elements) in iteration 2 (forward, "
        in message
    )
    assert "(forward, gradients off), gradient sync on" in message
    assert (
        "ranks [1]: the all-gather of module '<root>' (9 float32 elements) in iteration 2 (forward),"
        in message
    )
    assert "without gradients (an evaluation under torch.no_grad() on some ranks only?)" in message


def test_gradient_sync_off_on_one_rank(debug: None) -> None:
    message = _raised_everywhere(_no_sync_on_rank_1)
    assert (
        "ranks [0]: the all-gather of module '<root>' (9 float32 elements) in iteration 2 (forward), "
        "gradient sync on" in message
    )
    assert (
        "ranks [1]: the all-gather of module '<root>' (9 float32 elements) in iteration 2 (forward), "
        "gradient sync off" in message
    )
    assert "Gradient sync differs between ranks" in message


def test_requires_grad_differs(debug: None, transport: str) -> None:
    message = _raised_everywhere(_frozen_on_rank_1)
    assert "Parameter '2.weight' has requires_grad=True on ranks [0] and False on ranks [1]" in message


def test_a_different_number_of_micro_batches(debug: None) -> None:
    message = _raised_everywhere(_extra_micro_batch_on_rank_0)
    # rank 1 switched sync back on for its last micro-batch while rank 0 still accumulates
    assert (
        "ranks [0]: the all-gather of module '<root>' (9 float32 elements) in iteration 3 (forward), "
        "gradient sync off" in message
    )
    assert (
        "ranks [1]: the all-gather of module '<root>' (9 float32 elements) in iteration 3 (forward), "
        "gradient sync on" in message
    )


def test_an_export_on_rank_0_only(debug: None, tmp_path: Any) -> None:
    path = tmp_path / "model.safetensors"

    def export_on_rank_0(model: nn.Module, rank: int) -> None:
        if rank == 0:
            fsdp2.save_full_state_dict(model, path)

    message = _raised_everywhere(export_on_rank_0)
    assert "ranks [0]: the entry of fsdp2.save_full_state_dict()" in message
    assert "call it on every rank" in message
    assert not path.exists()


class _Experts(nn.Module):
    """Two experts, each its own fully_shard module; a rank runs only the experts its tokens chose."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor, chosen: list[int]) -> torch.Tensor:
        for index in chosen:
            x = self.experts[index](x)
        return x


def test_a_module_skipped_on_one_rank(debug: None) -> None:
    """A whole fully_shard module run on some ranks only (its all-gathers would pair up wrongly)."""

    def body(rank: int, world_size: int) -> str | None:
        model = _Experts()
        fill_deterministic_(model)
        for expert in model.experts:
            fsdp2.fully_shard(expert)
        fsdp2.fully_shard(model)
        try:
            model(torch.ones(2, 4), [0, 1] if rank == 0 else [1]).sum().backward()
        except fsdp2.DivergenceError as exc:
            return str(exc)
        return None

    messages = run_ranks(2, body, timeout=60)
    assert len(set(messages)) == 1, messages
    assert messages[0] is not None
    assert (
        "ranks [0]: the all-gather of module 'experts.0' (10 float32 elements) in iteration 1 (forward)"
        in messages[0]
    )
    assert (
        "ranks [1]: the all-gather of module 'experts.1' (10 float32 elements) in iteration 1 (forward)"
        in messages[0]
    )
    assert "The ranks run different FSDP modules here (a module skipped or repeated" in messages[0]


def test_a_rank_that_never_arrives_is_named(debug: None, transport: str) -> None:
    def body(rank: int, world_size: int) -> str | None:
        model = small_sharded_mlp()
        mlp_step(model, rank)
        if rank == 1:
            return None  # leaves training (e.g. its data ran out)
        try:
            mlp_step(model, rank)
        except fsdp2.DivergenceError as exc:
            return str(exc)
        return None

    start = time.monotonic()
    messages = run_ranks(2, body, timeout=60)
    assert 3 <= time.monotonic() - start < 10
    assert messages[1] is None
    assert messages[0] is not None
    assert (
        "rank 0 waited 3 s for ranks [1] at the all-gather of module '<root>' (9 float32 elements) in "
        in messages[0]
    )
    assert "iteration 2 (forward), gradient sync on; they did not reach it" in messages[0]
    # its backward ended with the first block's reduce-scatter
    assert (
        "rank 1's last FSDP collective was the reduce-scatter of module '0' (44 float32 elements) in "
        in messages[0]
    )
    assert "iteration 1 (backward, gradients off)" in messages[0]


def test_a_forward_without_collectives_on_one_rank_is_fine(debug: None) -> None:
    """Rank 0 evaluates on parameters every rank unsharded: no collective differs, so no error."""

    def body(rank: int, world_size: int) -> list[torch.Tensor]:
        model = small_sharded_mlp()
        mlp_step(model, rank)
        sharded = [m for m in model.modules() if isinstance(m, fsdp2.FSDPModule)]
        for module in sharded:
            module.unshard()  # every rank: one all-gather each
        if rank == 0:
            with torch.no_grad():
                model(torch.ones(2, 4))  # an extra forward of the root, issuing no collective
        for module in sharded:
            module.reshard()
        mlp_step(model, rank, seed=1)
        return [p.grad.full_tensor() for p in model.parameters()]

    grads = run_ranks(2, body)
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["fsdp-2", "hsdp-2x2"])
def test_training_is_unchanged(debug: None, layout: str, transport: str) -> None:
    """Three AdamW steps (bucketed with explicit prefetch; HSDP): bit-equal with debug mode off."""

    def body(rank: int, world_size: int) -> list[torch.Tensor]:
        mesh = None
        if layout.startswith("hsdp"):
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = small_sharded_mlp(mesh)
        if mesh is None:
            model.set_bucket_cap_mb(1, 1)
            model[0].set_modules_to_forward_prefetch([model[2]])
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        for step in range(3):
            mlp_step(model, rank, seed=step)
            opt.step()
            opt.zero_grad()
        if fsdp2._debug.debug_enabled():  # the ranks met where the transport says
            boards = [fsdp2_guard._channel(g).board for g in fsdp2._engine.data_parallel_groups(model)]
            want = fsdp2_board.Board if transport == "board" else bool
            assert all(isinstance(b, want) for b in boards), boards
        return [p.full_tensor() for p in model.parameters()]

    world = 4 if layout.startswith("hsdp") else 2
    checked = run_ranks(world, body)
    fsdp2.set_debug(False)
    plain = run_ranks(world, body)
    for a, b in zip(checked[0], plain[0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"set_debug\(timeout=...\) must be a positive number of seconds"):
        fsdp2.set_debug(True, timeout=0)
    assert not fsdp2._debug.debug_enabled()  # nothing changed
