"""Debug mode's divergence guard: ranks about to issue different FSDP collectives raise, never hang.

Each fault runs on thread ranks with a short timeout; every rank that reaches an FSDP collective must
raise ``fsdp2.DivergenceError`` naming the module, the iteration, the phase and the ranks on each side
(the same text on every rank), and a rank that never arrives is named by the ranks that waited. Real
gloo processes (4 ranks, faults seeded per rank) are in ``tests/debug/test_divergence_gloo.py``.
Training without a fault gives the numbers of a run without debug mode, bit for bit. Ranks that run
different numbers of micro-batches before an optimizer step raise at once (the descriptions carry the
optimizer step count), and the same number on every rank never raises, whatever the loop does around it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2.debug import _board as fsdp2_board
from fsdp2.debug import _guard as fsdp2_guard
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


def _raised_everywhere(fault: Callable[[nn.Module, int], None], world: int = 2, within: float = 10) -> str:
    start = time.monotonic()
    messages = run_ranks(world, _faulty(fault), timeout=60)
    assert time.monotonic() - start < within
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


def _accumulate_an_extra_micro_batch_on_rank_0(model: nn.Module, rank: int) -> None:
    with fsdp2.accumulate(model):  # keeps every group's gradients: one reduction each at the exit
        for _ in range(3 if rank == 0 else 2):
            mlp_step(model, rank)


def test_a_different_number_of_micro_batches_in_accumulate(debug: None) -> None:
    """Rank 1 leaves ``accumulate`` (its exit reduce-scatters) while rank 0 runs a third forward."""
    message = _raised_everywhere(_accumulate_an_extra_micro_batch_on_rank_0)
    assert (
        "ranks [1]: the reduce-scatter of module '0' (44 float32 elements) in iteration 3 (outside forward "
        "and backward), gradient sync off" in message
    )
    # Before: "Ranks [1] gather module '0' outside forward and backward (an explicit unshard() ...)".
    assert (
        "Ranks [1] reduce the gradients of module '0' (a reduce-scatter) outside forward and backward, as "
        "the exit of fsdp2.accumulate() does to the gradients it kept, while ranks [0] gather module "
        "'<root>' in the forward of iteration 4: the ranks ran different numbers of micro-batches inside "
        "fsdp2.accumulate()." in message
    )
    assert "unshard()" not in message


def _synced_micro_batches(accumulate: bool) -> Callable[[nn.Module, int], None]:
    """Every micro-batch syncs; rank 0 runs 3 before its optimizer step, rank 1 runs 2."""

    def fault(model: nn.Module, rank: int) -> None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with fsdp2.accumulate(model, budget_bytes=0) if accumulate else contextlib.nullcontext():
            for _ in range(3 if rank == 0 else 2):
                mlp_step(model, rank)
        optimizer.step()
        optimizer.zero_grad()

    return fault


@pytest.mark.parametrize("accumulate", [False, True], ids=["plain", "accumulate-budget-0"])
def test_a_different_number_of_synced_micro_batches(debug: None, accumulate: bool, transport: str) -> None:
    """Before: rank 1's next step paired with rank 0's third micro-batch, silently; rank 0 timed out."""
    fsdp2.set_debug(True, timeout=20.0, report=lambda message: None)  # promptly: well under it
    message = _raised_everywhere(_synced_micro_batches(accumulate), within=10)
    assert (
        "ranks [0]: the all-gather of module '<root>' (9 float32 elements) in iteration 4 (forward), "
        "gradient sync on\n" in message
    )
    assert (
        "ranks [1]: the all-gather of module '<root>' (9 float32 elements) in iteration 4 (forward), "
        "gradient sync on, 1st forward since optimizer step 1\n" in message
    )
    assert (
        "The ranks are in different optimizer steps: ranks [0] are at their 4th forward before any "
        "optimizer step, ranks [1] at their 1st forward since optimizer step 1. They ran different "
        "numbers of micro-batches before optimizer.step() (or stepped on some ranks only)" in message
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


@pytest.mark.slow  # waits for the guard's timeout on purpose
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


def _micro_batches(model: nn.Module, rank: int, step: int, count: int = 3) -> None:
    for micro in range(count):
        mlp_step(model, rank, seed=10 * step + micro)


def _same_micro_batches_everywhere(pattern: str) -> Callable[[int, int], tuple[int, int]]:
    """A rank body: three optimizer steps of three micro-batches each, the same on every rank."""

    def body(rank: int, world_size: int) -> tuple[int, int]:
        model, other = small_sharded_mlp(), small_sharded_mlp()
        some = pattern == "an optimizer of some groups"
        params = list(model[0].parameters()) if some else model.parameters()
        optimizer = torch.optim.AdamW(params, lr=0.1)  # local steps from its second step on
        others = torch.optim.SGD(other.parameters(), lr=0.1)  # a second root, stepped every other step
        if pattern == "explicit prefetch":
            model.set_bucket_cap_mb(1, 1)
            model[0].set_modules_to_forward_prefetch([model[2]])
            model[2].set_modules_to_backward_prefetch([model[0]])
        for step in range(3):
            if pattern == "no-sync until the last micro-batch":
                model.set_requires_gradient_sync(False)
                _micro_batches(model, rank, step, count=2)
                model.set_requires_gradient_sync(True)
                mlp_step(model, rank, seed=10 * step + 2)
            elif pattern.startswith("accumulate"):
                budget = {"accumulate": None, "accumulate, budget 0": 0, "accumulate, budget 100": 100}
                with fsdp2.accumulate(model, budget_bytes=budget[pattern]):
                    _micro_batches(model, rank, step)
            else:
                _micro_batches(model, rank, step)
            optimizer.step()
            optimizer.zero_grad()
            if pattern == "unshard by hand":
                model[2].unshard()  # every rank, between the step and the next forward
            with torch.no_grad():
                model(torch.ones(2, 4))  # an evaluation on every rank
            mlp_step(other, rank, seed=step)
            if step % 2 == 0:
                others.step()
                others.zero_grad()
        return (_steps_counted(model), _steps_counted(other))

    return body


def _steps_counted(model: nn.Module) -> int:
    """The optimizer steps the guard counted over ``model`` (a root it guards)."""
    return next(s.count for s in list(fsdp2_guard._all_steps) if s.guards(model))


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize(
    "pattern",
    [
        "synced micro-batches",
        "no-sync until the last micro-batch",
        "accumulate",
        "accumulate, budget 0",
        "accumulate, budget 100",  # keeps the root's gradients, reduces the others' each micro-batch
        "explicit prefetch",
        "unshard by hand",
        "an optimizer of some groups",
    ],
)
def test_the_same_micro_batches_on_every_rank_pass(debug: None, pattern: str) -> None:
    """Optimizer steps are counted per root: equal counts never raise, whatever else the loop does."""
    # 3 steps of the model (local steps from the second on), 2 of the second root's optimizer
    assert run_ranks(2, _same_micro_batches_everywhere(pattern), timeout=60) == [(3, 2), (3, 2)]


@pytest.mark.first_case_in_quick_loop
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
        if fsdp2.trace._debug.debug_enabled():  # the ranks met where the transport says
            groups = fsdp2.runtime.data_parallel_groups(model)
            boards = [fsdp2_guard._channel(g).board for g in groups]
            want = fsdp2_board.Board if transport == "board" else bool
            assert all(isinstance(b, want) for b in boards), boards
        return [p.full_tensor() for p in model.parameters()]

    world = 4 if layout.startswith("hsdp") else 2
    checked = run_ranks(world, body)
    fsdp2.set_debug(False)
    plain = run_ranks(world, body)
    for a, b in zip(checked[0], plain[0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_description_reads_back_as_written() -> None:
    """The store carries descriptions as text: every field comes back, compared or shown."""
    point = fsdp2_guard.Point("reduce_scatter", "2", 7, "backward", False, True, 36, "bfloat16", "10", 3, 2)
    text = point.encode()
    assert fsdp2_guard.Point.decode(text) == point
    assert text.endswith("#7,2")  # the iteration and the forwards since the last step: shown only
    assert "gradient sync on, 2nd forward since optimizer step 3" in str(point)


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"set_debug\(timeout=...\) must be a positive number of seconds"):
        fsdp2.set_debug(True, timeout=0)
    assert not fsdp2.trace._debug.debug_enabled()  # nothing changed
