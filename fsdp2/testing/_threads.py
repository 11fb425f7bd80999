"""Ranks as threads: run a function on N threads of this process, each a rank of one process group.

Owns: ``run_ranks`` and the threaded process-group set-up (torch's test backend for threads), result
collection in rank order, the error of the first failing rank, and the timeout that names hung
ranks. Does not own: what the function does (user code, fsdp2 or not).
Invariants: one run at a time per process (a lock); the threaded backend is installed only for the
duration of a run.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_run_lock = threading.Lock()


class RankError(RuntimeError):
    """A rank of :func:`run_ranks` raised; ``rank`` says which, the cause is chained."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class RanksTimeoutError(TimeoutError):
    """Some ranks of :func:`run_ranks` did not finish in time; ``ranks`` lists them."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` threads, each a rank; return their results.

    Every thread initializes the default process group (a threaded backend, CPU tensors) before calling
    ``fn``, so code inside it can call ``init_device_mesh("cpu", ...)``, ``fully_shard`` and any
    collective as in a ``torchrun`` job, and destroys it afterwards. Ranks share the process: build
    models from a seeded generator or broadcast them from rank 0 to give every rank the same values.

    Args:
        world_size: number of ranks (threads), at least 1.
        fn: called as ``fn(rank, world_size, *args)`` on each rank.
        args: extra arguments for ``fn``.
        timeout: seconds to wait for all ranks, and the process group's own timeout.

    Returns:
        The ranks' return values, in rank order.

    Raises:
        RankError: a rank raised (the first one, not ranks that only stopped because of it); the
            rank's traceback is in the message and its exception is chained.
        RanksTimeoutError: ranks still running after ``timeout`` seconds (e.g. waiting in a
            collective that other ranks never issued); the message names them.
    """
    value: object = world_size
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"run_ranks needs a world_size >= 1, got {world_size!r}.")
    if dist.is_initialized():
        raise RuntimeError(
            "run_ranks starts its own process groups, but this thread already has one; call it outside "
            "torch.distributed.init_process_group (e.g. from a plain test function)."
        )
    with _run_lock:
        return _run(world_size, fn, args, timeout, pass_rank=True)


def _forget_other_worlds_plans() -> None:
    """Clear DTensor's process-wide plan caches before a world of threads starts.

    Those caches key a plan by its meshes, and a ``DeviceMesh`` made on a thread equals another of
    the same ranks made on a thread with the same identifier. Threads of an earlier world are gone
    and their identifiers are reused, so a rank could be handed the redistribution plan an earlier
    world computed for another rank: with uneven shards, another rank's shapes (seen as a collective
    of mismatched sizes, or wrong values, in the third of four worlds run one after another).
    """
    from torch.distributed.tensor import DTensor, _redistribute

    _redistribute._gen_transform_infos.cache_clear()  # noqa: SLF001 - no public way to clear it
    _redistribute.clear_redistribute_planner_cache()
    propagator = DTensor._op_dispatcher.sharding_propagator  # noqa: SLF001 - idem
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()  # noqa: SLF001 - idem


def _run(
    world_size: int, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float, pass_rank: bool
) -> list[Any]:
    threaded = _threaded_pg()
    _forget_other_worlds_plans()
    threaded._install_threaded_pg()  # noqa: SLF001 - torch's test backend has no public switch
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # type: ignore[attr-defined]  # noqa: SLF001 - idem
    store = dist.HashStore()  # type: ignore[attr-defined]  # reason: not re-exported in the stubs
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException, str]] = []
    done = [False] * world_size

    def worker(rank: int) -> None:
        try:
            dist.init_process_group(
                "threaded", rank=rank, world_size=world_size, store=store, timeout=timedelta(seconds=timeout)
            )
            results[rank] = fn(rank, world_size, *args) if pass_rank else fn(*args)
        except BaseException as exc:  # reported to the caller below
            errors.append((rank, exc, traceback.format_exc()))
            threaded.ProcessLocalGroup.exception_handle(exc)
        finally:
            done[rank] = True
            if dist.is_initialized():
                # torch 2.11: its thread-local world lacks the `comms` destroy reads (harmless).
                with contextlib.suppress(AttributeError):
                    dist.destroy_process_group()

    threads = [
        threading.Thread(target=worker, args=(r,), daemon=True, name=f"rank{r}") for r in range(world_size)
    ]
    deadline = time.monotonic() + timeout
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
        finished = [rank for rank in range(world_size) if done[rank]]  # before waking the hung ones
        if hung and not errors:
            # Wake the ranks blocked in collectives so they end instead of lingering (their wake-up
            # errors are not the cause: the timeout is reported).
            threaded.ProcessLocalGroup.exception_handle(TimeoutError("run_ranks timed out"))
            for thread in threads:
                thread.join(5.0)
            errors.clear()
    finally:
        threaded.ProcessLocalGroup.reset()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)  # type: ignore[attr-defined]  # noqa: SLF001 - see above
        threaded._uninstall_threaded_pg()  # noqa: SLF001 - see above
    if errors:
        errors.sort(key=lambda e: (_is_secondary(e[1]), e[0]))
        rank, exc, tb = errors[0]
        raise RankError(f"rank {rank} of {world_size} failed:\n{tb}", rank) from exc
    if hung:
        raise RanksTimeoutError(
            f"ranks {hung} of {world_size} did not finish within {timeout:g} s (ranks {finished} had "
            "returned); the ones left are probably waiting in a collective that the others never issued.",
            hung,
        )
    return results


def _is_secondary(exc: BaseException) -> bool:
    """Errors other ranks raise only because one rank failed (the threaded backend's termination)."""
    text = str(exc).lower()
    return isinstance(exc, SystemExit) or "terminat" in text or "exception" in type(exc).__name__.lower()


def _threaded_pg() -> Any:
    from torch.testing._internal.distributed import multi_threaded_pg

    return multi_threaded_pg
