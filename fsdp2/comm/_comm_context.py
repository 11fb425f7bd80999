"""Communication context shared by every group under one root.

Owns: the side streams (CUDA only), the all-gather protocol on them (``all_gather_on_streams``, used
by single groups and buckets alike), the all-gather buffer kept alive across one group boundary in
forward, and the reduce-scatter buffers still in flight. One per ``RootContext`` (several roots share
one after ``share_comm_ctx``); states and groups read it through their root's context. Does not own:
what to gather (``AllGatherer``) or cross-group order (``Schedule``). A leaf: it imports nothing from
fsdp2.

[Note: Stream and event protocol]
On CUDA, an unshard in FORWARD/PRE_BACKWARD runs its copy-in on ``all_gather_copy_in_stream`` and its
collective on ``all_gather_stream``, which waits on the copy-in. Copy-out runs on the current stream
after waiting on the all-gather's event, so the CPU never blocks. The flat all-gather buffer was
allocated on the copy-in stream; it is kept (with a copy-out event) until the next group's wait makes
both all-gather streams wait on that event: the next copy-in must not overwrite the buffer while the
copy-out still reads it. The iteration's root makes the all-gather streams wait on the current stream
before the first copy-in, so the optimizer step that wrote the sharded parameters finishes first.
Inputs are produced on the copy-in stream itself (host-to-device copies under CPU offload, casts);
slices kept after forward for an int ``reshard_after_forward`` are written on the current stream, so
the next all-gather of that group first waits on an event recorded right after them.
Gradients: the reduce-scatter stream waits on the current stream (the unsharded gradients are ready),
reduces, views out and records a post-reduce event; the input buffer is kept until the next group's
post-backward makes the current stream wait on that event, and the end of backward waits on them all.
On CPU none of this exists: every event slot is ``None`` and work runs in program order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

_Staged = TypeVar("_Staged")

_Buffers = tuple[torch.Tensor, torch.Tensor | None]  # (all-gather output, its input: often a view of it)


def serves_on_streams(async_op: bool, serves_use: bool) -> bool:
    """Whether an all-gather runs on the side streams, where there are some (``use_streams``).

    An all-gather for a use in forward or backward (``serves_use``) that the compute stream waits for
    does (``CommContext.all_gather_on_streams``); an ``async_op`` unshard (the user waits on its work)
    and other all-gathers run in program order. The one place this choice is made, for single groups
    and buckets alike; callers test ``ctx.use_streams`` first (no streams on CPU).
    """
    return serves_use and not async_op


class CommContext:
    """Streams and in-flight buffers shared by all parameter groups of one root."""

    def __init__(self) -> None:
        self.use_streams = False
        self.all_gather_copy_in_stream: torch.cuda.Stream | None = None
        self.all_gather_stream: torch.cuda.Stream | None = None
        self.reduce_scatter_stream: torch.cuda.Stream | None = None
        # ((flat all-gather output, its input), copy-out event) of the last unshard, released once the
        # all-gather streams wait on copy-out (lazily in forward)
        self.deferred_all_gather: tuple[_Buffers, torch.Event | None] | None = None
        # (reduce-scatter input buffer, post-reduce event) still read by the reduce-scatter stream
        self.pending_reduce_scatters: list[tuple[torch.Tensor, torch.Event | None]] = []

    def lazy_init(self, device: torch.device) -> None:
        """Create the side streams on CUDA (once: several roots may share this context)."""
        if self.use_streams or device.type != "cuda":
            return
        self.use_streams = True
        high = -1  # high priority, so communication is not starved by compute kernels
        self.all_gather_copy_in_stream = torch.cuda.Stream(device, priority=high)
        self.all_gather_stream = torch.cuda.Stream(device, priority=high)
        self.reduce_scatter_stream = torch.cuda.Stream(device, priority=high)

    def all_gather_on_streams(
        self,
        copy_in: Callable[[], _Staged],
        issue: Callable[[_Staged], None],
        after: torch.Event | None = None,
    ) -> tuple[_Staged, torch.Event]:
        """The all-gather protocol on the side streams, for single groups and buckets alike.

        ``copy_in`` (which also makes the inputs: casts, host-to-device copies) runs on the copy-in
        stream, after ``after`` where given; ``issue`` runs on the all-gather stream once the copy-in
        is done. Returns what ``copy_in`` made and the event that marks the collective's end.
        """
        copy_in_stream, gather_stream = self.all_gather_copy_in_stream, self.all_gather_stream
        assert copy_in_stream is not None, "all-gather copy-in stream not initialized"
        assert gather_stream is not None, "all-gather stream not initialized"
        if after is not None:
            copy_in_stream.wait_event(after)
        with torch.cuda.stream(copy_in_stream):
            staged = copy_in()
        gather_stream.wait_stream(copy_in_stream)
        with torch.cuda.stream(gather_stream):
            issue(staged)
            event = gather_stream.record_event()
        return staged, event

    def reduce_on_stream(self, buffer: torch.Tensor, work: Callable[[], None]) -> torch.Event | None:
        """The reduce-scatter protocol, for single groups and buckets alike.

        On the side streams, ``work`` (reduce ``buffer`` and assign the shards) runs on the
        reduce-scatter stream after the current stream's writes; ``buffer`` stays referenced until
        the returned post-reduce event is waited on. Elsewhere ``work`` runs now and the result is
        ``None``.
        """
        stream = self.reduce_scatter_stream
        if not self.use_streams or stream is None:
            work()
            return None
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            work()
            event: torch.Event = stream.record_event()
        self.pending_reduce_scatters.append((buffer, event))
        return event

    def wait_for_current_stream(self, event: torch.Event | None = None) -> None:
        """All-gather streams wait for the optimizer: on ``event`` if given, else the current stream."""
        copy_in_stream, gather_stream = self.all_gather_copy_in_stream, self.all_gather_stream
        if copy_in_stream is None or gather_stream is None:
            return
        if event is not None:
            copy_in_stream.wait_event(event)
            gather_stream.wait_event(event)
            return
        current = torch.cuda.current_stream(copy_in_stream.device)  # the compute stream of their device
        copy_in_stream.wait_stream(current)
        gather_stream.wait_stream(current)

    def defer_all_gather_buffers(
        self, output: torch.Tensor, input_: torch.Tensor | None, device: torch.device, in_forward: bool
    ) -> None:
        """Keep a finished all-gather's buffers from reuse until the copy-out just queued is done.

        In forward, the next group's all-gather may start before this copy-out ends: the buffers
        are released when the next one is deferred. Elsewhere they are released now.
        """
        copy_out_event = torch.cuda.current_stream(device).record_event()
        self.release_deferred_all_gather()
        self.deferred_all_gather = ((output, input_), copy_out_event)
        if not in_forward:
            self.release_deferred_all_gather()

    def release_deferred_all_gather(self) -> None:
        """Let the all-gather streams reuse the last forward buffer once its copy-out is done."""
        deferred = self.deferred_all_gather
        if deferred is None:
            return
        self.deferred_all_gather = None
        event = deferred[1]
        copy_in_stream, gather_stream = self.all_gather_copy_in_stream, self.all_gather_stream
        if event is not None and copy_in_stream is not None and gather_stream is not None:
            copy_in_stream.wait_event(event)
            gather_stream.wait_event(event)

    def reset(self) -> None:
        """Forget in-flight work after an aborted iteration (the current stream waits for it first)."""
        self.retire_reduce_scatters()
        self.deferred_all_gather = None

    def retire_reduce_scatters(self, keep: int = 0) -> None:
        """Make the current stream wait on, and drop, the oldest reduce-scatter buffers in flight.

        ``keep`` buffers may stay in flight (``set_reduce_scatter_max_input_buffers`` minus one).
        """
        pending = self.pending_reduce_scatters
        while len(pending) > keep:
            buffer, event = pending.pop(0)
            if event is not None:
                torch.cuda.current_stream(buffer.device).wait_event(event)
