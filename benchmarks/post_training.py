"""Post-training figures: a frozen backbone kept gathered, and weight sync to an inference engine.

(a) LoRA steps, in gloo processes: a stack of ``--layers`` blocks, each a frozen ``Linear(dim, dim)``
with a rank-8 adapter inside it (PEFT's layout), each its own ``fully_shard`` group, bf16, AdamW on the
adapters, ``--micro`` micro-batches per step. Variants, round by round: torch's ``fully_shard``, fsdp2,
and fsdp2 with ``keep_frozen_gathered``. Per variant on rank 0: all-gather bytes this rank sent per
step (after the first; fsdp2's recorded, torch's issue what fsdp2's plain variant does) and the median
step time; with ``--memory`` (plain ``python``) also the peak live tensor bytes of a step at world 2
on thread ranks (``fsdp2.testing.measure_memory``).

(b) Weight sync (same processes): bytes yielded and seconds per ``WeightSync.updates()`` call after
each optimizer step, every parameter every time (a fresh ``WeightSync``) against changed-only, for the
LoRA model and for a full fine-tune of the same stack (fp32 weights, AdamW at ``--lr-full``), synced
in bf16.

(c) Where a weight sync's time goes (same processes, full fine-tune stack, every parameter, rank 0
receives and copies each pair into a plain bf16 model): the seconds inside the sync's iterator
(gathers and assembly) against the seconds in the consumer between pairs, for ``WeightSync`` with
buckets (``--bucket-mb``), ``WeightSync(bucket_mb=0)`` (one all-gather per parameter, as before
buckets) and the loop users write (``param.full_tensor()`` per parameter, cast, consume); with the
all-gathers each issues per call.

Run:  torchrun --nproc-per-node 2 benchmarks/post_training.py [--layers 8 --dim 512] [--split-only]
      python benchmarks/post_training.py --memory
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

import fsdp2
from fsdp2.testing import record_collectives


class LoRALinear(nn.Module):
    def __init__(self, dim: int, rank: int = 8) -> None:
        super().__init__()
        self.base = nn.Linear(dim, dim)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, dim) / dim**0.5)
        self.lora_b = nn.Parameter(torch.zeros(dim, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t())


def _build(layers: int, dim: int, lora: bool) -> nn.Sequential:
    torch.manual_seed(0)
    if lora:
        return nn.Sequential(*(LoRALinear(dim) for _ in range(layers))).bfloat16()
    return nn.Sequential(*(nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(layers)))


def _shard(model: nn.Sequential, fully_shard: Any) -> nn.Sequential:
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return model


def _variants(layers: int, dim: int) -> dict[str, dict[str, Any]]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    variants = {}
    for name in ("torch", "fsdp2", "fsdp2 keep"):
        model = _shard(_build(layers, dim, True), torch_fully_shard if name == "torch" else fsdp2.fully_shard)
        if name == "fsdp2 keep":
            fsdp2.keep_frozen_gathered(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        variants[name] = {"model": model, "optim": torch.optim.AdamW(trainable, lr=1e-3), "times": []}
    return variants


def _step(model: nn.Module, optim: torch.optim.Optimizer, dim: int, micro: int, gen: torch.Generator) -> None:
    for _ in range(micro):
        model(torch.randn(16, dim, generator=gen).bfloat16()).float().square().mean().backward()
    optim.step()
    optim.zero_grad()


def lora_steps(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    variants = _variants(args.layers, args.dim)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for variant in variants.values():
        _step(variant["model"], variant["optim"], args.dim, args.micro, gen)  # lazy init, first gathers
    gathered = {}
    for name in ("fsdp2", "fsdp2 keep"):
        variant = variants[name]
        with record_collectives(variant["model"]) as log:
            _step(variant["model"], variant["optim"], args.dim, args.micro, gen)
        gathered[name] = log.sent_bytes("all_gather")
    gathered["torch"] = gathered["fsdp2"]
    for _ in range(args.rounds):
        for variant in variants.values():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                _step(variant["model"], variant["optim"], args.dim, args.micro, gen)
            variant["times"].append((time.perf_counter() - start) / args.steps)
    return {
        name: {"all_gather_bytes": gathered[name], "step_s": statistics.median(v["times"])}
        for name, v in variants.items()
    }


def weight_sync(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    figures = {}
    for kind in ("lora", "full"):
        model = _shard(_build(args.layers, args.dim, kind == "lora"), fsdp2.fully_shard)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optim = torch.optim.AdamW(trainable, lr=1e-3 if kind == "lora" else args.lr_full)
        gen = torch.Generator().manual_seed(dist.get_rank())
        changed_only = fsdp2.WeightSync(model, torch.bfloat16, rank=0)
        list(changed_only.updates())  # the first call: everything
        rows: dict[str, list[float]] = {"all bytes": [], "all s": [], "changed bytes": [], "changed s": []}
        for _ in range(args.rounds):
            for _ in range(args.micro):
                x = torch.randn(16, args.dim, generator=gen)
                model(x.bfloat16() if kind == "lora" else x).float().square().mean().backward()
            optim.step()
            optim.zero_grad()
            for label, sync in (
                ("all", fsdp2.WeightSync(model, torch.bfloat16, rank=0)),
                ("changed", changed_only),
            ):
                dist.barrier()
                start = time.perf_counter()
                for _ in sync.updates():
                    pass
                rows[f"{label} s"].append(time.perf_counter() - start)
                rows[f"{label} bytes"].append(sync.bytes_sent)
        figures[kind] = {label: statistics.median(values) for label, values in rows.items()}
    return figures


def _split(pairs: Any, consume: Any) -> tuple[float, float]:
    """Seconds inside ``pairs``' iterator, and in ``consume`` between pairs."""
    inside = outside = 0.0
    iterator = iter(pairs)
    while True:
        start = time.perf_counter()
        try:
            name, tensor = next(iterator)
        except StopIteration:
            inside += time.perf_counter() - start
            return inside, outside
        middle = time.perf_counter()
        inside += middle - start
        consume(name, tensor)
        outside += time.perf_counter() - middle


def _full_tensor_loop(model: nn.Module) -> Any:
    for name, param in model.named_parameters():
        full = param.full_tensor().bfloat16()
        if dist.get_rank() == 0:
            yield name, full


def sync_split(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    model = _shard(_build(args.layers, args.dim, False), fsdp2.fully_shard)
    plain = _build(args.layers, args.dim, False).bfloat16()

    def consume(name: str, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            plain.get_parameter(name).copy_(tensor)

    variants = {
        f"buckets {args.bucket_mb:g} MB": lambda: fsdp2.WeightSync(
            model, rank=0, bucket_mb=args.bucket_mb
        ).updates(),
        "per parameter": lambda: fsdp2.WeightSync(model, rank=0, bucket_mb=0).updates(),
        "full_tensor loop": lambda: _full_tensor_loop(model),
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    gathers = {}
    for name, pairs in variants.items():
        with CommDebugMode() as comms:  # the c10d and functional collectives, whoever issues them
            list(pairs())
        gathers[name] = comms.get_total_counts()
    for _ in range(args.rounds):
        for name, pairs in variants.items():
            dist.barrier()
            times[name].append(_split(pairs(), consume))
    return {
        name: {
            "gather_s": statistics.median(t[0] for t in rows),
            "consume_s": statistics.median(t[1] for t in rows),
            "all_gathers": gathers[name],
        }
        for name, rows in times.items()
    }


def measure_peaks(args: argparse.Namespace) -> dict[str, int]:
    from fsdp2.testing import measure_memory

    peaks = {}
    for keep in (False, True):
        optims: dict[int, Any] = {}

        def build(keep: bool = keep, optims: dict[int, Any] = optims) -> nn.Module:
            model = _shard(_build(args.layers, args.dim, True), fsdp2.fully_shard)
            if keep:
                fsdp2.keep_frozen_gathered(model)
            optims[dist.get_rank()] = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
            return model

        def step(model: nn.Module, optims: dict[int, Any] = optims) -> None:
            _step(model, optims[dist.get_rank()], args.dim, args.micro, torch.Generator().manual_seed(0))

        report = measure_memory(2, build, step, steps=2)[0]
        peaks["fsdp2 keep" if keep else "fsdp2"] = report.step_peak_bytes
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--memory", action="store_true", help="peak memory on thread ranks (no torchrun)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--split-only", action="store_true", help="only (c)")
    parser.add_argument("--bucket-mb", type=float, default=64, help="WeightSync's bucket cap in (c)")
    parser.add_argument("--lr-full", type=float, default=1e-5, help="AdamW lr of the full fine-tune")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)
    if args.memory:
        peaks = measure_peaks(args)
        print(json.dumps(peaks))
        print(f"peak live bytes per rank: fsdp2 {peaks['fsdp2']}, keep {peaks['fsdp2 keep']}")
        return
    dist.init_process_group("gloo")
    figures: dict[str, Any] = {"args": vars(args), "lora_steps": {}, "weight_sync": {}}
    if not args.split_only:
        figures["lora_steps"] = lora_steps(args)
        figures["weight_sync"] = weight_sync(args)
    figures["sync_split"] = sync_split(args)
    if dist.get_rank() == 0:
        steps = figures["lora_steps"]
        print("variant      all-gather B/step  step ms  ratio to torch" if steps else "")
        for name, row in steps.items():
            ratio = row["step_s"] / steps["torch"]["step_s"]
            print(f"{name:12s} {row['all_gather_bytes']:17d} {row['step_s'] * 1e3:8.1f} {ratio:8.2f}")
        for kind, row in figures["weight_sync"].items():
            print(
                f"sync {kind}: every parameter {row['all bytes']:.0f} B in {row['all s'] * 1e3:.1f} ms; "
                f"changed only {row['changed bytes']:.0f} B in {row['changed s'] * 1e3:.1f} ms"
            )
        print("sync of every parameter  iterator ms  consumer ms  collectives")
        for name, row in figures["sync_split"].items():
            print(
                f"{name:24s} {row['gather_s'] * 1e3:11.1f} {row['consume_s'] * 1e3:12.1f} "
                f"{row['all_gathers']:12d}"
            )
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
