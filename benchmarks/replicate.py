"""``fsdp2.replicate`` against torch's ``replicate``, and HSDP with and without the optimizer across replicas.

A small decoder-only transformer (``tests.models.Transformer``: ``--layers`` blocks of width ``--dim``,
vocabulary ``--vocab``, ``--seq`` tokens, batch ``--batch`` per rank), one call per block and one on
the root, AdamW, whole steps (forward, backward, step), on gloo processes started by torchrun.
Variants, in one run:

- ``torch replicate``: ``torch.distributed._composable.replicate_with_fsdp.replicate`` (torch 2.13's
  FSDP-based data parallelism);
- ``fsdp2 replicate``: ``fsdp2.replicate`` with the same calls;
- ``fsdp2 replicate + zero``: the same, with ``fsdp2.shard_optimizer_across_replicas`` (each rank
  steps ``1 / W`` of every parameter);
- at 4 ranks also HSDP on a (replicate=2, shard=2) mesh: ``torch HSDP 2x2`` (torch's ``fully_shard``),
  ``fsdp2 HSDP 2x2`` and ``fsdp2 HSDP 2x2 + across`` (the optimizer sharded across the replicas).

Per rank: the step time (median of ``--steps`` after two warm-ups), the peak of live tensor bytes
(``fsdp2.plan``'s storage tracker, the same for every variant: parameters, gradients, optimizer
state, activations and communication buffers), the optimizer state's bytes, and the collectives of
one step counted on torch's c10d ops (calls and bytes by kind: an all-gather's output, the others'
input).

Run:  torchrun --standalone --nproc-per-node 2 benchmarks/replicate.py
      torchrun --standalone --nproc-per-node 4 benchmarks/replicate.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _collective_bytes import KINDS, CollectiveBytes


def _model(args: argparse.Namespace) -> nn.Module:
    from tests.models import ModelArgs, Transformer

    torch.manual_seed(0)
    model_args = ModelArgs(
        n_layers=args.layers, vocab_size=args.vocab, dim=args.dim, n_heads=4, max_seq_len=args.seq
    )
    return Transformer(model_args)


def _build(variant: str, args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    import fsdp2

    world = dist.get_world_size()
    model = _model(args)
    mesh_shape, names = ((world,), ("replicate",))
    if "HSDP" in variant:
        mesh_shape, names = (2, world // 2), ("replicate", "shard")
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    if variant == "torch replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate as apply
    elif variant == "torch HSDP 2x2":
        from torch.distributed.fsdp import fully_shard as apply
    elif "HSDP" in variant:
        apply = fsdp2.fully_shard  # type: ignore[assignment]
    else:
        apply = fsdp2.replicate  # type: ignore[assignment]
    for block in model.layers:  # type: ignore[union-attr]
        apply(block, mesh=mesh)
    apply(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if variant.endswith(("+ zero", "+ across")):
        fsdp2.shard_optimizer_across_replicas(model, optim)
    return model, optim


def _step(built: tuple[nn.Module, torch.optim.Optimizer], args: argparse.Namespace, step: int) -> None:
    model, optim = built
    gen = torch.Generator().manual_seed(10 * step + dist.get_rank())
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optim.step()
    optim.zero_grad()


def _state_bytes(optim: torch.optim.Optimizer) -> int:
    total = 0
    for values in optim.state.values():
        for value in values.values():
            local = value.to_local() if isinstance(value, DTensor) else value
            if isinstance(local, torch.Tensor) and local.ndim > 0:
                total += local.numel() * local.element_size()
    return total


def _measure(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    from fsdp2.plan import MemoryTracker, run_tracked

    built = _build(variant, args)
    _step(built, args, 0)
    _step(built, args, 1)
    counter = CollectiveBytes()
    with counter:
        _step(built, args, 2)
    times = []
    for step in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        _step(built, args, 3 + step)
        times.append(time.perf_counter() - start)
    state = _state_bytes(built[1])
    tracker = MemoryTracker()
    holder: dict[str, Any] = {}

    def build() -> nn.Module:
        holder["built"] = _build(variant, args)
        return holder["built"][0]

    run_tracked(tracker, build, lambda m: _step(holder["built"], args, 0), 2)
    peak = tracker.report(dist.get_world_size(), dist.get_rank()).peak_bytes
    return {
        "step_ms": 1e3 * statistics.median(times),
        "peak_bytes": peak,
        "state_bytes": state,
        "calls": dict(counter.calls),
        "bytes": dict(counter.bytes),
    }


def _variants(world: int) -> list[str]:
    out = ["torch replicate", "fsdp2 replicate", "fsdp2 replicate + zero"]
    if world == 4:
        out += ["torch HSDP 2x2", "fsdp2 HSDP 2x2", "fsdp2 HSDP 2x2 + across"]
    return out


def _print(per_rank: list[dict[str, Any]], args: argparse.Namespace, variants: list[str]) -> None:
    world = len(per_rank)
    print(
        f"# Transformer: {args.layers} layers, dim {args.dim}, vocab {args.vocab}, {args.batch} x {args.seq} "
        f"tokens per rank, AdamW, {world} gloo ranks (means over ranks)"
    )
    print("| variant | step ms | peak MiB | optimizer state KiB | collectives per step (calls, KiB) |")
    print("|---|---:|---:|---:|---|")
    for variant in variants:
        rows = [r[variant] for r in per_rank]
        step = statistics.mean(r["step_ms"] for r in rows)
        peak = statistics.mean(r["peak_bytes"] for r in rows) / 2**20
        state = statistics.mean(r["state_bytes"] for r in rows) / 1024
        parts = []
        for kind in KINDS:
            calls = statistics.mean(r["calls"].get(kind, 0) for r in rows)
            if calls:
                kib = statistics.mean(r["bytes"].get(kind, 0) for r in rows) / 1024
                parts.append(f"{kind} {calls:g} x, {kib:,.1f}")
        print(f"| {variant} | {step:.1f} | {peak:.2f} | {state:,.1f} | {'; '.join(parts)} |")
    print(json.dumps({"args": vars(args), "ranks": per_rank}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    variants = _variants(dist.get_world_size())
    results = {variant: _measure(variant, args) for variant in variants}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        _print(gathered, args, variants)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
