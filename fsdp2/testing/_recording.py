"""Recording the collectives one model issues: ``record_collectives(model)``.

Owns: ``CollectiveCall`` (one collective: kind, group, dtype, buffer sizes and the bytes this rank
sends), ``CollectiveLog`` (the calls, also a count by kind) and the recording comms it injects. The
recorder wraps the collectives of every ``fully_shard`` group under the model (all-gather,
reduce-scatter, HSDP all-reduce) through the engine's interface for the rooms above it
(``runtime``'s ``wrap_comms``) and puts the originals back on exit. Wrapped collectives behave exactly as
the originals: bucketing, buffer reuse and stream use
are unchanged, and the wrappers do not count as custom collectives. Unlike ``count_collectives`` it
patches no backend, so it works the same on the threaded test backend, gloo and NCCL, counts only the
model's FSDP collectives (not a loss all-reduce), and knows each call's module and bytes.
Does not own: the collectives (the groups' comms) or the process groups.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import ForwardingComm
from ..runtime import states_under, wrap_comms


@dataclass(frozen=True)
class CollectiveCall:
    """One collective a group issued on this rank.

    Attributes:
        kind: ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"`` or ``"all_to_all"``.
        module_fqn: the group's module (``""`` for the root).
        group_size: ranks in the process group.
        dtype: the dtype on the wire.
        input_bytes / output_bytes: this rank's buffers.
        sent_bytes: bytes this rank sends with a ring (all-gather, reduce-scatter, all-reduce) or
            pairwise (all-to-all) algorithm: ``(W-1)`` input blocks for an all-gather, ``(W-1)/W`` of the
            input for a reduce-scatter or all-to-all, ``2(W-1)/W`` of the tensor for an all-reduce.
    """

    kind: str
    module_fqn: str
    group_size: int
    dtype: torch.dtype
    input_bytes: int
    output_bytes: int
    sent_bytes: int


class CollectiveLog(collections.Counter[str]):
    """The calls recorded (``.calls``, in order); as a ``Counter``, the number of calls by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[CollectiveCall] = []

    def add(self, call: CollectiveCall) -> None:
        self.calls.append(call)
        self[call.kind] += 1

    def sent_bytes(self, kind: str | None = None) -> int:
        """Bytes this rank sent, over all calls or those of one ``kind``."""
        return sum(c.sent_bytes for c in self.calls if kind is None or c.kind == kind)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _sent(kind: str, world: int, input_bytes: int) -> int:
    if kind == "all_gather":
        return (world - 1) * input_bytes
    if kind == "all_reduce":
        return 2 * (world - 1) * input_bytes // world
    return (world - 1) * input_bytes // world  # reduce-scatter, all-to-all


class Recording(ForwardingComm):
    """Forwards to ``wrapped`` and records each call into ``log``."""

    def __init__(self, wrapped: Any, kind: str, module_fqn: Callable[[], str], log: CollectiveLog) -> None:
        super().__init__(wrapped)
        self._kind, self._fqn, self._log = kind, module_fqn, log

    def seen(self, first: torch.Tensor, *args: Any) -> None:
        kind = self._kind
        if kind == "all_reduce":  # (tensor, group, op)
            tensor, group = first, args[0]
            inp = out = _nbytes(tensor)
            dtype = tensor.dtype
        else:  # (output, input, group, ...)
            inp, out, group = _nbytes(args[0]), _nbytes(first), args[1]
            dtype = first.dtype
        world = dist.get_world_size(group)
        self._log.add(CollectiveCall(kind, self._fqn(), world, dtype, inp, out, _sent(kind, world, inp)))


@contextlib.contextmanager
def record_collectives(model: nn.Module) -> Iterator[CollectiveLog]:
    """Record the FSDP collectives ``model``'s groups issue on this rank inside the block.

    ``model`` is a ``fully_shard`` module (its tree's groups are recorded). The log counts calls by kind
    (``log["all_gather"]``) and keeps each call (``log.calls``) with its module and bytes.

    Example:
        >>> with fsdp2.testing.record_collectives(model) as log:  # doctest: +SKIP
        ...     model(x).sum().backward()
        >>> log["all_gather"], log.sent_bytes("reduce_scatter")  # doctest: +SKIP

    Raises:
        ValueError: ``model`` has no ``fully_shard`` module in its tree.
    """
    states = states_under(model)
    if not states:
        raise ValueError(
            f"record_collectives: {type(model).__name__} has no fully_shard module in its tree; pass the "
            "sharded model (call fully_shard first)."
        )
    log = CollectiveLog()

    def wrap(kind: str, comm: Any, module_fqn: Callable[[], str]) -> Any:
        return Recording(comm, kind, module_fqn, log)

    restore = wrap_comms(states, wrap)
    try:
        yield log
    finally:
        restore()
