"""2-D parallelism: tensor parallel inside each block, fsdp2 across data-parallel ranks.

Four CPU processes (gloo) form a (dp=2, tp=2) mesh. Each block's linears are split column-wise /
row-wise over ``mesh["tp"]`` with torch's ``parallelize_module``; ``fsdp2.fully_shard`` then shards
the TP-local weights over ``mesh["dp"]``. The script trains a few steps and checks on every step that
the loss equals that of a plain unsharded copy of the model fed the same data-parallel batches.

    torchrun --standalone --nproc-per-node 4 examples/tp_fsdp.py
    torchrun --standalone --nproc-per-node 8 examples/tp_fsdp.py --hsdp   # (replicate=2, shard=2, tp=2)

On GPUs the same script uses NCCL and one device per process.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fsdp2


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, dim: int, n_blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=5, help="training steps (default: %(default)s)")
    parser.add_argument("--dim", type=int, default=32, help="model width (default: %(default)s)")
    parser.add_argument("--hsdp", action="store_true", help="3-D mesh: (replicate=2, shard, tp=2)")
    args = parser.parse_args(argv)

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device_type = "cuda" if use_cuda else "cpu"
    world = dist.get_world_size()
    if args.hsdp:
        if world % 4:
            raise SystemExit(f"--hsdp needs a multiple of 4 processes, got {world}")
        mesh = init_device_mesh(device_type, (2, world // 4, 2), mesh_dim_names=("replicate", "shard", "tp"))
        dp_mesh, dp_rank = mesh["replicate", "shard"], mesh.get_local_rank("replicate") * (world // 4)
        dp_rank += mesh.get_local_rank("shard")
    else:
        if world % 2:
            raise SystemExit(f"needs an even number of processes (tp=2), got {world}")
        mesh = init_device_mesh(device_type, (world // 2, 2), mesh_dim_names=("dp", "tp"))
        dp_mesh, dp_rank = mesh["dp"], mesh.get_local_rank("dp")

    torch.manual_seed(0)  # every process builds the same initial model
    model = Model(args.dim, n_blocks=2).to(device_type)
    reference = copy.deepcopy(model)  # plain, unsharded: what the 2-D model must compute
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fsdp2.fully_shard(block, mesh=dp_mesh)
    fsdp2.fully_shard(model, mesh=dp_mesh)

    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses = []
    for step in range(args.steps):
        # TP ranks of one data-parallel rank see the same batch; data-parallel ranks see different ones.
        gen = torch.Generator().manual_seed(1000 * dp_rank + step)
        x = torch.randn(8, args.dim, generator=gen).to(device_type)
        loss = model(x).pow(2).mean()
        loss.backward()
        ref_loss = reference(x).pow(2).mean()
        ref_loss.backward()
        for param in reference.parameters():  # what data parallelism averages
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
        torch.testing.assert_close(loss, ref_loss)
        for o in (optim, ref_optim):
            o.step()
            o.zero_grad()
        losses.append(loss.item())
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f} (unsharded reference {ref_loss.item():.4f})")
    for param, ref_param in zip(model.parameters(), reference.parameters(), strict=True):
        # Tensor parallelism splits each matmul's sum, so the last bits differ from the unsharded run;
        # AdamW's normalisation can lift those to ~1e-5 in a weight after a few steps.
        torch.testing.assert_close(param.full_tensor(), ref_param, atol=1e-4, rtol=1e-4)
    if dist.get_rank() == 0:
        weight = model.blocks[0].up.weight
        print(f"blocks.0.up.weight: {weight.placements} on mesh {tuple(weight.device_mesh.shape)}")
        print("parameters equal the unsharded reference after training")
    return losses


if __name__ == "__main__":
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        main()
    finally:
        gc.collect()
        dist.destroy_process_group()
