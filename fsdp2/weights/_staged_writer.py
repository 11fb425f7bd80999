"""One rank's checkpoint file, written in place or from a bounded set of staged host copies.

Owns: ``StagedWriter``: each chunk ``torch.save``-d into its slot of the rank's file (the layout's
offsets), rank 0's objects appended after its tensors, the file cut to its planned length; with a
staging budget, the caller copies chunks to host memory while a background thread writes them, and the
caller waits only while the staged bytes would pass the budget; the thread starts writing when the
budget is full or staging is done, so a state within the budget is copied without competing writes.
``BackgroundStaging``: the same staging from a thread of its own, so the call returns at once; every
optimizer step waits for it first (``_StepGate``, one global step pre-hook), since a step changes the
tensors in place.
Does not own: where the chunks go (``_flat_layout.py``), the commit (``_flat_save.py``).
Invariants: at most ``budget`` staged bytes are held at once (or one chunk, when a chunk is larger);
a failed write never stops the writer draining the queue, so the caller is never left waiting; a
failed staging closes the file all the same and becomes the save's problem.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ._flat_layout import LocalItem


class StagingPool:
    """Host buffers kept between saves (a layout's chunk sizes repeat), at most ``budget`` bytes in all.

    Buffers are byte tensors of exactly a chunk's size (``torch.save`` writes a whole storage), pinned
    when the chunks come from a GPU, so a later save copies into memory already mapped.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = {}
        self._kept = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int, pinned: bool) -> torch.Tensor:
        with self._lock:
            free = self._free.get((nbytes, pinned))
            if free:
                self._kept -= nbytes
                return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            if self._kept + buffer.numel() <= self.budget:
                self._free.setdefault((buffer.numel(), buffer.is_pinned()), []).append(buffer)
                self._kept += buffer.numel()


class StagedWriter:
    """Writes one rank's chunks into its file: inline (no ``pool``) or from a background thread."""

    def __init__(self, path: Path, pool: StagingPool | None) -> None:
        self._path = path
        self._pool = pool
        self._budget = pool.budget if pool is not None else 0
        self._held = 0
        self.peak_bytes = 0
        self._room = threading.Condition()
        self._problem = ""
        self._handle: BinaryIO | None = None
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._go = threading.Event()  # the thread writes once staging is done or the budget is full
        if pool is not None:
            self._thread = threading.Thread(target=self._drain, name="fsdp2-checkpoint-writer", daemon=True)
            self._thread.start()

    @property
    def path(self) -> Path:
        """The file this writer writes."""
        return self._path

    def put(self, item: LocalItem, tensor: torch.Tensor, *, stage: bool) -> None:
        """Write ``item``'s chunk (``tensor``'s local shard) now, or stage a host copy for the thread."""
        local = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach()
        if not stage:
            self._write(item, _compact_cpu(local))
            return
        size = local.numel() * local.element_size()
        with self._room:
            while self._held and self._held + size > self._budget:
                self._go.set()
                self._room.wait()
            self._held += size
            self.peak_bytes = max(self.peak_bytes, self._held)
        assert self._pool is not None
        buffer = self._pool.take(size, local.is_cuda)
        staged = (
            buffer.view(local.dtype).view(local.shape)
            if size
            else torch.empty(local.shape, dtype=local.dtype)
        )
        staged.copy_(local, non_blocking=local.is_cuda)
        copied = None
        if local.is_cuda:  # the thread waits for the copy; later kernels on this stream run after it
            copied = torch.cuda.Event()
            copied.record()
        self._queue.put((item, staged, buffer, copied))

    def close(self, end: int, objects: list[bytes]) -> None:
        """No more chunks: append ``objects`` at ``end`` (the tensors' planned length), cut the file there."""
        if self._thread is None:
            self._finish_file(end, objects)
        else:
            self._queue.put((end, objects))
            self._go.set()

    def fail(self, problem: str) -> None:
        """Record a problem met outside the writer (a staging copy that failed); the first one stays."""
        self._problem = self._problem or problem

    def finish(self) -> str:
        """Wait for the file to be complete; the problem met while writing (``""``: none)."""
        if self._thread is not None:
            self._thread.join()
        return self._problem

    def _drain(self) -> None:
        self._go.wait()  # copies first: the caller's staging does not compete with the writes
        while True:
            entry = self._queue.get()
            if len(entry) == 2:
                self._finish_file(*entry)
                return
            item, staged, buffer, copied = entry
            if copied is not None:
                copied.synchronize()
            self._write(item, staged)
            del staged
            assert self._pool is not None
            self._pool.give(buffer)
            with self._room:
                self._held -= buffer.numel()
                self._room.notify_all()

    def _open(self) -> BinaryIO | None:
        if self._handle is None and not self._problem:
            try:
                self._handle = open(self._path, "wb")  # noqa: SIM115 (closed by _finish_file)
            except OSError as error:
                self._problem = f"could not open {self._path}: {error}"
        return self._handle

    def _write(self, item: LocalItem, data: torch.Tensor) -> None:
        handle = self._open()
        if handle is None:
            return
        try:
            handle.seek(item.file_offset)
            torch.save(data, handle)
            used = handle.tell() - item.file_offset
        except (OSError, RuntimeError) as error:
            self._problem = f"writing {item.key!r} to {self._path} failed: {error}"
            return
        if used > item.slot:
            self._problem = (
                f"{item.key!r}: torch.save wrote {used} bytes, more than the {item.slot} planned for it; "
                "this torch's serialization is larger than fsdp2 allows for. "
                "Use torch.distributed.checkpoint.save."
            )

    def _finish_file(self, end: int, objects: list[bytes]) -> None:
        if not end and not objects:
            return
        handle = self._open()
        if handle is None:
            return
        try:
            handle.seek(end)
            for data in objects:
                handle.write(data)
            handle.truncate(handle.tell())
            handle.close()
        except OSError as error:
            self._problem = self._problem or f"finishing {self._path} failed: {error}"


class _StepGate:
    """One optimizer step pre-hook for the process, registered at the first background staging.

    It waits for every staging in flight. The stagings come and go from a set of their own: torch's
    hook table is never changed while an optimizer, on this or another thread, may be reading it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: set[BackgroundStaging] = set()
        self._hook: Any = None

    def add(self, staging: BackgroundStaging) -> None:
        with self._lock:
            self._active.add(staging)
            if self._hook is None:
                self._hook = register_optimizer_step_pre_hook(self._before_step)

    def discard(self, staging: BackgroundStaging) -> None:
        with self._lock:
            self._active.discard(staging)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        del optimizer, args, kwargs
        if not self._active:
            return
        with self._lock:
            pending = list(self._active)
        for staging in pending:
            staging.wait()


_GATE = _StepGate()


class BackgroundStaging:
    """Stages ``items`` (``(LocalItem, tensor)``) into ``writer`` from a thread, then closes the file.

    While it runs, any optimizer's ``step`` first waits for it (``_StepGate``): the step is what
    changes the saved parameters and optimizer state in place. CUDA copies are enqueued on the
    caller's current stream, so kernels the caller enqueues after ``wait()`` returns run after them.
    """

    def __init__(
        self,
        writer: StagedWriter,
        items: Sequence[tuple[LocalItem, torch.Tensor]],
        end: int,
        objects: list[bytes],
    ) -> None:
        self._writer = writer
        cuda = any(tensor.is_cuda for _, tensor in items)
        self._stream = torch.cuda.current_stream() if cuda else None
        self._thread = threading.Thread(
            target=self._run, args=(list(items), end, objects), name="fsdp2-checkpoint-stager", daemon=True
        )
        _GATE.add(self)
        self._thread.start()

    def done(self) -> bool:
        """Whether every chunk is copied (the tensors may change)."""
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Block until every chunk is copied."""
        self._thread.join()

    def _run(self, items: list[tuple[LocalItem, torch.Tensor]], end: int, objects: list[bytes]) -> None:
        key = ""
        try:
            stream = self._stream
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for item, tensor in items:
                    key = item.key
                    self._writer.put(item, tensor, stage=True)
        except Exception as error:  # reported by the commit, on every rank
            self._writer.fail(f"staging {key!r} failed: {type(error).__name__}: {error}")
        finally:
            _GATE.discard(self)
            self._writer.close(end, objects)


def _compact_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU with a storage of exactly its bytes (``torch.save`` writes whole storages)."""
    data = tensor.cpu()
    compact = data.is_contiguous() and data.storage_offset() == 0
    if compact and data.untyped_storage().nbytes() == data.numel() * data.element_size():
        return data
    return data.contiguous().clone()
