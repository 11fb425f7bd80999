"""Muon on expert stacks (``[E, m, n]``): each ``[m, n]`` matrix orthogonalised once, on a rank that holds it.

The reference is the unsharded model whose stacks step with ``torch.optim.Muon`` over ``E`` separate
2-D parameters per stack (torch's own Muon math per matrix), each step's gradients averaged across
ranks; fsdp2 steps the sharded model with ``fsdp2.StackedMuon`` (torch's ``Muon`` refuses 3-D
parameters). fp32 parameters are compared bit for bit after 3 steps. Layouts:
- plain FSDP over the data-parallel mesh, ``Shard(0)`` (whole experts per rank: no collective in the
  step; E=2 at 4 ranks leaves two ranks without rows, E=3 at 2 ranks is uneven) and ``Shard(1)``
  (each expert's rows split: one exchange there and back, 6 rows at 4 ranks leave a rank without rows);
- experts placed on an ``ep`` mesh (``Shard(0)``) and sharded by ``fully_shard`` over ``efsdp``, as
  torchtitan places them: ``Shard(0)`` of the local stack (one local expert over 2 efsdp ranks: an
  empty shard) and ``Shard(1)`` (its local stack shorter than, or as long as, the efsdp size); and
  HSDP, 2 replicas of efsdp 1 x ep 2 (each replica steps its experts, nothing travels).
Errors: what is neither a matrix nor a stack, when built; a stack with its columns sharded, at the
step, before anything changes.
The matmul FLOPs of the step, summed over the ranks, equal the unsharded step's: each matrix is
orthogonalised once.
"""

from __future__ import annotations

import collections
import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils.flop_counter import FlopCounterMode

import fsdp2
from tests._harness import count_collectives, run_threaded
from tests._training import fill_deterministic_

EXACT = {"rtol": 0, "atol": 0}
DIM, HIDDEN, TOKENS, STEPS = 4, 6, 5, 3


class _Stacks(nn.Module):
    """Two expert stacks, one of tall matrices (``[E, 6, 4]``) and one of wide (``[E, 4, 6]``)."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, HIDDEN, DIM))
        self.w2 = nn.Parameter(torch.empty(experts, DIM, HIDDEN))
        self.part = slice(None)  # the reference's experts of this rank (an ep rank's slice of E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, w2 = self.w1, self.w2
        if isinstance(w1, DTensor) and isinstance(w2, DTensor):  # the stack of this rank's ep slice
            w1, w2 = w1.to_local(), w2.to_local()
        else:
            w1, w2 = w1[self.part], w2[self.part]
        return torch.einsum("etf,edf->td", torch.tanh(torch.einsum("td,efd->etf", x, w1)), w2)


class _Net(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.moe = _Stacks(experts)
        self.head = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.head(h + self.moe(h))


class _PerMatrixMuon:
    """The reference: ``torch.optim.Muon`` over each stack's ``E`` matrices as separate parameters."""

    def __init__(self, stacks: list[nn.Parameter], **settings: Any) -> None:
        self.stacks = stacks
        self.matrices = [[nn.Parameter(s.detach()[e].clone()) for e in range(s.shape[0])] for s in stacks]
        self.muon = torch.optim.Muon([m for ms in self.matrices for m in ms], **settings)

    def step(self) -> None:
        for stack, matrices in zip(self.stacks, self.matrices, strict=True):
            assert stack.grad is not None
            for e, matrix in enumerate(matrices):
                matrix.grad = stack.grad[e].clone()
        self.muon.step()
        with torch.no_grad():
            for stack, matrices in zip(self.stacks, self.matrices, strict=True):
                stack.copy_(torch.stack(matrices))


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(100 * step + rank))


def _shard(model: _Net, mesh: str, placement: Shard, ep: int) -> Any:
    """fsdp2 over the model: the stacks ``placement``-sharded over the data-parallel or ``efsdp`` mesh."""
    world = dist.get_world_size()
    dense = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    if mesh == "dp":
        info = fsdp2.FSDPMeshInfo(dense)
    else:  # as torchtitan's ExpertParallel: Shard(0) on ep, then fully_shard over efsdp
        hsdp = mesh == "ep-hsdp"  # 2 replicas of efsdp 1, as torchtitan's dp_replicate 2
        sparse = init_device_mesh(
            "cpu",
            (2, world // ep // 2, ep) if hsdp else (world // ep, ep),
            mesh_dim_names=("rep", "efsdp", "ep") if hsdp else ("efsdp", "ep"),
        )
        for name in ("w1", "w2"):
            placed = distribute_tensor(getattr(model.moe, name).detach(), sparse["ep"], [Shard(0)])
            setattr(model.moe, name, nn.Parameter(placed))
        info = fsdp2.HSDPMeshInfo(sparse["rep", "efsdp"]) if hsdp else fsdp2.FSDPMeshInfo(sparse["efsdp"])
    stacks = {model.moe.w1, model.moe.w2}

    def place(param: nn.Parameter) -> Any:
        return fsdp2.ShardPlacementResult(placement, info) if param in stacks else None

    fsdp2.fully_shard(model.moe, mesh=dense, shard_placement_fn=place)
    fsdp2.fully_shard(model, mesh=dense)
    return dense


def _optimizers(model: _Net, stacked: Any) -> list[Any]:
    """Muon for the stacks (``stacked``'s class), Muon for the dense matrices, AdamW for the biases."""
    stacks = [model.moe.w1, model.moe.w2]
    matrices = [model.inp.weight, model.head.weight]
    rest = [model.inp.bias, model.head.bias]
    return [
        stacked(stacks, lr=0.02),
        torch.optim.Muon(matrices, lr=0.02),
        torch.optim.AdamW(rest, lr=1e-2),
    ]


def _run(experts: int, mesh: str, placement: Shard, ep: int = 2) -> dict[str, Any]:
    rank = dist.get_rank()
    base = fill_deterministic_(_Net(experts), scale=0.5)
    ref, model = base, copy.deepcopy(base)
    initial = {name: param.detach().clone() for name, param in base.named_parameters()}
    if mesh != "dp":  # the reference computes with this rank's ep slice of the experts, as fsdp2's
        local = experts // ep
        ref.moe.part = slice((rank % ep) * local, (rank % ep + 1) * local)
    _shard(model, mesh, placement, ep)
    ref_optims = _optimizers(ref, _PerMatrixMuon)
    optims = _optimizers(model, fsdp2.StackedMuon)
    out: dict[str, Any] = {"counts": collections.Counter(), "flops": 0, "ref_flops": 0}
    out["local_experts"] = model.moe.w1.to_local().shape[0]
    for step in range(STEPS):
        x = _batch(rank, step)
        model(x).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        for param in ref.parameters():
            assert param.grad is not None
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
        with count_collectives(by_group_size=True) as counts, FlopCounterMode(display=False) as flops:
            optims[0].step()
        out["counts"] += counts
        out["flops"] += flops.get_total_flops()
        with FlopCounterMode(display=False) as ref_flops:
            ref_optims[0].step()
        out["ref_flops"] += ref_flops.get_total_flops()
        for optim in [*optims[1:], *ref_optims[1:]]:
            optim.step()
        for module in (model, ref):
            module.zero_grad()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.full_tensor(), ref.get_parameter(name), **EXACT, msg=name)
        assert not torch.equal(param.full_tensor(), initial[name]), name  # it trained
    state = optims[0].state[model.moe.w1]["momentum_buffer"]
    assert isinstance(state, DTensor)
    assert state.placements == model.moe.w1.placements
    return out


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize(
    ("world", "experts", "placement", "exchanges"),  # exchanges: per step
    [(2, 4, Shard(0), 0), (4, 2, Shard(0), 0), (2, 3, Shard(0), 0), (2, 3, Shard(1), 2)],
    ids=["whole-experts", "empty-shards", "uneven", "rows-split"],
)
def test_stacks_sharded_over_the_data_parallel_mesh(
    world: int, experts: int, placement: Shard, exchanges: int
) -> None:
    results = run_threaded(world, _run, experts, "dp", placement)
    for result in results:
        # Whole experts on each rank: nothing travels. Split rows: an exchange there and back, each
        # an all-to-all and the all-reduce checking its sizes, over the data-parallel ranks.
        n = exchanges * STEPS
        expected = {("all_to_all", world): n, ("all_reduce", world): n} if exchanges else {}
        assert dict(result["counts"]) == expected
    if placement.dim == 0:  # torch.chunk's rows: whole experts, none on the ranks past the last
        step = -(-experts // world)
        assert [r["local_experts"] for r in results] == [
            len(range(experts)[r * step : (r + 1) * step]) for r in range(world)
        ]
    assert sum(r["flops"] for r in results) == results[0]["ref_flops"]  # each matrix once
    assert max(r["flops"] for r in results) < results[0]["ref_flops"]  # shared out


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize(
    ("experts", "placement", "exchanges", "mesh"),  # exchanges: per step
    [
        (4, Shard(0), 0, "ep"),
        (2, Shard(0), 0, "ep"),
        (2, Shard(1), 2, "ep"),
        (4, Shard(1), 2, "ep"),
        (4, Shard(0), 0, "ep-hsdp"),
    ],
    ids=["whole-experts", "empty-shard", "one-local-expert-split", "rows-split", "hsdp"],
)
def test_stacks_placed_on_an_ep_mesh(experts: int, placement: Shard, exchanges: int, mesh: str) -> None:
    """4 ranks: efsdp 2 x ep 2 (each ep rank's stack sharded by fully_shard over its efsdp ranks), or
    rep 2 x efsdp 1 x ep 2 (HSDP: each replica steps its experts)."""
    results = run_threaded(4, _run, experts, mesh, placement)
    for result in results:  # split rows travel within the efsdp pair only
        n = exchanges * STEPS
        expected = {("all_to_all", 2): n, ("all_reduce", 2): n} if exchanges else {}
        assert dict(result["counts"]) == expected
    if (experts, placement) == (2, Shard(0)):
        assert sorted(r["local_experts"] for r in results) == [0, 0, 1, 1]
    replicas = 2 if mesh == "ep-hsdp" else 1
    assert sum(r["flops"] for r in results) == results[0]["ref_flops"] * replicas  # once (per replica)


def test_stacked_muon_steps_each_matrix_as_torch_muon_does() -> None:
    """Unsharded: a stack's matrices step as torch's Muon steps them as separate parameters."""
    gen = torch.Generator().manual_seed(0)
    for shape, settings in [
        ((3, 6, 4), {}),
        ((2, 4, 6), {"nesterov": False, "adjust_lr_fn": "match_rms_adamw"}),
    ]:
        stack = nn.Parameter(torch.randn(shape, generator=gen))
        matrix = nn.Parameter(torch.randn(5, 3, generator=gen))
        ref_stack, ref_matrix = copy.deepcopy(stack), copy.deepcopy(matrix)
        optim = fsdp2.StackedMuon([stack, matrix], lr=0.02, **settings)
        reference = _PerMatrixMuon([ref_stack], lr=0.02, **settings)
        ref_muon = torch.optim.Muon([ref_matrix], lr=0.02, **settings)
        for _ in range(STEPS):
            grad, grad2 = torch.randn(shape, generator=gen), torch.randn(5, 3, generator=gen)
            stack.grad, ref_stack.grad, matrix.grad, ref_matrix.grad = (
                grad,
                grad.clone(),
                grad2,
                grad2.clone(),
            )
            optim.step()
            reference.step()
            ref_muon.step()
        torch.testing.assert_close(stack, ref_stack, **EXACT)
        torch.testing.assert_close(matrix, ref_matrix, **EXACT)
        assert optim.state[stack]["momentum_buffer"].shape == shape


def test_stacked_muon_refuses_what_is_not_a_matrix_or_stack() -> None:
    with pytest.raises(ValueError, match=r"only supports 2D parameters"):  # torch's own Muon, for contrast
        torch.optim.Muon([nn.Parameter(torch.zeros(2, 3, 4))])
    with pytest.raises(ValueError, match=r"got a parameter of shape \(3,\)\. Give it to another optimizer"):
        fsdp2.StackedMuon([nn.Parameter(torch.zeros(3, 3)), nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match=r"Learning rate should be >= 0"):  # torch's own check of settings
        fsdp2.StackedMuon([nn.Parameter(torch.zeros(3, 3))], lr=-1.0)
    optim = fsdp2.StackedMuon([nn.Parameter(torch.zeros(3, 3))], 0.5)
    assert optim.defaults == torch.optim.Muon([nn.Parameter(torch.zeros(3, 3))], 0.5).defaults
    with pytest.raises(ValueError, match=r"shape \(1, 2, 3, 4\)"):
        optim.add_param_group({"params": nn.Parameter(torch.zeros(1, 2, 3, 4))})
    assert len(optim.param_groups) == 1  # nothing added


def _columns_sharded() -> None:
    model = fill_deterministic_(_Net(2), scale=0.5)
    _shard(model, "dp", Shard(2), 2)
    optim = fsdp2.StackedMuon([model.moe.w1, model.moe.w2], lr=0.02)
    model(_batch(dist.get_rank(), 0)).pow(2).mean().backward()
    before = [p.full_tensor() for p in (model.moe.w1, model.moe.w2)]
    with pytest.raises(ValueError, match=r"shape \(2, 6, 4\) is laid out as \(Shard\(dim=2\),\)"):
        optim.step()
    assert len(optim.state) == 0  # nothing changed: no momentum made, no parameter moved
    for param, value in zip((model.moe.w1, model.moe.w2), before, strict=True):
        torch.testing.assert_close(param.full_tensor(), value, **EXACT)


def test_a_stack_with_its_columns_sharded_is_refused_before_anything_changes() -> None:
    run_threaded(2, _columns_sharded)
