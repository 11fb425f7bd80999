"""A mixture-of-experts layer whose experts get tokens on some ranks only, and its runs, shared by the
conditional-compute, gloo and CUDA tests.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
import fsdp2.testing
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
