"""Hugging Face checkpoint export and load at 1, 2 and 4 ranks: time and peak host memory per rank.

A model of ``--blocks`` ``Linear(--dim, --dim)`` layers (default 16 x 2048: 268 MB in fp32), one
``fully_shard`` group each, then the root; built on the meta device and ``to_empty``'d, so a rank only
ever allocates its shards. Three ways out and three ways back in, in one world of spawned gloo
processes per world size:

- ``fsdp2.save_pretrained`` / ``fsdp2.load_pretrained``: every rank writes its own files / reads its
  own shards' bytes;
- ``fsdp2.save_full_state_dict`` / ``fsdp2.load_full_state_dict``: one tensor at a time through rank
  0, which writes / reads the one file (``examples/train.py --export`` before it wrote a directory);
- torch: ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` then rank 0's
  ``safetensors.torch.save_file``; rank 0's ``safetensors.torch.load_file`` then
  ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``.

Time: the slowest rank's seconds (a barrier before, the maximum over ranks after). Memory: the rise
of each rank's resident set during the call, ``VmHWM`` (the kernel's peak RSS, reset before each call
through ``/proc/self/clear_refs``) minus the RSS at its start, after ``gc.collect`` and ``malloc_trim``
(so memory freed by the previous call is returned first). RSS counts pages of a memory-mapped file
that were read (safetensors reads through ``mmap``); the page cache of written files is not counted.
After each load the parameters are checked against the values exported (a sum per rank).

Run:  python benchmarks/pretrained_io.py [--worlds 1 2 4] [--blocks 16] [--dim 2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

import fsdp2

CALLS = ("export", "load")
METHODS = ("save_pretrained", "save_full_state_dict", "torch")


def _model(blocks: int, dim: int) -> nn.Module:
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(dim, dim) for _ in range(blocks)))
    for block in model:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(dist.get_rank())
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().normal_(generator=generator)
    return model


def _checksum(model: nn.Module) -> float:
    return float(sum(p.to_local().detach().double().sum() for p in model.parameters()))


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        found = re.search(rf"{field}:\s+(\d+)", status.read())
    assert found is not None, field
    return int(found.group(1))


def _measured(fn: Callable[[], Any]) -> tuple[float, float]:
    """(slowest rank's seconds, this rank's peak RSS rise in MB) of ``fn()``."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets VmHWM to the current RSS
    start_rss = _rss_kib("VmRSS")
    dist.barrier()
    start = time.perf_counter()
    fn()
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    rise = (_rss_kib("VmHWM") - start_rss) / 1024
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds.item()), rise


def _torch_export(model: nn.Module, path: str) -> None:
    from safetensors.torch import save_file

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        save_file(full, path)
    dist.barrier()


def _torch_load(model: nn.Module, path: str) -> None:
    from safetensors.torch import load_file

    full = load_file(path) if dist.get_rank() == 0 else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)


def _calls(model: nn.Module, root: Path) -> dict[tuple[str, str], Callable[[], Any]]:
    folder, single, theirs = (
        str(root / "pretrained"),
        str(root / "full.safetensors"),
        str(root / "torch.safetensors"),
    )
    return {
        ("export", "save_pretrained"): lambda: fsdp2.save_pretrained(model, folder),
        ("export", "save_full_state_dict"): lambda: fsdp2.save_full_state_dict(model, single),
        ("export", "torch"): lambda: _torch_export(model, theirs),
        ("load", "save_pretrained"): lambda: fsdp2.load_pretrained(model, folder),
        ("load", "save_full_state_dict"): lambda: fsdp2.load_full_state_dict(model, single),
        ("load", "torch"): lambda: _torch_load(model, theirs),
    }


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, root: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _model(args.blocks, args.dim)
    written = _checksum(model)
    rows: dict[str, Any] = {}
    for (call, method), fn in _calls(model, Path(root)).items():
        if call == "load":
            with torch.no_grad():
                for param in model.parameters():
                    param.to_local().zero_()
        seconds, rise = _measured(fn)
        if call == "load":
            assert abs(_checksum(model) - written) < 1e-6 * max(1.0, abs(written)), (method, rank)
        rows[f"{call} {method}"] = {"seconds": seconds, "rise_mb": rise}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        Path(out).write_text(json.dumps(everyone))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for world in args.worlds:
        root = tempfile.mkdtemp(prefix="pretrained_io_")
        out = os.path.join(root, "result.json")
        try:
            mp.start_processes(
                _rank, (world, _free_port(), args, root, out), nprocs=world, start_method="spawn"
            )
            results[str(world)] = json.loads(Path(out).read_text())
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return results


def print_table(results: dict[str, Any], model_mb: float) -> None:
    print(
        f"model: {model_mb:.0f} MB fp32; seconds (slowest rank) and peak RSS rise per rank in MB (max / min)"
    )
    print(f"| call | {' | '.join(f'{w} rank(s): s, MB' for w in results)} |")
    print("| --- |" + " ---: |" * len(results))
    for call in CALLS:
        for method in METHODS:
            key, cells = f"{call} {method}", []
            for ranks in results.values():
                rises = [r[key]["rise_mb"] for r in ranks]
                spread = f"{max(rises):.0f}" if len(rises) == 1 else f"{max(rises):.0f} / {min(rises):.0f}"
                cells.append(f"{ranks[0][key]['seconds']:.2f} s, {spread}")
            print(f"| {key} | {' | '.join(cells)} |")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    results = run(args)
    model_mb = args.blocks * (args.dim * args.dim + args.dim) * 4 / 1e6
    print(f"{platform.node()}: {os.cpu_count()} CPUs, torch {torch.__version__}")
    print_table(results, model_mb)
    if args.json:
        Path(args.json).write_text(json.dumps({"model_mb": model_mb, "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
