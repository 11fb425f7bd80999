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
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
import fsdp2.testing
from tests._harness import run_threaded
from tests._training import fill_deterministic_

DIM, EXPERTS = 6, 8
UNUSED = EXPERTS - 1  # the router never picks it


class MoE(nn.Module):
    """Top-1 routing; an expert with no token on this rank is not called."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = self.router(x).softmax(-1)
        choice = gates.argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = choice == e
            if mask.any():
                out = out.index_put((mask,), expert(x[mask]) * gates[mask, e : e + 1])
        return x + out


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.moe = MoE()
        self.head = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(self.inp(x)))


def _model() -> Model:
    model = fill_deterministic_(Model(), scale=0.5)
    with torch.no_grad():
        model.moe.router.bias[UNUSED] = -100.0
    return model


def _batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(3, DIM, generator=gen)  # 3 tokens, 8 experts: most experts idle on each rank


def _reference_grads(ref: nn.Module) -> list[torch.Tensor | None]:
    world = dist.get_world_size()
    grads: list[torch.Tensor | None] = []
    for param in ref.parameters():
        used = torch.tensor([0 if param.grad is None else 1])
        dist.all_reduce(used)
        if used.item() == 0:
            grads.append(None)
            continue
        grad = torch.zeros_like(param) if param.grad is None else param.grad.clone()
        dist.all_reduce(grad)
        grads.append(grad / world)
    return grads


def _check_grads(model: nn.Module, expected: list[torch.Tensor | None], step: int) -> None:
    """fsdp2's sharded gradients against the reference's (``None``: no rank used the parameter)."""
    for (name, param), want in zip(model.named_parameters(), expected, strict=True):
        if want is None:
            assert param.grad is None, f"step {step}: {name} was used by no rank but got a gradient"
        else:
            torch.testing.assert_close(param.grad.full_tensor(), want, rtol=1e-5, atol=1e-6)


def _train(option: str, steps: int = 3) -> dict[str, Any]:
    model = _model()
    ref = copy.deepcopy(model)
    mesh = (
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if option == "hsdp" else None
    )
    fsdp2.fully_shard(model.moe, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    if option == "bucketed":
        model.set_bucket_cap_mb(all_gather=1.0, reduce_scatter=1.0)
    if option == "torch-zeros":
        model.set_reduce_scatter_unused_params(True)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=0.05)
    idle_somewhere = 0
    for step in range(steps):
        x = _batch(step)
        model(x).square().sum().backward()
        ref(x).square().sum().backward()
        expected = _reference_grads(ref)
        for (name, param), ref_param, want in zip(
            model.named_parameters(), ref.parameters(), expected, strict=True
        ):
            idle_somewhere += int(
                name.startswith("moe.experts") and want is not None and ref_param.grad is None
            )
            if want is None and option == "torch-zeros":
                want = torch.zeros_like(ref_param)  # torch's set_reduce_scatter_unused_params(True)
            if want is None:
                assert param.grad is None, f"step {step}: {name} was used by no rank but got a gradient"
                continue
            torch.testing.assert_close(param.grad.full_tensor(), want, rtol=1e-5, atol=1e-6)
            ref_param.grad = want.clone()
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
    for param, ref_param in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(param.full_tensor(), ref_param, rtol=1e-5, atol=1e-6)
    return {"idle_somewhere": idle_somewhere}


@pytest.mark.parametrize(
    ("world", "option"), [(2, ""), (4, ""), (4, "hsdp"), (2, "bucketed"), (2, "torch-zeros")]
)
def test_experts_idle_on_some_ranks_train_like_the_reference(world: int, option: str) -> None:
    results = run_threaded(world, _train, option)
    # The case is the one the test is about: some expert was idle on this rank but used on another.
    assert all(r["idle_somewhere"] > 0 for r in results)


# ---- parameters no rank used are not sent -----------------------------------------------------------


# torch >= 2.10 names it reduce_scatter_single (fsdp2 looks it up at each call)
RS_NAME = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


class Sizes:
    """Records each reduce-scatter's input size, per rank (the threads share one patched function)."""

    def __init__(self) -> None:
        self.by_rank: dict[int, list[int]] = {}
        self.original = getattr(dist, RS_NAME)

    def __call__(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.by_rank.setdefault(dist.get_rank(), []).append(input.numel())
        return self.original(output, input, *args, **kwargs)


def _shard(param: torch.Tensor, world: int) -> int:
    """Elements of one rank's padded dim-0 shard of ``param``."""
    rows = -(-param.size(0) // world)
    return rows * (param.numel() // param.size(0))


def _moe_row(moe: MoE, world: int, unused: set[str]) -> int:
    """One rank's row of the MoE group's reduce-scatter input with ``unused`` parameters left out.

    Each packed parameter's shard, then one usage element per parameter, packed or left out, and one
    saying whether an expert was idle on the rank.
    """
    packed = [p for name, p in moe.named_parameters() if name not in unused]
    return sum(_shard(p, world) for p in packed) + len(packed) + len(unused) + 1


class _ReadsAnExpert(MoE):
    """Reads the never-routed expert's weight directly, outside that expert's forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 0.1 * self.experts[UNUSED].weight.sum()


def train_counting(
    sizes: Sizes, read_outside: bool, device: str = "cpu", bucketed: bool = False
) -> dict[str, Any]:
    """Three steps; the MoE group's reduce-scatter sizes against the parameters no rank used.

    ``read_outside``: rank 0 also reads the never-routed expert's weight in the MoE's own forward
    (outside the expert's forward), so fsdp2's prediction is wrong for it in the first step.
    ``device="cuda"``: the same on the GPU (``tests/gpu``). ``bucketed``: one reduce-scatter for both
    groups (``set_bucket_cap_mb``).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if device == "cuda":
        torch.cuda.set_device(0)
    model = _model().to(device)
    if read_outside and rank == 0:
        model.moe.__class__ = _ReadsAnExpert
    ref = copy.deepcopy(model)
    mesh = init_device_mesh(device, (world,))
    fsdp2.fully_shard(model.moe, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    if bucketed:
        model.set_bucket_cap_mb(all_gather=1.0, reduce_scatter=1.0)
    expected_rows, sent_rows, agreements, unused_sets = [], [], [], []
    for step in range(3):
        x = _batch(step).to(device)
        before = len(sizes.by_rank.get(rank, []))
        with fsdp2.testing.count_collectives() as counts:
            model(x).square().sum().backward()
        ref(x).square().sum().backward()
        expected = _reference_grads(ref)
        _check_grads(model, expected, step)
        unused = {
            name.removeprefix("moe.")
            for (name, _), want in zip(model.named_parameters(), expected, strict=True)
            if want is None and name.startswith("moe.experts")
        }
        # The MoE group's reduce-scatter, the root group's, then any reduction after the fact.
        sent_rows.append([n // world for n in sizes.by_rank[rank][before:]])
        unused_sets.append(unused)
        # From the first backward on: it agrees on what ran before its first reduction
        expected_rows.append(_moe_row(ref.moe, world, unused))
        agreements.append(counts["all_reduce"])
        model.zero_grad()
        ref.zero_grad()
    return {"sent": sent_rows, "expected": expected_rows, "agreements": agreements, "unused": unused_sets}


def check_left_out(result: dict[str, Any]) -> None:
    """One reduce-scatter for the MoE group per step, from the first without exactly the experts no
    rank routed to (every first backward agrees; later ones do while usage rows show idle experts)."""
    assert [rows[0] for rows in result["sent"]] == result["expected"]
    assert all(len(rows) == 2 for rows in result["sent"])  # then the root group's
    assert all(row < _moe_row(MoE(), 2, set()) for row in result["expected"])
    assert result["agreements"] == [1, 1, 1]  # one small all-reduce per backward


def check_wrong_prediction(result: dict[str, Any]) -> None:
    """A weight read outside its expert's forward on rank 0: one reduction after the fact, once."""
    sent, expected = result["sent"], result["expected"]
    # Step 0: the never-routed expert's weight is left out too (its module never ran), but rank 0
    # holds a gradient for it: after the root group's reduction, every rank reduces that weight
    # alone (gradients checked in train_counting against the reference).
    weight = f"experts.{UNUSED}.weight"
    assert sent[0][0] == _moe_row(MoE(), 2, result["unused"][0] | {weight})
    assert len(sent[0]) == 3
    assert sent[0][2] == _shard(MoE().experts[UNUSED].weight, 2) + 1
    # From then on that weight is always sent, and exactly what no rank used is left out: no more
    # reductions after the fact.
    for step in (1, 2):
        assert len(sent[step]) == 2
        assert sent[step][0] == expected[step]


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
