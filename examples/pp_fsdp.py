"""Pipeline parallelism with fsdp2: torch.distributed.pipelining stages sharded over data-parallel ranks.

Four CPU processes (gloo) form a (pp=2, dp=2) mesh. The model, a stack of residual MLP blocks, is cut
into pipeline stages; every block and every stage module is sharded with ``fsdp2.fully_shard`` over
``mesh["dp"]``; a pipelining schedule runs the micro-batches. The script trains a few steps and checks
on every step that the loss equals that of a plain unsharded copy of the model fed the same batches,
and at the end that every stage's parameters equal the copy's.

    torchrun --standalone --nproc-per-node 4 examples/pp_fsdp.py                    # 1F1B
    torchrun --standalone --nproc-per-node 4 examples/pp_fsdp.py --schedule ZBVZeroBubble

Schedules: GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble (the last three hold two
stages per pipeline rank). On GPUs the same script uses NCCL and one device per process.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, schedules

import fsdp2

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def stage_indices(schedule: str, pp_rank: int, pp_size: int) -> tuple[list[int], int]:
    """The stages this pipeline rank holds, and the number of stages."""
    if schedule in ("GPipe", "1F1B"):
        return [pp_rank], pp_size
    n_stages = 2 * pp_size
    if schedule == "ZBVZeroBubble":  # a V: rank 0 holds the first and the last stage
        return [pp_rank, n_stages - 1 - pp_rank], n_stages
    return [pp_rank, pp_rank + pp_size], n_stages  # looped: stage i on rank i % pp_size


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--schedule", choices=SCHEDULES, default="1F1B")
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=5, help="training steps (default: %(default)s)")
    parser.add_argument("--dim", type=int, default=32, help="model width (default: %(default)s)")
    parser.add_argument("--blocks", type=int, default=8, help="blocks in the model (default: %(default)s)")
    parser.add_argument("--microbatches", type=int, default=4, help="per step (default: %(default)s)")
    args = parser.parse_args(argv)

    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    world = dist.get_world_size()
    if world % args.pp:
        raise SystemExit(f"--pp {args.pp} must divide the number of processes ({world})")
    mesh = init_device_mesh(device.type, (args.pp, world // args.pp), mesh_dim_names=("pp", "dp"))
    pp_mesh, dp_mesh = mesh["pp"], mesh["dp"]
    held, n_stages = stage_indices(args.schedule, pp_mesh.get_local_rank(), args.pp)
    if args.blocks % n_stages:
        raise SystemExit(f"--blocks {args.blocks} must be a multiple of the {n_stages} stages")
    per_stage = args.blocks // n_stages

    torch.manual_seed(0)  # every process builds the same initial model
    reference = nn.Sequential(*[Block(args.dim) for _ in range(args.blocks)]).to(device)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    batch = 2 * args.microbatches

    stages, stage_modules = [], []
    for index in held:
        first = index * per_stage
        module = copy.deepcopy(reference[first : first + per_stage])
        # Under pipelining every micro-batch runs forward then backward: keep the blocks gathered in
        # between (torchtitan does the same), rather than gathering them again for each backward.
        for block in module:
            fsdp2.fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
        fsdp2.fully_shard(module, mesh=dp_mesh, reshard_after_forward=False)
        stage_modules.append(module)
        example = torch.empty(batch // args.microbatches, args.dim, device=device)
        stages.append(
            PipelineStage(module, index, n_stages, device, group=pp_mesh.get_group(), input_args=(example,))
        )
    schedule_cls = getattr(schedules, f"Schedule{args.schedule}")
    single = issubclass(schedule_cls, schedules.PipelineScheduleSingle)
    schedule = schedule_cls(
        stages[0] if single else stages, n_microbatches=args.microbatches, loss_fn=F.mse_loss
    )
    optim = torch.optim.AdamW([p for m in stage_modules for p in m.parameters()], lr=1e-2)

    def data(dp_rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 * dp_rank + step)
        x, y = torch.randn(batch, args.dim, generator=gen), torch.randn(batch, args.dim, generator=gen)
        return x.to(device), y.to(device)

    losses = []
    for step in range(args.steps):
        x, target = data(dp_mesh.get_local_rank(), step)
        micro_losses: list[torch.Tensor] = []
        inputs = (x,) if 0 in held else ()
        outputs = {"target": target, "losses": micro_losses} if n_stages - 1 in held else {}
        schedule.step(*inputs, **outputs)
        optim.step()
        optim.zero_grad()
        # The unsharded reference: the same batches, the gradient averaged over data-parallel ranks
        # (micro-batches of equal size: the mean of their mean losses is the batch's mean loss).
        ref_losses = [
            F.mse_loss(reference(d[0]), d[1]) for d in (data(r, step) for r in range(dp_mesh.size()))
        ]
        (sum(ref_losses) / len(ref_losses)).backward()
        ref_optim.step()
        ref_optim.zero_grad()
        if micro_losses:  # the ranks that hold the last stage
            loss = torch.stack(micro_losses).mean()
            torch.testing.assert_close(loss, ref_losses[dp_mesh.get_local_rank()])
            losses.append(loss.item())
            if dp_mesh.get_local_rank() == 0:
                print(f"step {step}: loss {loss.item():.4f} (unsharded reference {ref_losses[0].item():.4f})")
    # A slice of a Sequential keeps the block numbers in its names. The tolerance is 1% of one AdamW
    # step (lr 1e-2): the pipeline sums micro-batch gradients in another order than the reference's
    # one batch, and AdamW divides by the root of the squared gradient, so an element whose gradient
    # is near zero moves by a different fraction of lr (seen: 3e-5 on an AMD EPYC CPU, AVX2).
    for module in stage_modules:
        for name, param in module.named_parameters():
            torch.testing.assert_close(
                param.full_tensor(), reference.get_parameter(name), atol=1e-4, rtol=1e-4
            )
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"{args.schedule}: every stage's parameters equal the unsharded reference after training")
    return losses


if __name__ == "__main__":
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        main()
    finally:
        gc.collect()
        dist.destroy_process_group()
