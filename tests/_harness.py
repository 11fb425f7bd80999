"""Test harness: run a function on N ranks, as threads or as real gloo processes.

Owns: the suite's ``run_threaded`` (over ``fsdp2.testing``'s threaded ranks), the multiprocess
launcher, rank-0 broadcast of modules and inputs, and the sharded-parity assertion. Collective
counting is ``fsdp2.testing.count_collectives``, re-exported here.

[Note: Forkserver ranks]
``run_multiprocess`` starts its ranks with the ``forkserver`` start method: one server process,
started at the first call, imports torch, fsdp2 and the harness once (``_PRELOAD``), and each rank
is a fork of it. A spawned rank imported all that itself, about 5 s of CPU each (a world of 4 took
11 s to start on 2 cores; from the server it takes under a second). The ranks are still separate
processes with their own gloo process group; each starts in the caller's working directory and
environment, as a spawned one would. One difference: forked ranks share the server's string-hash
seed, while spawned ranks (and torchrun's) each drew their own; the torchrun tests in
``tests/end_to_end/test_examples.py`` still start separate interpreters.
"""

from __future__ import annotations

import collections
import gc
import multiprocessing
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
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp2.testing import count_collectives
from fsdp2.testing._threads import _run, _run_lock

_THREAD_TIMEOUT_S = 240.0

__all__ = [
    "C10dOps",
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


# What the forkserver imports once for every rank (see [Note: Forkserver ranks]). Not torchtitan or
# transformers: tests patch torch's fully_shard before those import it.
_PRELOAD = ["torch", "torch.distributed", "fsdp2", "tests._harness", "tests._impls", "tests.models"]


def _process_entry(
    rank: int,
    world_size: int,
    port: int,
    caller: tuple[str, dict[str, str]],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    cwd, environ = caller  # a fork of the server: take the caller's, as a spawned rank would
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
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
    """Run ``fn(*args)`` in ``world_size`` gloo processes (``fn`` must be importable).

    The processes are forks of a server that imported torch and fsdp2 once (see
    [Note: Forkserver ranks]); the first call starts that server.
    """
    multiprocessing.set_forkserver_preload(_PRELOAD)  # (read when the server starts: the first call)
    port = _free_port()
    caller = (os.getcwd(), dict(os.environ))
    mp.start_processes(
        _process_entry,
        args=(world_size, port, caller, fn, args),
        nprocs=world_size,
        join=True,
        start_method="forkserver",
    )


class C10dOps(TorchDispatchMode):
    """Counts the c10d ops (collectives, sends, receives) the calling thread dispatches while active.

    ``counts`` is keyed by op packet (``torch.ops.c10d._allgather_base_``, ``_reduce_scatter_base_``,
    ``allreduce_``, ``send``...), as ``CommDebugMode.get_comm_counts()`` is for these ops, without its
    module tracking and per-op bookkeeping (which took a third of a small model's gloo step).
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[Any] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d":
            self.counts[func.overloadpacket] += 1
        return func(*args, **(kwargs or {}))


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
