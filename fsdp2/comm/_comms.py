"""Collective implementations a group calls through: the injectable comm interface.

Owns: the ``Comm`` / ``AllGather`` / ``ReduceScatter`` interfaces (same names and call signatures as
torch's, so a user's subclass ports by changing the import), the built-in implementations (plain
``torch.empty`` buffers, buffers from the process group's own allocator, CUDA symmetric memory), the
HSDP all-reduce, ``check_comm`` (the validation of a user's object) and ``GroupComms``, the set one
group uses. Does not own: when a collective runs or which stream it runs on (``FSDPParamGroup`` and
``GradientReducer``), or buffer layouts (``_collectives``). A leaf: it imports nothing from fsdp2.
Invariants: ``allocate`` returns a contiguous tensor of exactly ``size`` elements' shape; a call
writes its result into ``output_tensor``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

Tensor = torch.Tensor
Group = dist.ProcessGroup
Work = dist.Work

# torch >= 2.10 names the single-tensor collectives *_single; older releases only have *_tensor. Looked
# up at each call, so a profiler's or a test's patch of torch.distributed's function sees fsdp2's calls.


def _all_gather_single(*args: Any, **kwargs: Any) -> Any:
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter_single(*args: Any, **kwargs: Any) -> Any:
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


class Comm(ABC):
    """A collective with its own buffer allocation: ``allocate`` decides how and where memory comes from."""

    @abstractmethod
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Return an uninitialized contiguous tensor of shape ``size`` for a collective's buffer."""


class AllGather(Comm):
    """All-gather: ``output_tensor`` (``W`` blocks) receives every rank's ``input_tensor``.

    fsdp2 allocates the output with :meth:`allocate`; the input is this rank's block of it (the
    collective runs in place). Called on the all-gather stream; a returned work object is waited on
    before the copy-out.
    """

    @abstractmethod
    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: Group, async_op: bool = False
    ) -> Work | None:
        """Gather ``input_tensor`` from every rank of ``group`` into ``output_tensor``."""


class ReduceScatter(Comm):
    """Reduce-scatter: rank ``j`` receives the reduction of block ``j`` of every rank's input.

    fsdp2 allocates both the input and the output with :meth:`allocate` and calls it synchronously on
    the reduce-scatter stream, with the reduce op its divide factors chose (``AVG`` or ``SUM``).
    """

    @abstractmethod
    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: Group, op: Any, async_op: bool = False
    ) -> Work | None:
        """Reduce ``input_tensor`` over ``group`` with ``op``; scatter its blocks into ``output_tensor``."""


def _start(
    collective: Any, out: Tensor, inp: Tensor, group: Group, async_op: bool, **extra: Any
) -> Work | None:
    """Issue one single-tensor collective; the work handle only when asked for asynchronous work."""
    handle: Work | None = collective(out, inp, group=group, async_op=async_op, **extra)
    return handle if async_op else None


def _empty(size: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(tuple(size), dtype=dtype, device=device)


class DefaultAllGather(AllGather):
    """``torch.empty`` buffers and ``all_gather_single``: what fsdp2 uses unless told otherwise."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A ``torch.empty`` buffer from the caching allocator of the current stream."""
        return _empty(size, dtype, device)

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: Group, async_op: bool = False
    ) -> Work | None:
        """``all_gather_single`` over ``group``."""
        return _start(_all_gather_single, output_tensor, input_tensor, group, async_op)


class DefaultReduceScatter(ReduceScatter):
    """``torch.empty`` buffers and ``reduce_scatter_single``."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A ``torch.empty`` buffer from the caching allocator of the current stream."""
        return _empty(size, dtype, device)

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: Group, op: Any, async_op: bool = False
    ) -> Work | None:
        """``reduce_scatter_single`` over ``group``."""
        return _start(_reduce_scatter_single, output_tensor, input_tensor, group, async_op, op=op)


def comm_type(comm: Any) -> type:
    """The type of the collective ``comm`` stands for: a wrapper's (``comm.wrapped``) is its inner one's.

    What bucket keys compare and fast paths test, so that a forwarding wrapper (e.g. the recorder of
    ``fsdp2.testing.record_collectives``) changes nothing about how collectives are issued.
    """
    while hasattr(comm, "wrapped"):
        comm = comm.wrapped
    return type(comm)


class ForwardingComm:
    """Forwards every call to ``wrapped`` after showing it to ``seen`` (recorders, counters).

    The engine treats it as ``wrapped`` (``comm_type``): bucketing and fast paths are unchanged, and it
    does not count as a custom collective. Subclasses override ``seen``.
    """

    def __init__(self, wrapped: Any) -> None:
        self.wrapped = wrapped

    def allocate(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapped.allocate(*args, **kwargs)

    def seen(self, *args: Any) -> None:
        """Called with the call's positional arguments before it is forwarded."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.seen(*args)
        return self.wrapped(*args, **kwargs)


class AllReduce:
    """The HSDP all-reduce across replicas (not user-replaceable, as in torch)."""

    def __call__(self, tensor: torch.Tensor, group: dist.ProcessGroup, op: Any) -> None:
        dist.all_reduce(tensor, op=op, group=group)


class AllToAll:
    """The all-to-alls of a tree-ordered gradient reduction: shard group, HSDP replicas (``_ordered.py``)."""

    def __call__(self, output: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        dist.all_to_all_single(output, input_tensor, group=group)


class ReplicaAllGather:
    """HSDP, tree-ordered gradient reduction: the replicas' reduced chunks (see ``_ordered.py``)."""

    def __call__(self, output: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        _all_gather_single(output, input_tensor, group=group)


def _process_group_buffer(
    group: dist.ProcessGroup, size: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A buffer from ``group``'s backend allocator where it has one (NCCL zero-copy), else ``torch.empty``."""
    try:
        backend = group._get_backend(device)  # noqa: SLF001 - the backend allocator has no public accessor
    except (RuntimeError, ValueError):
        return _empty(size, dtype, device)
    supports = getattr(backend, "supports_tensor_alloc", None)
    if supports is not None and supports(device):
        flat: torch.Tensor = backend.allocate_tensor(math.prod(size), dtype=dtype, device=device)
        return flat.view(tuple(size))
    return _empty(size, dtype, device)


class ProcessGroupAllocAllGather(DefaultAllGather):
    """All-gather whose output comes from the process group's own allocator, if it has one."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer from the process group's backend allocator (``torch.empty`` when unsupported)."""
        return _process_group_buffer(self._group, size, dtype, device)


class ProcessGroupAllocReduceScatter(DefaultReduceScatter):
    """Reduce-scatter whose buffers come from the process group's own allocator, if it has one."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer from the process group's backend allocator (``torch.empty`` when unsupported)."""
        return _process_group_buffer(self._group, size, dtype, device)


def _symmetric_memory() -> Any:
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem


def check_symmetric_memory(device: torch.device, backend: str) -> None:
    """Raise unless symmetric memory can serve ``device`` with ``backend`` (CUDA and NCCL only)."""
    if backend != "NCCL":
        raise ValueError(f"set_symm_mem_for_comm supports backend='NCCL' only, got {backend!r}.")
    if device.type != "cuda" or not dist.is_nccl_available():
        raise RuntimeError(
            f"set_symm_mem_for_comm needs CUDA tensors and NCCL, but this group communicates on {device} "
            f"(NCCL available: {dist.is_nccl_available()}). Leave it off on this machine; the default "
            "collectives need no setting."
        )


class _SymmMemMixin:
    """Buffers from NCCL symmetric memory (CUDA only), registered with the group before each use."""

    def _setup(self, group: dist.ProcessGroup, backend: Literal["NCCL"]) -> None:
        _symmetric_memory().set_backend(backend)
        dist.barrier(group=group)  # the communicator must exist before the first rendezvous

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer from the symmetric-memory pool of ``device``."""
        pool = _symmetric_memory().get_mem_pool(device)
        with torch.cuda.use_mem_pool(pool, device=device):
            return _empty(size, dtype, device)


class SymmMemAllGather(_SymmMemMixin, DefaultAllGather):
    """All-gather into a symmetric-memory output (NCCL picks its copy-engine or symmetric kernels)."""

    def __init__(self, group: dist.ProcessGroup, backend: Literal["NCCL"] = "NCCL") -> None:
        self._setup(group, backend)

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: Group, async_op: bool = False
    ) -> Work | None:
        """Register ``output_tensor`` with ``group``, then all-gather in place."""
        _symmetric_memory().rendezvous(output_tensor, group=group.group_name)
        return super().__call__(output_tensor, input_tensor, group, async_op)


class SymmMemReduceScatter(_SymmMemMixin, DefaultReduceScatter):
    """Reduce-scatter between symmetric-memory buffers."""

    def __init__(self, group: dist.ProcessGroup, backend: Literal["NCCL"] = "NCCL") -> None:
        self._setup(group, backend)

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: Group, op: Any, async_op: bool = False
    ) -> Work | None:
        """Register both buffers (both come from the pool) with ``group``, then reduce-scatter."""
        symm_mem = _symmetric_memory()
        symm_mem.rendezvous(input_tensor, group=group.group_name)
        symm_mem.rendezvous(output_tensor, group=group.group_name)
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def check_comm(comm: object, kind: str) -> None:
    """Raise ``TypeError`` unless ``comm`` looks like an ``AllGather``/``ReduceScatter`` (``kind``).

    Objects of torch's own interface classes qualify: only ``allocate`` and ``__call__`` are used.
    """
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(
            f"set_custom_{kind} expects an object with allocate(size, *, dtype, device) and a call method "
            f"(subclass fsdp2.{'AllGather' if kind == 'all_gather' else 'ReduceScatter'}), got "
            f"{type(comm).__name__}."
        )


@dataclass
class GroupComms:
    """The collectives one group calls.

    Attributes:
        all_gather: an ``AllGather`` (or any object with its two methods, e.g. torch's).
        reduce_scatter: a ``ReduceScatter`` (likewise).
        all_reduce: the HSDP all-reduce.
        all_to_all / replica_all_to_all / replica_all_gather: the collectives of a tree-ordered
            reduction (``_ordered.py``).
        custom: a user object replaced a default (``set_custom_*``).
        reduce_scatter_group: a process group of its own for the reduce-scatter
            (``set_separate_reduce_scatter_group``), else ``None``: the shard group.
    """

    all_gather: Any = field(default_factory=DefaultAllGather)
    reduce_scatter: Any = field(default_factory=DefaultReduceScatter)
    all_reduce: AllReduce = field(default_factory=AllReduce)
    all_to_all: AllToAll = field(default_factory=AllToAll)
    replica_all_to_all: AllToAll = field(default_factory=AllToAll)
    replica_all_gather: ReplicaAllGather = field(default_factory=ReplicaAllGather)
    custom: bool = False
    reduce_scatter_group: dist.ProcessGroup | None = None
