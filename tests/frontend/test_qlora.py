"""QLoRA: torchao's ``NF4Tensor`` base weights (frozen) with trainable LoRA adapters, sharded.

torch's ``fully_shard`` shards an ``NF4Tensor`` with the tensor's own ops (chunk, new_zeros, narrow,
copy_, view(-1)) and gathers it through its ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` hooks.
fsdp2 does the same; the runs below are compared with torch's, bit for bit, and with the unsharded
model (gradients averaged across ranks by hand), at world 2, world 4 and HSDP (2 x 2).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from tests._harness import run_threaded
from tests._impls import get_impl

nf4 = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")

ROWS, COLS, RANK = 512, 256, 8  # NF4: blocks of 64 values, scalers in blocks of 256 (8 per weight)


class LoRALinear(nn.Module):
    """A frozen NF4 base weight plus a trainable low-rank update, as QLoRA (PEFT, torchtune) builds it."""

    def __init__(self, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(nf4.to_nf4(weight, 64, 256), requires_grad=False)
        self.lora_a = nn.Parameter(a.clone())
        self.lora_b = nn.Parameter(b.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nf4.linear_nf4(x, self.weight) + (x @ self.lora_a.t()) @ self.lora_b.t()


class Net(nn.Module):
    def __init__(self, tensors: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LoRALinear(*t) for t in tensors)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))[:, :COLS]
        return x


def _tensors() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)  # built once, in the main thread (rank threads share the RNG)
    return [
        (
            torch.randn(ROWS, COLS).bfloat16(),
            (torch.randn(RANK, COLS) * 0.05).bfloat16(),
            (torch.randn(ROWS, RANK) * 0.05).bfloat16(),
        )
        for _ in range(2)
    ]


def _inputs(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, COLS, generator=torch.Generator().manual_seed(100 * rank + step)).bfloat16()


def _train(impl_name: str, tensors: Any, hsdp: bool) -> tuple[list[Any], list[Any], list[Any]]:
    """Three AdamW steps; returns (losses, the full LoRA weights at the end, the first gradients)."""
    impl = get_impl(impl_name)
    world = dist.get_world_size()
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    model = Net(tensors)
    for layer in model.layers:
        impl.fully_shard(layer, mesh=mesh)
    impl.fully_shard(model, mesh=mesh)
    assert type(model.layers[0].weight.to_local()).__name__ == "NF4Tensor"
    trainable = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(trainable, lr=1e-2)
    losses, first_grads = [], []
    for step in range(3):
        loss = model(_inputs(dist.get_rank(), step)).float().pow(2).mean()
        loss.backward()
        if step == 0:
            first_grads = [p.grad.full_tensor() for p in trainable]
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    return losses, [p.full_tensor() for p in trainable], first_grads


def _reference_grads(tensors: Any, world: int) -> list[torch.Tensor]:
    """The unsharded model's first gradients, averaged over the ranks' inputs (fp32 sum, then bf16)."""
    model = Net(tensors)
    trainable = [p for p in model.parameters() if p.requires_grad]
    per_rank = []
    for rank in range(world):
        model(_inputs(rank, 0)).float().pow(2).mean().backward()
        per_rank.append([p.grad.float() for p in trainable])
        for param in trainable:
            param.grad = None
    return [torch.stack(g).sum(0).div(world).bfloat16() for g in zip(*per_rank, strict=True)]


@pytest.mark.parametrize(("world", "hsdp"), [(2, False), (4, False), (4, True)], ids=["w2", "w4", "hsdp"])
def test_nf4_qlora_trains_like_torch_and_the_unsharded_model(world: int, hsdp: bool) -> None:
    tensors = _tensors()
    ours = run_threaded(world, _train, "fsdp2", tensors, hsdp)
    theirs = run_threaded(world, _train, "torch", tensors, hsdp)
    for (losses, params, grads), (ref_losses, ref_params, ref_grads) in zip(ours, theirs, strict=True):
        torch.testing.assert_close(losses, ref_losses, rtol=0, atol=0)
        for param, ref_param in zip(params + grads, ref_params + ref_grads, strict=True):
            torch.testing.assert_close(param, ref_param, rtol=0, atol=0)
    # bf16 gradients, reduced in another order than the unsharded sum: within a bf16 ulp or two
    for grad, plain in zip(ours[0][2], _reference_grads(tensors, world), strict=True):
        torch.testing.assert_close(grad, plain, rtol=1.6e-2, atol=1e-5)


def _uneven_rows_refused() -> None:
    torch.manual_seed(0)
    layer = LoRALinear(torch.randn(ROWS, COLS).bfloat16(), torch.zeros(RANK, COLS), torch.zeros(ROWS, RANK))
    before = dict(layer.named_parameters())
    expected = r"parameter LoRALinear.weight: its NF4Tensor of shape \(512, 256\) failed an op"
    with pytest.raises(NotImplementedError, match=expected):
        get_impl("fsdp2").fully_shard(layer)
    assert dict(layer.named_parameters()) == before  # nothing changed
    assert type(layer.weight).__name__ != "DTensor"


def test_nf4_weight_that_cannot_split_over_the_ranks_is_refused_before_any_change() -> None:
    """512 rows over 3 ranks: NF4's split needs whole quantization blocks per rank."""
    run_threaded(3, _uneven_rows_refused)
