"""Test harness: run a function on N ranks, as threads or as real gloo processes.

Owns: the threaded process group set-up and the multiprocess spawner, rank-0 broadcast of
modules and inputs, and the sharded-parity assertion.
This is the only file in the project that imports ``torch.testing._internal``.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import os
import socket
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed import multi_threaded_pg

_THREAD_TIMEOUT_S = 240.0
_run_lock = threading.Lock()


def run_threaded(world_size: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` threads, each a rank of one threaded process group.

    Returns the per-rank return values. Re-raises the first rank's exception with its traceback.
    """
    with _run_lock:
        return _run_threaded_locked(world_size, fn, args)


def _run_threaded_locked(world_size: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> list[Any]:
    multi_threaded_pg._install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    store = dist.HashStore()
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException, str]] = []

    def worker(rank: int) -> None:
        try:
            dist.init_process_group(
                "threaded",
                rank=rank,
                world_size=world_size,
                store=store,
                timeout=timedelta(seconds=_THREAD_TIMEOUT_S),
            )
            results[rank] = fn(*args)
        except BaseException as exc:
            errors.append((rank, exc, traceback.format_exc()))
            multi_threaded_pg.ProcessLocalGroup.exception_handle(exc)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(world_size)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(_THREAD_TIMEOUT_S)
        hung = [i for i, t in enumerate(threads) if t.is_alive()]
    finally:
        multi_threaded_pg.ProcessLocalGroup.reset()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        multi_threaded_pg._uninstall_threaded_pg()
    if errors:
        # Report the root cause, not the "terminated" errors of the other ranks.
        errors.sort(key=lambda e: (_is_secondary(e[1]), e[0]))
        rank, exc, tb = errors[0]
        raise AssertionError(f"rank {rank} failed:\n{tb}") from exc
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {_THREAD_TIMEOUT_S}s (hang)")
    return results


def _is_secondary(exc: BaseException) -> bool:
    """Errors other ranks raise because one rank failed (the threaded backend's termination event)."""
    text = str(exc).lower()
    return isinstance(exc, SystemExit) or "terminat" in text or "exception" in type(exc).__name__.lower()


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
                torch.testing.assert_close(t.full_tensor(), ref_t, msg=lambda m, n=name: f"{n}: {m}")
            else:
                torch.testing.assert_close(t, ref_t, msg=lambda m, n=name: f"{n}: {m}")


_COLLECTIVE_KINDS = {
    "AllGather": "all_gather",
    "ReduceScatter": "reduce_scatter",
    "AllReduce": "all_reduce",
    "Broadcast": "broadcast",
}


class _CollectiveCounter:
    """Thread-local counts of the collectives issued on the threaded process group.

    Dispatch modes (``CommDebugMode`` included) cannot see threaded-PG collectives: that backend
    is a Python ``ProcessGroup`` and bypasses the c10d op dispatch. Every threaded collective does
    go through ``ProcessLocalGroup._start_coll`` on the calling rank's thread, so that is wrapped
    (once, while any thread counts) and each thread adds to its own counter.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._original: Any = None
        self._local = threading.local()

    def _install(self) -> None:
        cls = multi_threaded_pg.ProcessLocalGroup
        self._original = cls.__dict__["_start_coll"]
        start = self._original.__func__
        local = self._local

        def counting_start_coll(klass: Any, collective: Any, pg: Any) -> Any:
            counter = getattr(local, "counter", None)
            if counter is not None:
                name = type(collective).__name__
                kind = _COLLECTIVE_KINDS.get(name, name)
                counter[(kind, pg.size()) if local.by_group_size else kind] += 1
            return start(klass, collective, pg)

        cls._start_coll = classmethod(counting_start_coll)

    @contextlib.contextmanager
    def count(self, by_group_size: bool) -> Iterator[collections.Counter[Any]]:
        if getattr(self._local, "counter", None) is not None:
            raise RuntimeError("count_collectives() is already active on this thread")
        with self._lock:
            if self._users == 0:
                self._install()
            self._users += 1
        counter: collections.Counter[Any] = collections.Counter()
        self._local.by_group_size = by_group_size
        self._local.counter = counter
        try:
            yield counter
        finally:
            self._local.counter = None
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    multi_threaded_pg.ProcessLocalGroup._start_coll = self._original


_COLLECTIVE_COUNTER = _CollectiveCounter()


def count_collectives(
    *, by_group_size: bool = False
) -> contextlib.AbstractContextManager[collections.Counter[Any]]:
    """Count this rank's threaded-PG collectives by kind (``"all_gather"``, ``"reduce_scatter"``, ...).

    With ``by_group_size`` the keys are ``(kind, process group size)`` pairs instead.
    """
    return _COLLECTIVE_COUNTER.count(by_group_size)


if sys.platform == "win32":  # pragma: no cover - the project targets Linux
    raise ImportError("the test harness needs Linux (threaded and gloo process groups)")
