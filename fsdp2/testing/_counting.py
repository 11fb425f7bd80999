"""Counting collectives per rank: ``count_collectives()``.

Owns: a thread-local counter of the collectives the calling rank issues, by kind. On the threaded
test backend (``run_ranks``) it wraps the backend's single entry point while anyone counts (each
thread counts its own); on real backends (gloo, NCCL processes) it uses torch's ``CommDebugMode``.
Does not own: the collectives themselves.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

_KINDS = {
    "AllGather": "all_gather",
    "ReduceScatter": "reduce_scatter",
    "AllReduce": "all_reduce",
    "Broadcast": "broadcast",
    "Scatter": "scatter",
    "Gather": "gather",
    "AllToAll": "all_to_all",
    "AllToAllBase": "all_to_all",
}
_DEBUG_MODE_KINDS = {
    "all_gather_into_tensor": "all_gather",
    "_allgather_base_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "all_reduce": "all_reduce",
    "allreduce_": "all_reduce",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}


class _ThreadedCounter:
    """Wraps the threaded backend's collective entry point while at least one thread counts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._original: Any = None
        self._local = threading.local()

    def _install(self) -> None:
        from torch.testing._internal.distributed import multi_threaded_pg

        cls = multi_threaded_pg.ProcessLocalGroup
        self._original = cls.__dict__["_start_coll"]
        start = self._original.__func__
        local = self._local

        def counting_start_coll(klass: Any, collective: Any, pg: Any) -> Any:
            counter = getattr(local, "counter", None)
            if counter is not None:
                name = type(collective).__name__
                kind = _KINDS.get(name, name)
                counter[(kind, pg.size()) if local.by_group_size else kind] += 1
            return start(klass, collective, pg)

        cls._start_coll = classmethod(counting_start_coll)  # type: ignore[method-assign,assignment]  # reason: the backend's one entry point

    def _uninstall(self) -> None:
        from torch.testing._internal.distributed import multi_threaded_pg

        setattr(multi_threaded_pg.ProcessLocalGroup, "_start_coll", self._original)  # noqa: B010 - restore

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
                    self._uninstall()


_THREADED = _ThreadedCounter()


@contextlib.contextmanager
def count_collectives(*, by_group_size: bool = False) -> Iterator[collections.Counter[Any]]:
    """Count the collectives the calling rank issues inside the block, by kind.

    Keys are ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``, ``"broadcast"`` (other kinds by
    their own name); with ``by_group_size`` (threaded backend only) they are ``(kind, group size)``.

    Example:
        >>> with fsdp2.testing.count_collectives() as counts:  # doctest: +SKIP
        ...     model(x).sum().backward()
        >>> counts["all_gather"], counts["reduce_scatter"]  # doctest: +SKIP
    """
    if dist.is_initialized() and dist.get_backend() == "threaded":
        with _THREADED.count(by_group_size) as counter:
            yield counter
        return
    if by_group_size:
        raise ValueError("count_collectives(by_group_size=True) needs the threaded backend of run_ranks.")
    from torch.distributed.tensor.debug import CommDebugMode

    counter = collections.Counter()
    mode = CommDebugMode()
    with mode:
        yield counter
    for op, n in mode.get_comm_counts().items():
        name = getattr(op, "__name__", str(op)).split(".")[-1]
        counter[_DEBUG_MODE_KINDS.get(name, name)] += n
