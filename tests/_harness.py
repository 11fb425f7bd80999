"""Test harness: run a function on N ranks, as threads or as real gloo processes.

Owns: the suite's ``run_threaded`` (over ``fsdp2.testing``'s threaded ranks), the multiprocess
spawner, rank-0 broadcast of modules and inputs, and the sharded-parity assertion. Collective
counting is ``fsdp2.testing.count_collectives``, re-exported here.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp2.testing import count_collectives
from fsdp2.testing._threads import _run, _run_lock

_THREAD_TIMEOUT_S = 240.0

__all__ = [
    "assert_sharded_parity",
    "broadcast_module_",
    "count_collectives",
    "run_multiprocess",
    "run_threaded",
]


def run_threaded(world_size: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` threads, each a rank of one threaded process group.

    The suite's own entry point over ``fsdp2.testing.run_ranks`` (which passes ``rank, world_size``
    first); returns the per-rank return values and re-raises the first rank's failure.
    """
    with _run_lock:
        return _run(world_size, fn, args, _THREAD_TIMEOUT_S, pass_rank=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _process_entry(
    rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        fn(*args)
    finally:
        # Collect DTensor/mesh garbage first: gloo teardown with live references sometimes aborts.
        gc.collect()
        dist.destroy_process_group()


def run_multiprocess(world_size: int, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` in ``world_size`` spawned gloo processes (``fn`` must be importable)."""
    port = _free_port()
    mp.start_processes(
        _process_entry, args=(world_size, port, fn, args), nprocs=world_size, join=True, start_method="spawn"
    )


def broadcast_module_(module: nn.Module, src: int = 0) -> nn.Module:
    """Make every rank's parameters and buffers equal to rank ``src``'s (threads share the RNG)."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor, src=src)
    return module


def assert_sharded_parity(ref: nn.Module, model: nn.Module, *, grads: bool = False) -> None:
    """Each sharded parameter (and grad) of ``model`` equals the same rows of ``ref``'s."""
    for (ref_name, ref_param), (name, param) in zip(
        ref.named_parameters(), model.named_parameters(), strict=True
    ):
        assert ref_name == name.replace("_checkpoint_wrapped_module.", ""), (ref_name, name)
        pairs = [(ref_param, param)]
        if grads:
            pairs.append((ref_param.grad, param.grad))
        for ref_t, t in pairs:
            if ref_t is None or t is None:
                assert (ref_t is None) == (t is None), f"grad presence differs for {name}"
                continue
            if isinstance(t, DTensor):
                full = t.full_tensor().to(ref_t.device)  # CPU offload keeps the shards on the CPU
                torch.testing.assert_close(full, ref_t, msg=lambda m, n=name: f"{n}: {m}")
            else:
                torch.testing.assert_close(t, ref_t, msg=lambda m, n=name: f"{n}: {m}")


if sys.platform == "win32":  # pragma: no cover - the project targets Linux
    raise ImportError("the test harness needs Linux (threaded and gloo process groups)")
