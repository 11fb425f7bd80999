"""Tree-ordered reductions' layouts and runs, shared by their thread-rank and gloo tests."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp2
from fsdp2.testing import record_collectives
from tests._training import EXACT, fill_deterministic_

BF16, FP32 = torch.bfloat16, torch.float32


def _model() -> nn.Sequential:
    """Two blocks with dims the world size does not divide (padding on the wire too)."""
    model = nn.Sequential(nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))
    return fill_deterministic_(model, scale=0.5)  # the same in every run (threads share torch's RNG)


def _shard(model: nn.Sequential, mesh: Any = None, **kwargs: Any) -> nn.Sequential:
    fsdp2.fully_shard(model[0], mesh=mesh, **kwargs)
    fsdp2.fully_shard(model[2], mesh=mesh, **kwargs)
    fsdp2.fully_shard(model, mesh=mesh, **kwargs)
    return model


def _batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(4, 6, generator=gen)


class CountAdds(TorchDispatchMode):
    """Counts the tensor adds (``aten.add`` / ``aten.add_``) dispatched inside the block (this thread)."""

    ADDS = frozenset({torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor})

    def __init__(self) -> None:
        super().__init__()
        self.adds = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.adds += func in self.ADDS
        return func(*args, **(kwargs or {}))


def pairwise_tree(values: list[torch.Tensor]) -> torch.Tensor:
    """``values`` summed in fp32 by the pairwise tree: neighbours added level by level, an odd last
    one carried up (4 values: ``(v0 + v1) + (v2 + v3)``; 3: ``(v0 + v1) + v2``)."""
    level = [v.to(FP32) for v in values]
    while len(level) > 1:
        pairs = [level[i] + level[i + 1] for i in range(0, len(level) - 1, 2)]
        level = pairs + level[len(pairs) * 2 :]
    return level[0]


def _tree_ordered_mean(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient of every rank summed by the pairwise tree in global rank order (fp32), averaged.

    What a tree-ordered reduction gives on ``W`` FSDP ranks, and on ``R x W`` HSDP ranks numbered
    replica-major when ``W`` is a power of two (see ``fsdp2/group/_ordered.py``).
    """
    world = dist.get_world_size()
    means = []
    for grad in grads:
        gathered = [torch.empty_like(grad) for _ in range(world)]
        dist.all_gather(gathered, grad)
        means.append(pairwise_tree(gathered).div_(world))
    return means


def _wire(
    wire: torch.dtype | None, hsdp: bool = False
) -> tuple[list[torch.Tensor], list[torch.Tensor], int, int]:
    model = _model()
    ref = copy.deepcopy(model).to(BF16)  # what fsdp2 computes with param_dtype=bf16
    policy = fsdp2.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, wire_dtype=wire)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    _shard(model, mesh, mp_policy=policy)
    x = _batch(0)
    with record_collectives(model) as log:
        model(x).sum().backward()
    ref(x.to(BF16)).sum().backward()
    expected = _tree_ordered_mean([p.grad for p in ref.parameters()])
    got = [p.grad.full_tensor() for p in model.parameters()]
    reduce_kind = "reduce_scatter" if wire is None else "all_to_all"
    return got, expected, log.sent_bytes(reduce_kind), log[reduce_kind]


LAYOUTS = ["fsdp", "fsdp-bucketed", "fsdp-prefetch-no-reshard", "hsdp"]


def _deterministic(layout: str, steps: int = 3) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    model = _model()
    ref = copy.deepcopy(model)
    mesh = None
    kwargs: dict[str, Any] = {}
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    if layout == "fsdp-prefetch-no-reshard":
        kwargs["reshard_after_forward"] = False
    _shard(model, mesh, **kwargs)
    if layout == "fsdp-bucketed":
        model.set_bucket_cap_mb(all_gather=1.0, reduce_scatter=1.0)
    if layout == "fsdp-prefetch-no-reshard":
        model[0].set_modules_to_forward_prefetch([model[2]])
        model[2].set_modules_to_backward_prefetch([model[0]])
    model.set_deterministic_reduction()
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    first_grads: list[torch.Tensor] = []
    for step in range(steps):
        x = _batch(step)
        model(x).square().sum().backward()
        if step == 0:
            ref(x).square().sum().backward()
            expected = _tree_ordered_mean([p.grad for p in ref.parameters()])
            first_grads = [p.grad.full_tensor() for p in model.parameters()]
            for got, want in zip(first_grads, expected, strict=True):
                torch.testing.assert_close(got, want, **EXACT)
        optim.step()
        optim.zero_grad()
    return first_grads, [p.full_tensor() for p in model.parameters()]
