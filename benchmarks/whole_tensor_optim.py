"""Whole-tensor optimizers (Muon, Adafactor) on shards: fsdp2's steps against their alternatives.

Model: a stack of 8 square ``nn.Linear(D, D, bias=False)``, each its own ``fully_shard`` group, then
the root; a batch of ``--batch`` rows per rank, loss ``model(x).square().mean()``. Every step runs
one forward and backward (not timed), a barrier, then ``optimizer.step()`` alone is timed on every
rank. Per case: ``--warmup`` steps (the first one counted by ``FlopCounterMode``), then ``--steps``
timed steps; a step's time is the slowest rank's, and the median over the timed steps is reported,
both wall-clock and CPU seconds (``time.process_time``, the busiest rank's: with 4 ranks on a 2-core
machine, wall-clock includes waiting for a core; CPU seconds do not).

Muon (lr 0.02, torch's defaults otherwise), per world size (gloo processes, one thread each):

- ``unsharded`` (world 1): torch's ``torch.optim.Muon`` over the plain stack, no fsdp2;
- ``fsdp2``: fsdp2's default for Muon, the owner step (each matrix stepped once, on an owner rank;
  two all-to-alls);
- ``gathered``: the baseline "every rank orthogonalises every matrix", implemented here
  (``GatheredMuon``): the momentum buffer stays sharded (its update is elementwise, done on the local
  rows), each matrix's Nesterov update is all-gathered (``dist.all_gather_into_tensor``), every rank
  runs torch's own Newton-Schulz (``_zeropower_via_newtonschulz``) on every whole matrix and keeps
  its own rows. This is the cheaper form of gathering (one matrix moved per parameter, where
  gathering the gradient and the momentum buffer would move two), and it gives fsdp2's numbers (the
  table's last column);
- ``dtensor`` (``--dtensor-muon``): torch's ``Muon`` through DTensor operations
  (``fsdp2.whole_tensor_step(opt, enabled=False)``, what torch 2.13's ``fully_shard`` does): a
  timing only, its numbers are not the unsharded model's.

Adafactor (lr 1e-2, torch's defaults otherwise): ``unsharded`` (world 1); ``fsdp2``, fsdp2's default
for ``torch.optim.Adafactor`` (the update on each rank's rows, its statistics from two all-reduces);
``owner``, the owner step (an unchanged subclass of Adafactor, which fsdp2 steps on owners); and the
DTensor path (reported as raising, with torch's message, if it raises).

Also reported, per case:

- bytes into a rank per step from the others (mean over ranks), counted at the c10d level (a
  dispatch mode over the ``c10d`` ops and DTensor's ``_c10d_functional`` ones) during the timed
  steps: an all-gather's output less the rank's own piece, an all-to-all's output less the piece the
  rank sends itself, an all-reduce as a ring's 2 (W - 1) / W of its buffer, a reduce-scatter's
  (W - 1) / W of its input;
- the matmul FLOPs inside ``optimizer.step()`` (``torch.utils.flop_counter.FlopCounterMode``), the
  busiest rank's against total / world (total: the world-1 unsharded step's FLOPs);
- after the first step from the same weights and inputs, the largest difference between each
  sharded path's parameters and fsdp2's default path's.

D: ``--dim`` (default 512). D = 1024 would be used if a Muon step at world 2 took under ~5 s; it
does not on the 2-core VM without AVX-512-BF16: torch's bf16 ``addmm`` (two of Newton-Schulz's three
matmuls) runs at about 1 GFLOP/s on one thread there, and an unsharded Muon step takes ~18 s at
D = 512 (~215 s at D = 1024).

Run:  python benchmarks/whole_tensor_optim.py [--worlds 2 4 --dim 512 --steps 3 --dtensor-muon]
(about 7 minutes on that VM without ``--dtensor-muon``). Writes
benchmarks/results/whole_tensor_optim.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import socket
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim._muon import (  # torch's own Newton-Schulz and learning-rate adjustment
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_C,
    EPS,
    _adjust_lr,
    _zeropower_via_newtonschulz,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import fsdp2

LAYERS = 8
MUON_LR = 0.02
ADAFACTOR_LR = 1e-2


class GatheredMuon(torch.optim.Optimizer):
    """Baseline: every rank orthogonalises every whole matrix and keeps its own rows.

    Muon's step as torch writes it (``_single_tensor_muon``), on parameters ``fully_shard`` sharded
    on dim 0 in equal row blocks: the momentum buffer (a plain tensor of this rank's rows) and the
    Nesterov blend are elementwise, so they run on the local rows; the blend is all-gathered into
    the whole matrix on every rank, orthogonalised there, and this rank's rows of the result update
    its rows of the parameter.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
        eps: float = EPS,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
    ) -> None:
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
        )  # fmt: skip
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                assert isinstance(param, DTensor)
                assert isinstance(param.grad, DTensor)
                pg = param.device_mesh.get_group(0)
                world, rank = dist.get_world_size(pg), dist.get_rank(pg)
                if param.shape[0] % world:
                    raise ValueError("GatheredMuon: rows must divide evenly over the ranks")
                local, grad = param.to_local(), param.grad.to_local()  # views of the shards
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                buf = state["momentum_buffer"]
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                whole = torch.empty(param.shape, dtype=update.dtype)
                dist.all_gather_into_tensor(whole, update.contiguous(), group=pg)
                ortho = _zeropower_via_newtonschulz(
                    whole, group["ns_coefficients"], group["ns_steps"], group["eps"]
                )
                rows = ortho.chunk(world)[rank]
                adjusted_lr = _adjust_lr(lr, group["adjust_lr_fn"], param.shape)
                local.mul_(1 - lr * group["weight_decay"])
                local.add_(rows, alpha=-adjusted_lr)


fsdp2.declare_optimizer(GatheredMuon, "dtensor")  # its own collectives: fsdp2 leaves its step alone


class OwnerMuon(torch.optim.Muon):
    """torch's Muon, unchanged: as a subclass, fsdp2 steps it with the general owner step (its default
    for ``torch.optim.Muon`` itself moves only the Newton-Schulz input and output)."""


class OwnerAdafactor(torch.optim.Adafactor):
    """torch's Adafactor, unchanged: as a subclass, fsdp2 steps it on owners (its default for
    ``torch.optim.Adafactor`` itself is the row-shard step), so both paths can be measured."""


class _BytesIn(TorchDispatchMode):
    """Bytes into this rank from the other ranks, over the collectives issued inside it."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into collectives first (as CommDebugMode does)
        ns, name = func.namespace, func.__name__.split(".")[0]
        if ns == "c10d":
            if name == "alltoall_base_":
                out, splits = args[0], list(args[3])
                world = len(splits) or dist.get_world_size()
                row = _nbytes(out) // max(1, out.shape[0])
                own = splits[self.rank] * row if splits else _nbytes(out) // world
                self.bytes += _nbytes(out) - own
            elif name in ("_allgather_base_", "allgather_"):
                self.bytes += _nbytes(args[0]) - _nbytes(args[1])
            elif name == "allreduce_":
                world = dist.get_world_size()
                self.bytes += 2 * (world - 1) * _nbytes(args[0]) // world
            elif name in ("reduce_scatter_tensor_coalesced_", "_reduce_scatter_base_"):
                world = dist.get_world_size()
                self.bytes += (world - 1) * _nbytes(args[1]) // world
            elif name == "broadcast_":
                self.bytes += _nbytes(args[0])  # into every rank but the source
            elif name not in ("barrier",):
                raise NotImplementedError(f"_BytesIn: c10d.{name}")
        elif ns == "_c10d_functional":
            if name == "all_gather_into_tensor":
                self.bytes += (args[1] - 1) * _nbytes(args[0])
            elif name == "all_reduce":
                world = dist.get_world_size()
                self.bytes += 2 * (world - 1) * _nbytes(args[0]) // world
            elif name == "reduce_scatter_tensor":
                self.bytes += (args[2] - 1) * _nbytes(args[0]) // args[2]
            elif name == "all_to_all_single":
                world = len(args[1])
                self.bytes += _nbytes(args[0]) * (world - 1) // world  # even splits (DTensor's)
            elif name == "broadcast":
                self.bytes += _nbytes(args[0])  # into every rank but the source
            elif name not in ("wait_tensor", "_wrap_tensor_autograd"):
                raise NotImplementedError(f"_BytesIn: _c10d_functional.{name}")
        return func(*args, **(kwargs or {}))


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def build(optim: str, path: str, dim: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(dim, dim, bias=False) for _ in range(LAYERS)))
    if path != "unsharded":
        for layer in model:
            fsdp2.fully_shard(layer)
        fsdp2.fully_shard(model)
    opt: torch.optim.Optimizer
    if optim == "Muon":
        cls = {"gathered": GatheredMuon, "owner": OwnerMuon}.get(path, torch.optim.Muon)
        opt = cls(model.parameters(), lr=MUON_LR)
    else:
        cls = OwnerAdafactor if path == "owner" else torch.optim.Adafactor
        opt = cls(model.parameters(), lr=ADAFACTOR_LR)
    if path == "dtensor":
        fsdp2.whole_tensor_step(opt, enabled=False)
    return model, opt


def measure(optim: str, path: str, args: argparse.Namespace, x: torch.Tensor) -> dict[str, Any]:
    """This rank's figures for one case; an exception's first line if the path raises."""
    model, opt = build(optim, path, args.dim)
    rank = dist.get_rank()
    walls: list[float] = []
    cpus: list[float] = []
    flops = 0
    bytes_in: list[int] = []
    first: list[torch.Tensor] = []
    try:
        for step in range(args.warmup + args.steps):
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            dist.barrier()
            if step == 0:
                with FlopCounterMode(display=False) as counter:
                    opt.step()
                flops = int(counter.get_total_flops())
                first = [
                    (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                    for p in model.parameters()
                ]
                continue
            if step < args.warmup:
                opt.step()
                continue
            counting = _BytesIn(rank)
            with counting:
                wall0, cpu0 = time.perf_counter(), time.process_time()
                opt.step()
                wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            walls.append(wall)
            cpus.append(cpu)
            bytes_in.append(counting.bytes)
    except Exception as exc:  # reported in the table (the DTensor path may raise)
        first_sentence = str(exc).splitlines()[0].split(". ")[0][:160]
        return {"raised": f"{type(exc).__name__}: {first_sentence}"}
    finally:
        del model, opt
        gc.collect()
    return {"wall": walls, "cpu": cpus, "flops": flops, "bytes_in": bytes_in, "first": first}


def cases(world: int, args: argparse.Namespace) -> list[tuple[str, str]]:
    if world == 1:
        return [("Muon", "unsharded"), ("Adafactor", "unsharded")]
    muon = [("Muon", "fsdp2"), ("Muon", "owner"), ("Muon", "gathered")]
    if args.dtensor_muon:
        muon.append(("Muon", "dtensor"))
    return [*muon, ("Adafactor", "fsdp2"), ("Adafactor", "owner"), ("Adafactor", "dtensor")]


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=r"(?s).*(view tensor|is a view)")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        x = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(rank))
        mine = {f"{o} {p}": measure(o, p, args, x) for o, p in cases(world, args)}
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            out.put(_summarise(gathered, world))
    finally:
        gc.collect()
        dist.destroy_process_group()


def _summarise(per_rank: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """The slowest rank's step times, the busiest rank's FLOPs and bytes, differences from ``fsdp2``."""
    summary: dict[str, Any] = {}
    for case, first_rank in per_rank[0].items():
        if "raised" in first_rank or any("raised" in r[case] for r in per_rank):
            raised = next(r[case]["raised"] for r in per_rank if "raised" in r[case])
            summary[case] = {"raised": raised}
            continue
        rows = [r[case] for r in per_rank]
        steps = len(rows[0]["wall"])
        summary[case] = {
            "wall_s": statistics.median(max(r["wall"][i] for r in rows) for i in range(steps)),
            "cpu_s": statistics.median(max(r["cpu"][i] for r in rows) for i in range(steps)),
            "flops_max": max(r["flops"] for r in rows),
            "flops_sum": sum(r["flops"] for r in rows),
            "bytes_in_mean": statistics.mean(statistics.mean(r["bytes_in"]) for r in rows),
            "bytes_in_max": max(max(r["bytes_in"]) for r in rows),
        }
    for optim in ("Muon", "Adafactor"):
        ref = per_rank[0].get(f"{optim} fsdp2")
        if ref is None or "raised" in ref:
            continue
        for case, value in per_rank[0].items():
            if case.startswith(optim) and "raised" not in value:
                pairs = zip(value["first"], ref["first"], strict=True)
                diff = max((a - b).abs().max().item() for a, b in pairs)
                summary[case]["max_diff_from_fsdp2_after_step_1"] = diff
    return summary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    result: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "config": {k: getattr(args, k) for k in ("dim", "batch", "warmup", "steps", "worlds")},
        "worlds": {},
    }
    for world in (1, *args.worlds):
        start = time.perf_counter()
        queue = ctx.SimpleQueue()
        port = _free_port()
        procs = [ctx.Process(target=rank_main, args=(r, world, port, args, queue)) for r in range(world)]
        for proc in procs:
            proc.start()
        measured = queue.get()
        for proc in procs:
            proc.join()
            if proc.exitcode != 0:
                raise RuntimeError(f"rank process exited with {proc.exitcode}")
        result["worlds"][str(world)] = measured
        print(f"world {world}: {time.perf_counter() - start:.0f} s", flush=True)
    return result


_LABELS = {
    "unsharded": "unsharded torch, no fsdp2",
    "Muon fsdp2": "fsdp2 default: rows, Newton-Schulz on owners",
    "Adafactor fsdp2": "fsdp2 default: on rows, 2 all-reduces",
    "owner": "fsdp2 owner step (a subclass)",
    "gathered": "baseline: all-gather, every rank every matrix",
    "dtensor": "DTensor path (torch's fully_shard)",
}


def print_table(result: dict[str, Any]) -> None:
    cfg = result["config"]
    print(
        f"\n{LAYERS} x Linear({cfg['dim']}, {cfg['dim']}, bias=False), batch {cfg['batch']} per rank, "
        f"median of {cfg['steps']} timed steps after {cfg['warmup']}; {result['machine']}\n"
    )
    print(
        "| optimizer | world | path | step s (wall) | step CPU s | / baseline (wall) | / unsharded (wall) "
        "| / unsharded (CPU) | MiB in per rank per step | matmul GFLOP, busiest rank | / (total / world) "
        "| max diff from fsdp2 after step 1 |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    worlds = result["worlds"]
    for optim in ("Muon", "Adafactor"):
        base = worlds["1"][f"{optim} unsharded"]
        total = base["flops_sum"]
        for world, cases_ in worlds.items():
            w = int(world)
            for case, row in cases_.items():
                if not case.startswith(optim):
                    continue
                path = case.split()[1]
                label = _LABELS.get(case, _LABELS.get(path, path))
                if "raised" in row:
                    print(f"| {optim} | {w} | {label} | raises: `{row['raised']}` |" + " |" * 8)
                    continue
                gathered = cases_.get(f"{optim} gathered")
                vs_base = f"{row['wall_s'] / gathered['wall_s']:.2f}" if gathered and w > 1 else "-"
                flop_share = f"{row['flops_max'] / (total / w):.2f}" if total else "-"
                gflop = f"{row['flops_max'] / 1e9:.3g}"
                if path == "dtensor":  # FlopCounterMode sees DTensor ops with their global shapes
                    gflop = flop_share = "n/a"
                diff = row.get("max_diff_from_fsdp2_after_step_1")
                mb = row["bytes_in_mean"] / 2**20
                print(
                    f"| {optim} | {w} | {label} | {row['wall_s']:.2f} | {row['cpu_s']:.2f} | {vs_base} "
                    f"| {row['wall_s'] / base['wall_s']:.2f} | {row['cpu_s'] / base['cpu_s']:.2f} "
                    f"| {mb:.3g} | {gflop} | {flop_share} "
                    f"| {'-' if diff is None or w == 1 else f'{diff:.1e}'} |"
                )
    print(f"\n{result['machine']}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32, help="rows per rank")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps (the first counts FLOPs)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per case")
    parser.add_argument("--dtensor-muon", action="store_true", help="also time Muon's DTensor path")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "whole_tensor_optim.json").write_text(json.dumps(result, indent=2))
    print_table(result)
    return result


if __name__ == "__main__":
    main()
