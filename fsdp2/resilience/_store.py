"""Where a node keeps snapshots: a directory of memory that outlives the worker processes.

Owns: ``NodeStore``, the files under ``<root>/<name>/step-<S>/rank-<r>.snap`` (a rank's own snapshot
and the copies it keeps for its buddies, alike), their listing from headers alone, and dropping the
steps a newer complete snapshot replaced. ``default_root`` picks the directory: ``FSDP2_SNAPSHOT_DIR``
or shared memory (``/dev/shm``), which lives as long as the machine, not the process. Does not own
what a snapshot holds (``_format``) or who copies what to whom (``_ring``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ._format import RankSnapshot, read_file, read_header, write_file

ENV_DIR = "FSDP2_SNAPSHOT_DIR"


def default_root() -> Path:
    """``$FSDP2_SNAPSHOT_DIR``, else a folder of ``/dev/shm`` (of the temporary directory without one)."""
    chosen = os.environ.get(ENV_DIR)
    if chosen:
        return Path(chosen)
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"fsdp2-snapshots-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


@dataclass(frozen=True)
class Listed:
    """A snapshot file found on this node, described by its header."""

    step: int
    rank: int
    world: int
    fingerprint: int
    nbytes: int


class NodeStore:
    """The snapshot files of one node for one job (``name``)."""

    def __init__(self, root: Path, name: str) -> None:
        self.directory = Path(root) / name

    def file(self, step: int, rank: int) -> Path:
        return self.directory / f"step-{step}" / f"rank-{rank}.snap"

    def write(self, step: int, rank: int, parts: list[bytes | memoryview]) -> None:
        """Write rank ``rank``'s snapshot of ``step`` (its own or a buddy's copy)."""
        path = self.file(step, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, parts)

    def read(self, step: int, rank: int) -> RankSnapshot:
        """The snapshot, its bytes checked. Raises ``ValueError`` (damaged) or ``OSError`` (gone)."""
        return read_file(self.file(step, rank))

    def listing(self) -> tuple[list[Listed], list[str]]:
        """The snapshot files here (by their headers), and a line for each file that could not be read."""
        found: list[Listed] = []
        problems: list[str] = []
        for folder in sorted(self.directory.glob("step-*")) if self.directory.is_dir() else []:
            for path in sorted(folder.glob("rank-*.snap")):
                try:
                    header = read_header(path)
                except (OSError, ValueError, EOFError) as error:
                    problems.append(f"{path}: {error}")
                    continue
                found.append(
                    Listed(
                        header["step"],
                        header["rank"],
                        header["world"],
                        header["fingerprint"],
                        header["nbytes"],
                    )
                )
        return found, problems

    def drop_before(self, step: int) -> None:
        """Remove every step older than ``step`` (a complete snapshot of ``step`` replaced them)."""
        self._drop(lambda number: number < step)

    def drop_other_than(self, step: int) -> None:
        """Remove every step but ``step`` (after a restore of it: the rest is older or unfinished)."""
        self._drop(lambda number: number != step)

    def _drop(self, which: Callable[[int], bool]) -> None:
        for folder in self.directory.glob("step-*") if self.directory.is_dir() else []:
            number = folder.name[len("step-") :]
            if number.isdigit() and which(int(number)):
                shutil.rmtree(folder, ignore_errors=True)

    def clear(self) -> None:
        """Remove every snapshot of this job on this node (a finished job frees the memory)."""
        shutil.rmtree(self.directory, ignore_errors=True)

    def size_of(self, step: int, ranks: list[int]) -> int:
        """Bytes of the files of ``step`` for ``ranks`` on this node (0 for a file that is not there)."""
        total = 0
        for rank in ranks:
            path = self.file(step, rank)
            total += path.stat().st_size if path.is_file() else 0
        return total
