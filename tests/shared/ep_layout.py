"""Experts on an ``ep`` mesh next to dense parameters on the data-parallel mesh, as torchtitan lays them out.

A model of mixture-of-experts branches and its meshes, shared by the hook-order, clipping and
checkpoint tests of expert meshes. The stacked expert weights ``[E, ...]`` are DTensors ``Shard(0)`` on
``mesh["ep"]`` of an ``(efsdp, ep)`` mesh; ``fully_shard`` shards them further over ``mesh["efsdp"]``
(a ``ShardPlacementResult`` with its own mesh info) and the rest over the dense mesh (every rank).

``Net`` runs its branches in ``Net.order`` (a list of branch indices) and sums their outputs in index
order: autograd runs the branch computed last first, so the order of the post-backward hooks follows
``order`` (reversed) while every number stays the same. The branches read disjoint columns of one
``split``, so the gradient of the shared input is assembled in one node whatever the order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import fsdp2
from tests._impls import get_impl
from tests._training import fill_deterministic_

DIM, HIDDEN, TOKENS = 4, 6, 5


class GroupedExperts(nn.Module):
    """Stacked expert weights, computed on local tensors (as torchtitan's ``GroupedExperts``)."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, HIDDEN, DIM))
        self.w2 = nn.Parameter(torch.empty(experts, DIM, HIDDEN))

    def forward(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """``x``: ``[T, D]`` tokens; ``gates``: ``[T, E_local]``, zero where a token is not routed."""
        w1, w2 = self.w1, self.w2
        if isinstance(w1, DTensor) and isinstance(w2, DTensor):
            w1, w2 = w1.to_local(), w2.to_local()
        h = torch.relu(torch.einsum("td,efd->etf", x, w1))
        return torch.einsum("etf,edf,te->td", h, w2, gates)


class MoE(nn.Module):
    """Top-1 routing; with ``ep_group`` set, this rank's experts see the tokens of every ``ep`` rank."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.router = nn.Linear(DIM, experts, bias=False)
        self.experts = GroupedExperts(experts)
        self.ep_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.router(x).softmax(-1)
        gates = scores * nn.functional.one_hot(scores.argmax(-1), self.num_experts)
        if self.ep_group is None:
            return x + self.experts(x, gates)
        group, rank = self.ep_group, dist.get_rank(self.ep_group)
        local = self.num_experts // dist.get_world_size(group)
        tokens = funcol.all_gather_single_autograd(x, 0, group)
        all_gates = funcol.all_gather_single_autograd(gates, 0, group)[:, rank * local : (rank + 1) * local]
        out = self.experts(tokens, all_gates)
        return x + funcol.reduce_scatter_single_autograd(out, "sum", 0, group)


class Net(nn.Module):
    """``inp`` -> ``branches`` MoE blocks side by side, run in ``order`` -> the sum -> ``head``."""

    def __init__(self, experts: int, branches: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, branches * DIM)
        self.blocks = nn.ModuleList(MoE(experts) for _ in range(branches))
        self.head = nn.Linear(DIM, DIM)
        self.order = list(range(branches))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inputs = self.inp(x).split(DIM, dim=-1)
        outputs: list[torch.Tensor | None] = [None] * len(self.blocks)
        for index in self.order:
            outputs[index] = self.blocks[index](inputs[index])
        return self.head(torch.stack([out for out in outputs if out is not None]).sum(0))


def build(experts: int, branches: int = 2) -> Net:
    """The same values on every rank and call."""
    return fill_deterministic_(Net(experts, branches), scale=0.5)


def meshes(ep: int) -> tuple[DeviceMesh | None, DeviceMesh]:
    """The ``(efsdp, ep)`` mesh of the experts (``None`` at ``ep`` 1) and the dense mesh (every rank)."""
    world = dist.get_world_size()
    dense = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    if ep == 1:
        return None, dense
    return init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep")), dense


def shard(model: Net, mesh: DeviceMesh | None, dense: DeviceMesh, impl: str = "fsdp2") -> Net:
    """Experts ``Shard(0)`` on ``ep`` (torchtitan's ``ExpertParallel``), then ``fully_shard`` on both meshes.

    Without an expert mesh (``ep`` 1, as torchtitan runs without expert parallelism) the experts are
    plain parameters sharded over the dense mesh like the rest. ``impl``: ``"fsdp2"`` or ``"torch"``
    (torch's private mesh-info objects, as torchtitan builds them).
    """
    fully_shard, result = get_impl(impl).fully_shard, fsdp2.ShardPlacementResult
    if mesh is None:
        for block in model.blocks:
            fully_shard(block, mesh=dense)
        fully_shard(model, mesh=dense)
        return model
    expert_info: Any = fsdp2.FSDPMeshInfo(mesh["efsdp"])
    dense_info: Any = fsdp2.FSDPMeshInfo(dense)
    if impl == "torch":
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
        from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

        expert_info, dense_info = _get_mesh_info(mesh["efsdp"]), _get_mesh_info(dense)
        result = ShardPlacementResult
    for block in model.blocks:
        assert isinstance(block, MoE)
        for name, param in list(block.experts.named_parameters()):
            placed = distribute_tensor(param.detach(), mesh["ep"], [Shard(0)])
            setattr(block.experts, name, nn.Parameter(placed))
        block.ep_group = mesh["ep"].get_group()
        experts = set(block.experts.parameters())

        def place(param: nn.Parameter, experts: set[nn.Parameter] = experts) -> Any:
            info = expert_info if param in experts else dense_info
            return result(placement=Shard(0), mesh_info=info)

        fully_shard(block, mesh=dense, shard_placement_fn=place)
    fully_shard(model, mesh=dense)
    return model


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(100 * step + rank))


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def reference_backward(ref: Net, world: int, step: int) -> None:
    """The reference's gradients: of the mean over every rank's loss at ``step`` (no collective).

    Works the same whatever the world size the sharded model runs at (a resumed run at another one).
    """
    for rank in range(world):
        (loss_of(ref(batch(rank, step))) / world).backward()


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient as a full tensor (a collective for DTensors)."""
    out = {}
    for name, param in model.named_parameters():
        grad = param.grad
        assert grad is not None, name
        out[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad.detach().clone()
    return out


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
        for name, p in model.named_parameters()
    }
