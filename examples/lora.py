"""LoRA fine-tuning of the example GPT with fsdp2: a frozen backbone gathered once, weights synced to
a plain "inference" copy that generates text.

    torchrun --standalone --nproc-per-node 2 examples/lora.py               # 2 CPU processes
    torchrun --standalone --nproc-per-node 2 examples/lora.py --base model.safetensors

The backbone is the GPT of examples/train.py: random (seeded) weights, or the weights train.py
exported (`--export model.safetensors`). Every Linear of every block gets a LoRA adapter (PEFT's
layout: the adapter sits inside the frozen module), only the adapters train, and:

- `fsdp2.keep_frozen_gathered` keeps the frozen weights unsharded once gathered (within
  `--keep-budget-mb` per rank), so each step all-gathers only the adapters;
- `fsdp2.WeightSync` sends the weights to the inference copy every `--sync-every` steps, in bf16:
  everything the first time, then only what changed (here: the adapters).
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2.testing import record_collectives

sys.path.insert(0, str(Path(__file__).resolve().parent))  # examples/train.py: the model and data
from train import DATA_DIR, GPT, CharData, GPTConfig, init_weights, setup_distributed


class LoRALinear(nn.Module):
    """``base(x) + x A^T B^T * scale``: ``base`` frozen, ``A`` and ``B`` trained (``B`` starts at zero)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) / base.in_features**0.5)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t() * self.scale


def add_lora(model: GPT, rank: int, alpha: float) -> None:
    """Freeze everything, then give every Linear of every block a trainable adapter."""
    model.requires_grad_(False)
    for block in model.blocks:
        for parent in (block.attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, LoRALinear(child, rank, alpha))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64, help="characters per sequence")
    p.add_argument("--dim", type=int, default=128, help="model width (as the exported model's)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--lora-rank", type=int, default=8, help="adapter rank")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate of the adapters")
    p.add_argument("--seed", type=int, default=1337, help="backbone seed (without --base)")
    p.add_argument("--base", type=str, default=None, help="backbone weights from train.py --export")
    p.add_argument("--keep-budget-mb", type=float, default=None, help="frozen bytes kept per rank (MiB)")
    p.add_argument("--sync-every", type=int, default=20, help="weight sync to the inference copy, steps")
    p.add_argument("--sample-chars", type=int, default=120, help="characters the inference copy writes")
    p.add_argument("--timeout", type=float, default=120.0, help="process-group timeout, seconds")
    args = p.parse_args(argv)
    if args.steps < 1 or args.sync_every < 1:
        p.error("--steps and --sync-every must be at least 1")
    return args


def build(args: argparse.Namespace, device: torch.device) -> tuple[CharData, GPT, GPT]:
    """The data, the sharded LoRA model and its plain bf16 inference copy (same names, zeros until synced)."""
    data = CharData(DATA_DIR)
    cfg = GPTConfig(data.vocab_size, args.seq_len, args.dim, args.layers, args.heads)
    model = GPT(cfg).to(device)
    if args.base:
        from safetensors.torch import load_file

        model.load_state_dict(load_file(args.base))
    else:
        init_weights(model, args.seed)
    torch.manual_seed(args.seed)  # the adapters: the same on every rank
    add_lora(model, args.lora_rank, alpha=2.0 * args.lora_rank)
    inference = GPT(cfg)
    add_lora(inference, args.lora_rank, alpha=2.0 * args.lora_rank)
    inference = inference.to(device, torch.bfloat16).eval()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    return data, model, inference


def load_weights(model: nn.Module, pairs: Any) -> None:
    """What an inference engine's ``load_weights`` does: dense tensors copied, sparse ones scattered."""
    with torch.no_grad():
        for name, tensor in pairs:
            target = model.get_parameter(name)
            if tensor.is_sparse:
                target[tuple(tensor.indices())] = tensor.values()  # coalesced
            else:
                target.copy_(tensor)


def generate(model: GPT, data: CharData, n_chars: int, device: torch.device, seed: int) -> str:
    gen = torch.Generator().manual_seed(seed)
    idx = [data.stoi["\n"]]
    with torch.no_grad():
        for _ in range(n_chars):
            context = torch.tensor([idx[-model.cfg.seq_len :]], device=device)
            probs = F.softmax(model(context)[0, -1].float().cpu(), dim=-1)
            idx.append(int(torch.multinomial(probs, 1, generator=gen)))
    return data.decode(idx[1:])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Fine-tunes and returns the figures (every rank); rank 0 prints them and the inference copy's text."""
    args = parse_args(argv)
    device, created_group = setup_distributed(args.timeout)
    try:
        return run(args, device)
    finally:
        if created_group:
            gc.collect()
            dist.destroy_process_group()


def run(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    rank = dist.get_rank()
    data, model, inference = build(args, device)
    budget = None if args.keep_budget_mb is None else int(args.keep_budget_mb * 2**20)
    kept = fsdp2.keep_frozen_gathered(model, budget)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr)
    sync = fsdp2.WeightSync(model, torch.bfloat16, rank=0)
    losses, gathered, synced = [], [], []
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    for step in range(args.steps):
        x, y = (t.to(device) for t in data.batch(args.batch_size, args.seq_len, gen))
        with record_collectives(model) as log:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        gathered.append(log.sent_bytes("all_gather"))
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
        if step == 0 or (step + 1) % args.sync_every == 0 or step + 1 == args.steps:
            load_weights(inference, sync.updates())  # every rank iterates; rank 0 receives
            synced.append(sync.bytes_sent)
    # the inference copy holds the trainer's weights in bf16, bit for bit
    fulls = {
        n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in model.named_parameters()
    }
    same = rank != 0 or all(torch.equal(inference.get_parameter(n), f.bfloat16()) for n, f in fulls.items())
    text = generate(inference, data, args.sample_chars, device, args.seed) if rank == 0 else ""
    if rank == 0:
        print(f"kept gathered: {len(kept)} frozen parameters; trainable: {sum(p.numel() for p in trainable)}")
        print(f"all-gather bytes per rank: step 1 {gathered[0]}, later steps {gathered[-1]}")
        print(f"weight sync bytes: first {synced[0]}, later {synced[1:]}")
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} after {len(losses)} steps")
        print(f"inference copy equals the trainer (bf16): {same}")
        print(f"--- the inference copy writes ---\n{text}\n---------------------------------")
    return {
        "losses": losses,
        "kept": kept,
        "gathered": gathered,
        "synced": synced,
        "same": same,
        "text": text,
    }


if __name__ == "__main__":
    main()
