"""Gradient reductions fsdp2 adds, against the default and torch: bytes, held memory and step time.

One training step is ``--micro`` micro-batches (forward + backward each) and an AdamW step, on a stack
of ``--layers`` ``Linear(dim, dim)`` blocks (each its own ``fully_shard`` group) plus the root's head,
bf16 parameters with fp32 reduction, in gloo processes. Variants, run round by round in turn:

- ``torch``: torch's ``fully_shard``, syncing every micro-batch (its default);
- ``fsdp2``: the same with fsdp2;
- ``accumulate None`` / ``accumulate half``: ``fsdp2.accumulate`` keeping every group, or the groups
  that fit half of the total unsharded gradient bytes;
- ``wire bf16``: ``MixedPrecisionPolicy(..., wire_dtype=bf16)``, syncing every micro-batch;
- ``deterministic``: ``set_deterministic_reduction()``, syncing every micro-batch.

Per variant, on rank 0: gradient-reduction collectives and the bytes this rank sent for them per
step (recorded from the collectives with ``fsdp2.testing.record_collectives``; torch's are not
recorded: it issues what ``fsdp2`` does), the unsharded gradient bytes held between micro-batches
(the most over a step), and the median over rounds of the mean step time.

Run:  torchrun --nproc-per-node 2 benchmarks/reductions.py [--layers 8 --dim 256 --micro 4]

With ``--memory`` (plain ``python``, no torchrun) it measures instead each fsdp2 variant's peak live
tensor bytes per rank over a step, at world 2 (``--memory-world``) on thread ranks
(``fsdp2.testing.measure_memory``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fsdp2
from fsdp2.group import held_grad_bytes, kept_grad_bytes
from fsdp2.runtime import groups_under
from fsdp2.testing import record_collectives

BF16, FP32 = torch.bfloat16, torch.float32
REDUCE_KINDS = ("reduce_scatter", "all_to_all", "all_reduce")


def _build(layers: int, dim: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(layers)), nn.Linear(dim, 8)
    )


def _shard(model: nn.Sequential, impl: Any, policy: Any) -> nn.Sequential:
    for block in model[:-1]:
        impl(block, mp_policy=policy)
    impl(model, mp_policy=policy)
    return model


def _held(model: nn.Module) -> int:
    return sum(held_grad_bytes(g) for g in groups_under(model))


class Variant:
    def __init__(self, name: str, model: nn.Module, context: Callable[[], Any] | None = None) -> None:
        self.name, self.model, self.context = name, model, context or contextlib.nullcontext
        self.optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.held = 0

    def step(self, batches: list[torch.Tensor], watch: bool = False) -> float:
        start = time.perf_counter()
        with self.context():
            for x in batches:
                self.model(x).float().square().mean().backward()
                if watch and self.name != "torch":
                    self.held = max(self.held, _held(self.model))
        self.optim.step()
        self.optim.zero_grad()
        return time.perf_counter() - start


@contextlib.contextmanager
def _counting(variant: Variant) -> Iterator[dict[str, float]]:
    found: dict[str, float] = {}
    if variant.name == "torch":  # not recorded (CommDebugMode's module tracker fails on this model)
        yield found
        return
    with record_collectives(variant.model) as log:
        yield found
    calls = [c for c in log.calls if c.kind in REDUCE_KINDS]
    found["collectives"] = len(calls)
    found["sent_bytes"] = sum(c.sent_bytes for c in calls)


def _variant_setup(name: str, model: nn.Sequential, total: int) -> Callable[[], Any]:
    if name == "deterministic":
        model.set_deterministic_reduction()
    if name == "accumulate None":
        return lambda: fsdp2.accumulate(model)
    if name == "accumulate half":
        return lambda: fsdp2.accumulate(model, budget_bytes=total // 2)
    return contextlib.nullcontext


def measure_peaks(layers: int, dim: int, micro: int, world: int = 2) -> dict[str, dict[str, int]]:
    """Peak live tensor bytes of rank 0 per phase for each fsdp2 variant (``world`` thread ranks)."""
    from fsdp2.testing import measure_memory

    names = ["fsdp2", "accumulate None", "accumulate half", "wire bf16", "deterministic"]
    peaks: dict[str, dict[str, int]] = {}
    for name in names:
        policy = fsdp2.MixedPrecisionPolicy(
            param_dtype=BF16, reduce_dtype=FP32, wire_dtype=BF16 if name == "wire bf16" else None
        )
        states: dict[int, dict[str, Any]] = {}  # per rank: the ranks are threads of this process

        def build(policy: Any = policy, name: str = name, states: dict[int, Any] = states) -> nn.Module:
            model = _shard(_build(layers, dim), fsdp2.fully_shard, policy)
            total = sum(kept_grad_bytes(g) for g in groups_under(model))
            states[dist.get_rank()] = {
                "context": _variant_setup(name, model, total),
                "optim": torch.optim.AdamW(model.parameters(), lr=1e-4),
            }
            return model

        def step(model: nn.Module, states: dict[int, Any] = states) -> None:
            state = states[dist.get_rank()]
            gen = torch.Generator().manual_seed(dist.get_rank())
            with state["context"]():
                for _ in range(micro):
                    model(torch.randn(16, dim, generator=gen)).float().square().mean().backward()
            state["optim"].step()
            state["optim"].zero_grad()

        report = measure_memory(world, build, step, steps=2)[0]
        peaks[name] = {"peak": report.peak_bytes, **{k: v.peak_bytes for k, v in report.phases.items()}}
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--memory", action="store_true", help="measure peak memory on thread ranks")
    parser.add_argument("--memory-world", type=int, default=2, help="thread ranks for --memory")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file (rank 0)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning)
    if args.memory:
        peaks = measure_peaks(args.layers, args.dim, args.micro, args.memory_world)
        base = peaks["fsdp2"]["peak"]
        print(f"| variant | peak bytes (rank 0, world {args.memory_world}) | / fsdp2 |")
        print("| --- | ---: | ---: |")
        for name, row in peaks.items():
            print(f"| {name} | {row['peak']} | {row['peak'] / base:.3f} |")
        if args.json:
            Path(args.json).write_text(json.dumps(peaks, indent=2))
        return
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    base = _build(args.layers, args.dim)
    policy = fsdp2.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    wired = fsdp2.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, wire_dtype=BF16)

    def ours(p: Any = policy) -> nn.Sequential:
        return _shard(copy.deepcopy(base), fsdp2.fully_shard, p)

    total = sum(kept_grad_bytes(g) for g in groups_under(ours()))
    acc_all, acc_half, det = ours(), ours(), ours()
    det.set_deterministic_reduction()
    variants = [
        Variant("torch", _shard(copy.deepcopy(base), torch_fully_shard, TorchPolicy(BF16, FP32))),
        Variant("fsdp2", ours()),
        Variant("accumulate None", acc_all, lambda: fsdp2.accumulate(acc_all)),
        Variant("accumulate half", acc_half, lambda: fsdp2.accumulate(acc_half, budget_bytes=total // 2)),
        Variant("wire bf16", ours(wired)),
        Variant("deterministic", det),
    ]
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(16, args.dim, generator=gen) for _ in range(args.micro)]
    stats: dict[str, dict[str, float]] = {}
    for variant in variants:
        variant.step(batches)  # warm-up
        with _counting(variant) as found:
            variant.step(batches, watch=True)
        stats[variant.name] = {**found, "held_bytes": variant.held}
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for _ in range(args.rounds):
        for variant in variants:
            dist.barrier()
            times[variant.name].append(statistics.mean(variant.step(batches) for _ in range(args.steps)))
    if rank == 0:
        base_ms = statistics.median(times["fsdp2"]) * 1e3
        torch_ms = statistics.median(times["torch"]) * 1e3
        print(
            f"{args.layers} blocks of dim {args.dim} + head, bf16 params / fp32 reduce, "
            f"{args.micro} micro-batches + AdamW per step, world {world} (gloo), "
            f"{args.rounds} rounds x {args.steps} steps, "
            f"{platform.machine()}, torch {torch.__version__}; total unsharded gradient bytes {total}"
        )
        header = "| variant | reductions / step | bytes sent / step | held grad bytes | step ms | / fsdp2 |"
        print(header + " / torch |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        rows = {}
        for variant in variants:
            s = stats[variant.name]
            count = s.get("collectives")
            ms = statistics.median(times[variant.name]) * 1e3
            sent = s.get("sent_bytes")
            rows[variant.name] = {**s, "step_ms": ms, "over_fsdp2": ms / base_ms, "over_torch": ms / torch_ms}
            count_text = "-" if count is None else f"{count:.0f}"
            sent_text = "-" if sent is None else f"{sent:.0f}"
            print(
                f"| {variant.name} | {count_text} | {sent_text} | "
                f"{s['held_bytes']:.0f} | {ms:.1f} | {ms / base_ms:.2f} | {ms / torch_ms:.2f} |"
            )
        if args.json:
            config = {"layers": args.layers, "dim": args.dim, "micro": args.micro, "rounds": args.rounds}
            Path(args.json).write_text(
                json.dumps(
                    {"world_size": world, "total_grad_bytes": total, "config": config, "variants": rows},
                    indent=2,
                )
            )
    dist.barrier()
    variants.clear()
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
