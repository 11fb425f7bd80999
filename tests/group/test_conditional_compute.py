"""Conditional compute never hangs: a mixture-of-experts layer whose experts get tokens on some
ranks only, threads as ranks, with fsdp2's defaults (no setter).

Reference: the unsharded model on every rank's inputs, gradients averaged over the ranks with a
parameter a rank did not use counting as zero there, and staying ``None`` where no rank used it (as
data parallelism over the unsharded model gives). fsdp2's sharded gradients and the parameters after
AdamW steps must match it: experts unused on some ranks, an expert unused on every rank (its gradient
stays ``None``, so AdamW leaves it alone), HSDP, bucketing, and ``set_reduce_scatter_unused_params``
keeping torch's zeros.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
import fsdp2.testing
from tests._harness import run_threaded
from tests._training import fill_deterministic_
from tests.shared.moe import (
    DIM,
    RS_NAME,
    MoE,
    Sizes,
    _batch,
    _check_grads,
    _model,
    _moe_row,
    _reference_grads,
    _train,
    check_left_out,
    check_wrong_prediction,
    train_counting,
)


@pytest.mark.parametrize(
    ("world", "option"), [(2, ""), (4, ""), (4, "hsdp"), (2, "bucketed"), (2, "torch-zeros")]
)
def test_experts_idle_on_some_ranks_train_like_the_reference(world: int, option: str) -> None:
    results = run_threaded(world, _train, option)
    # The case is the one the test is about: some expert was idle on this rank but used on another.
    assert all(r["idle_somewhere"] > 0 for r in results)


# ---- parameters no rank used are not sent -----------------------------------------------------------


def test_parameters_no_rank_used_are_not_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = Sizes()
    monkeypatch.setattr(dist, RS_NAME, sizes)
    for result in run_threaded(2, train_counting, sizes, False):
        check_left_out(result)


def test_a_weight_read_outside_its_module_still_reaches_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sizes = Sizes()
    monkeypatch.setattr(dist, RS_NAME, sizes)
    for result in run_threaded(2, train_counting, sizes, True):
        check_wrong_prediction(result)


def _dense_agreements(steps: int) -> list[int]:
    """Per backward, the all-reduces of a model whose submodules all run on every rank."""
    model = fill_deterministic_(nn.Sequential(nn.Linear(DIM, DIM), nn.Sequential(nn.Linear(DIM, DIM))))
    fsdp2.fully_shard(model[1])
    fsdp2.fully_shard(model)
    agreements = []
    for step in range(steps):
        with fsdp2.testing.count_collectives() as counts:
            model(_batch(step)).sum().backward()
        agreements.append(counts["all_reduce"])
    return agreements


def test_a_model_whose_submodules_all_run_everywhere_agrees_once() -> None:
    # The first backward agrees (nothing has signalled yet); then the usage rows never show an idle
    # submodule, and the collectives are exactly torch's.
    for agreements in run_threaded(2, _dense_agreements, 4):
        assert agreements == [1, 0, 0, 0]


def _accumulate(sizes: Sizes) -> list[list[int]]:
    """Two micro-batches per step, gradient sync on the second only; gradients against the reference.

    An expert used in either micro-batch on any rank must be reduced; one used in neither is left out.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _model()
    ref = copy.deepcopy(model)
    fsdp2.fully_shard(model.moe)
    fsdp2.fully_shard(model)
    rows = []
    for step in range(3):
        before = len(sizes.by_rank.get(rank, []))
        for micro in range(2):
            model.set_requires_gradient_sync(micro == 1)
            x = _batch(10 * step + micro)
            model(x).square().sum().backward()
            ref(x).square().sum().backward()
        expected = _reference_grads(ref)
        _check_grads(model, expected, step)
        rows.append([n // world for n in sizes.by_rank[rank][before:]])
        model.zero_grad()
        ref.zero_grad()
    return rows


def test_accumulation_leaves_out_only_what_no_micro_batch_used(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = Sizes()
    monkeypatch.setattr(dist, RS_NAME, sizes)
    full = _moe_row(MoE(), 2, set())
    for rows in run_threaded(2, _accumulate, sizes):
        # The no-sync backwards reduce nothing; the synced one sends the MoE group, then the root's.
        assert all(len(step_rows) == 2 for step_rows in rows)
        # from the first backward that reduces on: the never-routed expert at least is left out
        assert all(step_rows[0] < full for step_rows in rows)


def test_a_wrong_prediction_is_exact_with_bucketing(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = Sizes()
    monkeypatch.setattr(dist, RS_NAME, sizes)
    # train_counting checks every gradient against the reference
    for result in run_threaded(2, train_counting, sizes, True, "cpu", True):
        # One bucketed reduce-scatter per step (MoE and root groups), and in step 0 the weight read
        # outside its expert reduced after the fact
        assert [len(rows) for rows in result["sent"]] == [2, 1, 1]


class _Blocks(nn.Module):
    """Three ``Linear`` blocks, with or without a ``head`` left in the root's group (a submodule there)."""

    def __init__(self, head: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 8) if head else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _counts_per_step(head: bool, impl: str) -> list[dict[str, int]]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    shard = fsdp2.fully_shard if impl == "fsdp2" else torch_fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = _Blocks(head)
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    steps = []
    for _ in range(3):
        with fsdp2.testing.count_collectives() as counts:
            model(torch.ones(4, 8)).sum().backward()
        steps.append(dict(counts))
    return steps


@pytest.mark.parametrize("head", [False, True])
def test_the_first_backward_agrees_only_where_a_group_tracks_a_submodule(head: bool) -> None:
    """docs/collectives.md: a root + 3 Linear blocks issues exactly torch's collectives; with a head
    in the root's group (a tracked submodule), one all-reduce more in the first backward only."""
    torch_counts = run_threaded(2, _counts_per_step, head, "torch")[0]
    ours = run_threaded(2, _counts_per_step, head, "fsdp2")[0]
    extra = [step.pop("all_reduce", 0) for step in ours]
    assert ours == torch_counts
    assert extra == ([1, 0, 0] if head else [0, 0, 0])
