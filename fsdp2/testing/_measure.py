"""Measured peak memory per rank of a real (threaded) run, what ``estimate_memory`` is checked against.

Owns: ``measure_memory`` (``run_ranks`` with a storage tracker on every rank), and keeping the
threaded backend's own work out of the counts (one rank's thread moves every rank's data).
Does not own: the tracker or the report (``fsdp2.plan._memory``), the threads (``_threads``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from ..plan import MemoryReport, MemoryTracker, current_tracker, process_hooks, run_tracked
from ._counting import count_collectives
from ._threads import run_ranks


def measure_memory(
    world_size: int,
    build_model: Callable[[], Any],
    train_step: Callable[[Any], Any],
    *,
    steps: int = 2,
    timeout: float = 300.0,
) -> list[MemoryReport]:
    """Run the job for real on ``world_size`` thread ranks and return each rank's measured peaks.

    Takes the same ``build_model`` / ``train_step`` as :func:`fsdp2.estimate_memory` (both run on
    every rank, inside an initialized process group) and counts the live tensor storages each rank
    creates, phase by phase, with the same categories. Tensors hold real values and collectives
    communicate, so this costs the real compute and memory of every rank in this one process.
    """
    value: object = steps
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"measure_memory: steps must be an int >= 1, got {steps!r}.")

    def rank_fn(rank: int, size: int) -> MemoryReport:
        tracker = MemoryTracker()
        with count_collectives() as counts:
            run_tracked(tracker, build_model, train_step, steps)
        tracker.collectives.update(counts)
        dist.barrier()  # no rank frees its tensors while another still gathers from them
        return tracker.report(size, rank)

    with process_hooks(), _collectives_untracked():
        return run_ranks(world_size, rank_fn, timeout=timeout)


@contextlib.contextmanager
def _collectives_untracked() -> Iterator[None]:
    """Keep the threaded backend's own work and references out of the ranks' counts.

    It moves all ranks' data on rank 0's thread (not rank 0's memory) and keeps every rank's tensors
    in its meeting object until the next collective (a real backend lets go at completion).
    """
    from torch.testing._internal.distributed import multi_threaded_pg

    cls = multi_threaded_pg.Collective
    original: Any = cls.join

    def join(self: Any, rank: int, data: Any) -> Any:
        tracker = current_tracker()
        paused = tracker is not None and tracker.paused
        if tracker is not None:
            tracker.paused = True
        try:
            return original(self, rank, data)
        finally:
            self._data[rank] = None  # done for this rank: let its tensors go
            if tracker is not None:
                tracker.paused = paused

    cls.join = join  # type: ignore[method-assign]  # reason: the backend's one meeting point
    try:
        yield
    finally:
        cls.join = original  # type: ignore[method-assign]
