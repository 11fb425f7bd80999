"""``fsdp2.Snapshots``: every N-th step in node memory and on a buddy node; a restart restores from them.

Owns: the snapshot of one step (captured on the critical path; written here, sent to the buddy and
committed on a thread of its own, on a gloo group of its own), the commit (a step counts once every
rank has written its own and its buddies' copies; only then are older steps dropped, and a step that
is not committed is dropped at once), the restore on start and the figures of the last snapshot. Does
not own the checks made when it is built (``_nodes``). See docs/resilience.md.

[Note: When a snapshot counts]
A restore takes the newest step of which every old rank's snapshot is found, whole, on some surviving
node. A node drops a step only after one all-reduce has told every rank that every copy of a newer
step is written, so until a snapshot is complete on both holders the previous one stays, and a node
lost in the middle of a copy costs at most the steps since the previous snapshot. A step that one rank
could not write (a full ``/dev/shm``) is dropped on every node, so a node holds at most the committed
snapshot and the one in flight, however many copies fail.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from ..base import warn_user
from ._format import RankSnapshot, capture, check_layouts, encode_header, host_bytes
from ._nodes import check_restartable, check_separate_storage, warn_other_jobs
from ._restore import apply, reshard_newest
from ._ring import Ring, key_hash
from ._store import ENV_DIR, NodeStore, default_root, job_identity


@dataclass(frozen=True)
class SnapshotStats:
    """One snapshot on this rank: seconds on the training path and in all, bytes sent and kept in memory.

    ``host_bytes`` counts this rank's own snapshot file and the copies it keeps for its buddies (0 for a
    snapshot not committed: its files are dropped); ``failed`` is why it was not committed ("" when it
    was).
    """

    step: int
    critical_s: float
    total_s: float
    bytes_sent: int
    host_bytes: int
    failed: str = ""


@dataclass(frozen=True)
class Restored:
    """What ``Snapshots.restore`` did: the step restored (``None``: none) and one line saying so.

    ``lost`` is true when snapshot files were found but no step of them is whole on the surviving nodes,
    lost or damaged (the caller falls back to a checkpoint on disk, or stops).
    """

    step: int | None
    message: str
    lost: bool = False
    seconds: float = 0.0


def _stage(name: str, step: int) -> None:
    """Called at each point of a copy: own_written, buddies_written, committed (tests stop there)."""


class Snapshots:
    """Snapshots of a sharded model, its optimizer and the job's own state, kept in memory on two nodes.

    ``save(step)`` after every optimizer step takes a snapshot when ``step`` is a multiple of ``every``:
    each rank copies its shards of the parameters and optimizer state and the ``state_dict()`` of each
    object in ``state`` to the host (the only part on the training path), then, on a thread of its
    own, writes them into its node's snapshot directory and sends them to a rank on the next node,
    which writes them into its own. ``restore()`` on start finds the newest snapshot whole among the
    surviving nodes, reshards it onto this job's ranks through collectives and loads it.

    Construct it on every rank, after the optimizer (it creates a gloo process group, exchanges where
    each rank runs and checks that each node's directory is its own).

    Args:
        model: the ``fully_shard`` model (FSDP on a 1-D mesh or HSDP on a (replicate, shard) mesh), or an
            ``fsdp2.replicate`` one.
        optimizer: its optimizer, or ``None``.
        every: snapshot every ``every`` steps (``save(step)`` with ``step % every == 0``).
        state: objects with ``state_dict()`` and ``load_state_dict()`` (a learning-rate scheduler, a data
            loader's position): rank ``j`` of a restored job loads the state of old rank ``j % old_world``.
        name: a folder name for the kind of job (``<directory>/<name>/job-<job>``).
        directory: where this node keeps them (default ``$FSDP2_SNAPSHOT_DIR``, else
            ``/dev/shm/fsdp2-snapshots-<uid>``).
        job: the job's identity, the same across its restarts and different between jobs (default
            ``$FSDP2_SNAPSHOT_JOB``, else torchrun's run id): a restore reads only this job's snapshots.

    Raises:
        ValueError: ``every`` is not a positive int, ``name`` is empty or has a path separator, no ``job``
            identity is known, two nodes' directories are one storage (a network file system), or the
            model has a parameter laid out other than FSDP, HSDP or replicate lay it out.
        TypeError: ``state`` holds an object without ``state_dict``/``load_state_dict``.
        RuntimeError: torchrun may restart the job but shares its store between rounds (the restart
            would fail: launch it with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), or a node cannot write
            its directory.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        every: int,
        state: Mapping[str, Any] | None = None,
        name: str = "default",
        directory: str | Path | None = None,
        job: str | None = None,
    ) -> None:
        _check_arguments(every, name, state or {})
        check_layouts(get_model_state_dict(model))  # an unsupported layout is refused now
        self.model, self.optimizer, self.every = model, optimizer, every
        self.states: dict[str, Any] = dict(state or {})
        owns_root = directory is None and not os.environ.get(ENV_DIR)
        root = Path(directory) if directory is not None else default_root()
        self.store = NodeStore(root, name, job_identity(job), owns_root=owns_root)
        check_restartable()
        self.group = dist.new_group(backend="gloo")
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        key = f"{socket.gethostname()}:{self.store.directory.resolve()}"
        hashes = torch.empty(self.world, dtype=torch.int64)  # every rank's key, one integer each
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.10
        all_gather(hashes, torch.tensor([key_hash(key)], dtype=torch.int64), group=self.group)
        self.ring = Ring.of_hashes(hashes)
        check_separate_storage(self.store, self.ring, key, self.rank, self.group)
        if self.ring.is_leader(self.rank):
            warn_other_jobs(self.store)
        self.last: SnapshotStats | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._outcome: SnapshotStats | None = None

    @property
    def directory(self) -> Path:
        """This node's snapshot directory for this job."""
        return self.store.directory

    # -- taking snapshots ----------------------------------------------------------------------------

    def save(self, step: int, *, force: bool = False) -> bool:
        """After optimizer step ``step`` (steps done): snapshot it if ``step % every == 0`` or ``force``.

        Returns whether a snapshot was started. Waits first for the previous snapshot's copy.
        """
        if not force and step % self.every:
            return False
        start = time.perf_counter()
        self.wait()
        tree = {
            "model": get_model_state_dict(self.model),
            "optim": {} if self.optimizer is None else get_optimizer_state_dict(self.model, self.optimizer),
            "state": {name: target.state_dict() for name, target in self.states.items()},
        }
        snapshot = capture(tree, step, self.world, self.rank)
        critical = time.perf_counter() - start
        self._thread = threading.Thread(target=self._copy, args=(snapshot, start, critical), daemon=True)
        self._thread.start()
        return True

    def wait(self) -> SnapshotStats | None:
        """Finish the copy in flight, if any; its figures (also in ``last``), or ``None``.

        Warns when a copy could not be written on some rank: that snapshot is not used, the previous one
        stays. Raises what the copy raised otherwise (a peer gone in the middle of the exchange).
        """
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"fsdp2 snapshot: the copy failed on rank {self.rank}: {error}") from error
        self.last = self._outcome
        if self.last is not None and self.last.failed:
            warn_user(
                f"fsdp2 snapshot of step {self.last.step} not kept ({self.last.failed}); the previous one "
                "stays"
            )
        return self.last

    def _copy(self, snapshot: RankSnapshot, start: float, critical: float) -> None:
        try:
            self._outcome = self._copy_and_commit(snapshot, start, critical)
        except BaseException as error:
            self._error = error

    def _copy_and_commit(self, snapshot: RankSnapshot, start: float, critical: float) -> SnapshotStats:
        header = encode_header(snapshot)
        payload = snapshot.payload
        problem = self._write(snapshot.step, self.rank, [header, host_bytes(payload)])
        _stage("own_written", snapshot.step)
        received = self._swap(torch.frombuffer(bytearray(header), dtype=torch.uint8), payload)
        for source, (their_header, their_payload) in received.items():
            parts: list[bytes | memoryview] = [host_bytes(their_header), host_bytes(their_payload)]
            problem = self._write(snapshot.step, source, parts) or problem  # every copy it can
        _stage("buddies_written", snapshot.step)
        done = torch.tensor([0 if problem else 1], dtype=torch.int64)
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self.group)  # every copy of every rank is written
        if self.ring.is_leader(self.rank):  # the committed snapshot stays, and nothing else
            if int(done.item()):
                self.store.drop_before(snapshot.step)
            else:
                self.store.drop(snapshot.step)
        _stage("committed", snapshot.step)
        sent = len(header) + payload.numel() if self.ring.buddy_of(self.rank) is not None else 0
        kept = self.store.size_of(snapshot.step, [self.rank, *received]) if int(done.item()) else 0
        failed = "" if int(done.item()) else (problem or "a copy failed on another rank")
        return SnapshotStats(snapshot.step, critical, time.perf_counter() - start, sent, kept, failed)

    def _write(self, step: int, rank: int, parts: list[bytes | memoryview]) -> str:
        """Write one snapshot file; the problem in one line, or "" (the commit then tells every rank)."""
        try:
            self.store.write(step, rank, parts)
        except OSError as error:
            return f"writing {self.store.file(step, rank)} failed: {error}"
        return ""

    def _swap(
        self, header: torch.Tensor, payload: torch.Tensor
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Send this rank's snapshot to its buddy; receive those it keeps a copy of.

        The sizes travel first, from each rank to its buddy alone (two integers, tag 0), so a rank
        hears only from the ranks it keeps copies for, whatever the world size.
        """
        works = []
        buddy = self.ring.buddy_of(self.rank)
        if buddy is not None:
            peer = dist.get_global_rank(self.group, buddy)
            sizes = torch.tensor([header.numel(), payload.numel()], dtype=torch.int64)
            works.append(dist.isend(sizes, peer, group=self.group, tag=0))
            works.append(dist.isend(header, peer, group=self.group, tag=1))
            if payload.numel():
                works.append(dist.isend(payload, peer, group=self.group, tag=2))
        sources = self.ring.kept_for(self.rank)
        their_sizes = {source: torch.empty(2, dtype=torch.int64) for source in sources}
        for source, size in their_sizes.items():
            dist.recv(size, dist.get_global_rank(self.group, source), group=self.group, tag=0)
        received = {}
        for source in sources:
            header_size, payload_size = their_sizes[source].tolist()
            theirs = (
                torch.empty(header_size, dtype=torch.uint8),
                torch.empty(payload_size, dtype=torch.uint8),
            )
            peer = dist.get_global_rank(self.group, source)
            works.append(dist.irecv(theirs[0], peer, group=self.group, tag=1))
            if payload_size:
                works.append(dist.irecv(theirs[1], peer, group=self.group, tag=2))
            received[source] = theirs
        for work in works:
            if work is not None:
                work.wait()
        return received

    # -- restoring -----------------------------------------------------------------------------------

    def restore(self, *, newer_than: int = -1) -> Restored:
        """Load the newest snapshot whole on the surviving nodes, if it is newer than step ``newer_than``.

        Call it on every rank before training. Reads only this node's snapshot directory; the shards of
        a lost node come from its buddies' copies, and every shard reaches its new rank through one
        all-to-all, whatever the new world size.
        """
        self.wait()  # a copy in flight uses the same group
        start = time.perf_counter()
        listing, damaged = self.store.listing()
        result = reshard_newest(
            self.store,
            [entry for entry in listing if entry.step > newer_than],
            [entry for entry in damaged if entry.step > newer_than],
            self.group,
            self.model,
            len(self.ring.members(self.ring.node(self.rank))),
        )
        if result is None:
            return Restored(
                None, f"no snapshot of this job in {self.directory} or on any other node: starting afresh"
            )
        if isinstance(result, str):
            return Restored(None, f"no whole snapshot: {result}", lost=True)
        choice = result.choice
        apply(self.model, self.optimizer, self.states, result.leaves, result.tree, result.values)
        dist.barrier(group=self.group)
        if self.ring.is_leader(self.rank):
            self.store.drop_other_than(choice.step)  # older ones, and newer ones the lost run left unfinished
        seconds = time.perf_counter() - start
        message = (
            f"restored step {choice.step} from memory snapshots: {choice.old_world} -> {self.world} ranks "
            f"in {seconds:.2f} s"
        )
        if result.skipped:
            message += f"; skipped {len(result.skipped)} damaged file(s): {result.skipped[0]}"
        return Restored(choice.step, message, seconds=seconds)

    # -- the end -------------------------------------------------------------------------------------

    def close(self, *, discard: bool = False) -> None:
        """Finish the copy in flight; with ``discard``, free this job's snapshots on every node.

        A finished job has nothing to resume. Collective when ``discard`` is true. Removes the job's
        folder, its ``<name>`` folder when no other job's is left there, and the default root when empty.
        """
        self.wait()
        if discard:
            dist.barrier(group=self.group)
            if self.ring.is_leader(self.rank):
                self.store.clear()


def _check_arguments(every: Any, name: Any, state: Mapping[str, Any]) -> None:
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(
            f"Snapshots(every=...) must be a positive int (snapshot every N steps), got {every!r}"
        )
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in {".", ".."}:
        raise ValueError(f"Snapshots(name=...) must be a plain folder name such as 'train', got {name!r}")
    for key, target in state.items():
        if not (
            callable(getattr(target, "state_dict", None))
            and callable(getattr(target, "load_state_dict", None))
        ):
            raise TypeError(
                f"Snapshots(state={{{key!r}: ...}}): a {type(target).__name__} has no state_dict() and "
                "load_state_dict(); register objects that have both (a scheduler, a stateful data loader)"
            )
