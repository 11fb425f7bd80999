"""Where a node keeps snapshots: a directory of memory that outlives the worker processes.

Owns: ``NodeStore``, the files under ``<root>/<name>/job-<job>/step-<S>/rank-<r>.snap`` (a rank's own
snapshot and the copies it keeps for its buddies, alike), their listing from headers alone (a file
whose header cannot be read is listed as damaged, by the step and rank of its path), dropping the steps
a newer complete snapshot replaced or a failed copy left, and removing the job's folder (with the empty
folders above it that fsdp2 made). ``default_root`` picks the root: ``FSDP2_SNAPSHOT_DIR`` or shared
memory (``/dev/shm/fsdp2-snapshots-<uid>``), which lives as long as the machine, not the process;
``job_identity`` picks the job's identity. Does not own what a snapshot holds (``_format``) or who
copies what to whom (``_ring``).

[Note: A snapshot belongs to one job]
Two jobs of one user with the same ``name`` share ``<root>/<name>`` by default; each keeps its files
in a folder of its own identity, so a restore never reads, and a commit never drops, another job's
snapshots. The identity must stay the same across a job's restarts and differ between jobs: ``job=``,
else ``$FSDP2_SNAPSHOT_JOB``, else torchrun's run id (``--rdzv-id``; a random one per launch under
``--standalone`` or on one node). torchrun's default run id, ``none``, names no job, and neither does a
plain ``python`` launch: both are refused.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ._format import RankSnapshot, read_file, read_header, write_file

ENV_DIR = "FSDP2_SNAPSHOT_DIR"
ENV_JOB = "FSDP2_SNAPSHOT_JOB"
_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def default_root() -> Path:
    """``$FSDP2_SNAPSHOT_DIR``, else a folder of ``/dev/shm`` (of the temporary directory without one)."""
    chosen = os.environ.get(ENV_DIR)
    if chosen:
        return Path(chosen)
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"fsdp2-snapshots-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


def job_identity(job: object) -> str:
    """The job's identity: ``job``, ``$FSDP2_SNAPSHOT_JOB`` or torchrun's run id (see the Note).

    Raises:
        ValueError: none of them names the job (an empty ``job``, torchrun's default run id ``none``,
            or a launch without torchrun).
    """
    if job is not None:
        if not isinstance(job, str) or not job.strip():
            raise ValueError(f"Snapshots(job=...) must be a non-empty string naming the job, got {job!r}")
        return job
    chosen = os.environ.get(ENV_JOB) or os.environ.get("TORCHELASTIC_RUN_ID", "")
    if chosen and chosen != "none":
        return chosen
    where, fix = (
        ("torchrun was launched without --rdzv-id (its run id is 'none')", "pass torchrun --rdzv-id <job id>")
        if chosen == "none"
        else ("this job was not launched by torchrun", "launch it with torchrun (its run id names the job)")
    )
    raise ValueError(
        f"fsdp2.Snapshots needs an identity for the job that stays the same across its restarts and "
        f"differs between jobs, and {where}: {fix}, or pass Snapshots(job=...) or set {ENV_JOB}=<job id> "
        "(your scheduler's job id, e.g. $SLURM_JOB_ID)"
    )


def job_folder(job: str) -> str:
    """The folder name of job ``job``: the identity itself when it is a plain name, else a safe form."""
    if _SAFE.fullmatch(job):
        return f"job-{job}"
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", job)[:48]
    return f"job-{safe}-{zlib.crc32(job.encode()):08x}"


@dataclass(frozen=True)
class Listed:
    """A snapshot file found on this node, described by its header."""

    step: int
    rank: int
    world: int
    fingerprint: int
    nbytes: int


@dataclass(frozen=True)
class Damaged:
    """A snapshot file that exists but cannot be used: its step and rank (from its path) and why."""

    step: int
    rank: int
    why: str


class NodeStore:
    """The snapshot files of one node for one job (``name`` and the job's identity).

    ``owns_root``: the root is fsdp2's default folder, removed too when ``clear`` leaves it empty.
    """

    def __init__(self, root: Path, name: str, job: str, *, owns_root: bool = False) -> None:
        self.root, self.owns_root = Path(root), owns_root
        self.directory = self.root / name / job_folder(job)

    def file(self, step: int, rank: int) -> Path:
        return self.directory / f"step-{step}" / f"rank-{rank}.snap"

    def write(self, step: int, rank: int, parts: list[bytes | memoryview]) -> None:
        """Write rank ``rank``'s snapshot of ``step`` (its own or a buddy's copy); nothing on failure."""
        path = self.file(step, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, parts)

    def read(self, step: int, rank: int) -> RankSnapshot:
        """The snapshot, its bytes checked. Raises ``ValueError`` (damaged) or ``OSError`` (gone)."""
        return read_file(self.file(step, rank))

    def listing(self) -> tuple[list[Listed], list[Damaged]]:
        """The snapshot files here (by their headers), and the files whose header cannot be read."""
        found: list[Listed] = []
        damaged: list[Damaged] = []
        for step, folder in self._steps():
            for path in sorted(folder.glob("rank-*.snap")):
                rank = path.name[len("rank-") : -len(".snap")]
                if not rank.isdigit():
                    continue
                try:
                    header = read_header(path)
                except (OSError, ValueError, EOFError) as error:
                    damaged.append(self.damaged(step, int(rank), error))
                    continue
                fields = ("step", "rank", "world", "fingerprint", "nbytes")
                found.append(Listed(*(header[field] for field in fields)))
        return found, damaged

    def damaged(self, step: int, rank: int, error: BaseException) -> Damaged:
        """``Damaged`` for the file of ``step`` and ``rank``, which ``error`` stopped: its path and why."""
        path, why = str(self.file(step, rank)), str(error)
        return Damaged(step, rank, why if path in why else f"{path}: {why}")

    def drop_before(self, step: int) -> None:
        """Remove every step older than ``step`` (a complete snapshot of ``step`` replaced them)."""
        self._drop(lambda number: number < step)

    def drop_other_than(self, step: int) -> None:
        """Remove every step but ``step`` (after a restore of it: the rest is older or unfinished)."""
        self._drop(lambda number: number != step)

    def drop(self, step: int) -> None:
        """Remove ``step`` (a copy that was not committed: only the committed snapshot stays)."""
        self._drop(lambda number: number == step)

    def _steps(self) -> list[tuple[int, Path]]:
        folders = sorted(self.directory.glob("step-*")) if self.directory.is_dir() else []
        return [(int(f.name[5:]), f) for f in folders if f.name[5:].isdigit() and f.is_dir()]

    def _drop(self, which: Callable[[int], bool]) -> None:
        for number, folder in self._steps():
            if which(number):
                shutil.rmtree(folder, ignore_errors=True)

    def clear(self) -> None:
        """Remove every snapshot of this job on this node, and the folders above it left empty.

        The ``<name>`` folder goes when empty; the root only when it is fsdp2's default one.
        """
        shutil.rmtree(self.directory, ignore_errors=True)
        for folder in [self.directory.parent, self.root] if self.owns_root else [self.directory.parent]:
            try:
                folder.rmdir()  # only when empty: another job's folder keeps it
            except OSError:
                break

    def others(self) -> list[Path]:
        """The folders of other jobs under this job's ``<name>`` folder on this node."""
        parent = self.directory.parent
        folders = sorted(parent.glob("job-*")) if parent.is_dir() else []
        return [folder for folder in folders if folder != self.directory and folder.is_dir()]

    def size_of(self, step: int, ranks: list[int]) -> int:
        """Bytes of the files of ``step`` for ``ranks`` on this node (0 for a file that is not there)."""
        total = 0
        for rank in ranks:
            path = self.file(step, rank)
            total += path.stat().st_size if path.is_file() else 0
        return total
