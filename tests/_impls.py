"""The two FSDP implementations every behaviour test runs against: ``fsdp2`` and ``torch``.

Owns: the ``Impl`` record (``fully_shard``, ``FSDPModule``, ``record_events``), the lazy import
of ``fsdp2``, and the event recorder for torch's ``fully_shard``, which wraps the param-group class
methods.
Invariants: both recorders yield the same thing, a live sequence of
``(kind, module_fqn, state_name)`` tuples holding only the calling thread's events.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

Event = tuple[str, str, str]  # (kind, module_fqn, TrainingState name)

IMPL_NAMES = ("fsdp2", "torch")


class EventLog(Sequence[Event]):
    """A live view over a recorder's raw event list, converting each entry on read.

    It compares equal to a plain list of tuples, and ``clear()`` empties the underlying list,
    so a test can check one phase (forward, backward) at a time.
    """

    def __init__(self, raw: list[Any], convert: Callable[[Any], Event]) -> None:
        self._raw = raw
        self._convert = convert

    def __len__(self) -> int:
        return len(self._raw)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self._convert(e) for e in self._raw[index]]
        return self._convert(self._raw[index])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, EventLog | list | tuple):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # reason: mutable, compared by value

    def __repr__(self) -> str:
        return f"EventLog({list(self)!r})"

    def clear(self) -> None:
        self._raw.clear()

    def take(self, kinds: Sequence[str] | None = None) -> list[Event]:
        """Return the events so far (optionally only some kinds) and clear the log."""
        events = [e for e in self if kinds is None or e[0] in kinds]
        self.clear()
        return events


@dataclass(frozen=True)
class Impl:
    name: str
    fully_shard: Callable[..., Any]
    FSDPModule: type[nn.Module]
    record_events: Callable[[], contextlib.AbstractContextManager[EventLog]]

    def __repr__(self) -> str:
        return f"Impl({self.name})"


# --------------------------------------------------------------------------------------------
# fsdp2 (the implementation under test)
# --------------------------------------------------------------------------------------------


def _load_fsdp2() -> Impl:
    import fsdp2  # an import error fails every fsdp2 test: it must never turn into skips

    @contextlib.contextmanager
    def record_events() -> Iterator[EventLog]:
        with fsdp2.record_events() as raw:
            yield EventLog(raw, lambda e: (e.kind, e.module_fqn, e.training_state.name))

    return Impl("fsdp2", fsdp2.fully_shard, fsdp2.FSDPModule, record_events)


# --------------------------------------------------------------------------------------------
# torch.distributed.fsdp (the reference)
# --------------------------------------------------------------------------------------------


class _TorchGroupPatch:
    """Process-wide wrappers around ``FSDPParamGroup.unshard/reshard/post_backward``.

    The patch is shared by all threads (ranks) of a run and installed while at least one thread
    is recording; each thread appends to its own sink, so ranks never see each other's events.
    The no-op filters match what ``fsdp2.record_events()`` records (docs/design.md, "The event
    trace"): an unshard only when an all-gather is really issued, no reshard for the no-op one in
    forward with ``reshard_after_forward`` off.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._originals: dict[str, Callable[..., Any]] = {}
        self._local = threading.local()

    def _sink(self) -> list[Event] | None:
        return getattr(self._local, "sink", None)

    def _install(self) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
        from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        orig_unshard = FSDPParamGroup.unshard
        orig_reshard = FSDPParamGroup.reshard
        orig_post_backward = FSDPParamGroup.post_backward
        sink_of = self._sink

        def unshard(group: Any, *args: Any, **kwargs: Any) -> Any:
            sink = sink_of()
            real = group._all_gather_result is None and group._sharded_state != ShardedState.UNSHARDED
            if sink is not None and real:
                sink.append(("unshard", group._module_fqn, group._training_state.name))
            return orig_unshard(group, *args, **kwargs)

        def reshard(group: Any, *args: Any, **kwargs: Any) -> Any:
            sink = sink_of()
            no_op = group._training_state == TrainingState.FORWARD and not group._reshard_after_forward
            if sink is not None and not no_op:
                sink.append(("reshard", group._module_fqn, group._training_state.name))
            return orig_reshard(group, *args, **kwargs)

        def post_backward(group: Any, *args: Any, **kwargs: Any) -> Any:
            out = orig_post_backward(group, *args, **kwargs)
            sink = sink_of()
            if sink is not None:
                sink.append(("post_backward", group._module_fqn, group._training_state.name))
            return out

        self._originals = {
            "unshard": orig_unshard,
            "reshard": orig_reshard,
            "post_backward": orig_post_backward,
        }
        FSDPParamGroup.unshard = unshard  # type: ignore[method-assign]  # reason: test-only patch
        FSDPParamGroup.reshard = reshard  # type: ignore[method-assign]  # reason: test-only patch
        FSDPParamGroup.post_backward = post_backward  # type: ignore[method-assign]  # reason: test-only patch

    def _uninstall(self) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        for name, fn in self._originals.items():
            setattr(FSDPParamGroup, name, fn)
        self._originals = {}

    @contextlib.contextmanager
    def record(self) -> Iterator[EventLog]:
        if self._sink() is not None:
            raise RuntimeError("record_events() is already active on this thread")
        with self._lock:
            if self._users == 0:
                self._install()
            self._users += 1
        raw: list[Event] = []
        self._local.sink = raw
        try:
            yield EventLog(raw, lambda e: e)
        finally:
            self._local.sink = None
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    self._uninstall()


_TORCH_PATCH = _TorchGroupPatch()


def _load_torch() -> Impl:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    return Impl("torch", fully_shard, FSDPModule, _TORCH_PATCH.record)


def get_impl(name: str) -> Impl:
    """Return the named implementation."""
    if name == "fsdp2":
        return _load_fsdp2()
    if name == "torch":
        return _load_torch()
    raise ValueError(f"unknown implementation: expected one of {IMPL_NAMES}, got {name!r}")


def torch_impl() -> Impl:
    """The reference implementation, for differential tests."""
    return _load_torch()


def shard_blocks_then_root(
    impl: Impl,
    model: nn.Module,
    blocks: Sequence[nn.Module],
    *,
    reshard_after_forward: bool | int | None = None,
    composable_checkpoint: bool = False,
) -> None:
    """The usual bottom-up wrapping: each block gets its own ``fully_shard``, then the root.

    With ``composable_checkpoint``, ``torch.distributed._composable.checkpoint`` is applied to
    each block before it is sharded.
    """
    if composable_checkpoint:
        from torch.distributed._composable import checkpoint

    for block in blocks:
        if composable_checkpoint:
            checkpoint(block)
        impl.fully_shard(block, reshard_after_forward=reshard_after_forward)
    impl.fully_shard(model, reshard_after_forward=reshard_after_forward)
