"""Sharded checkpoints whose coordination does not grow with the world size: ``ShardedCheckpointer``.

Owns: ``ShardedCheckpointer`` (``save`` and ``save_async``: every rank writes its own chunks into one
DCP-format file, rank 0 writes the ``.metadata`` it computed alone; three all-reduces of at most three
integers per save: the ranks agree on the layout, then on whether the checkpoint is complete),
``PendingSave`` (an async save's handle: staging, then the commit), ``save_sharded`` and
``load_sharded``. The files load with torch's ``dcp.load`` at any world size, or with ``load`` /
``load_sharded`` without a plan gather (rank 0 writes the ``.fsdp2_layout`` sidecar before
``.metadata``).
Does not own: the chunk arithmetic and the metadata (``_flat_layout.py``); the staged writer thread
(``_staged_writer.py``); the sidecar (``_flat_sidecar.py``); the loader (``_flat_load.py``).
Invariants: a rank plans only its own chunks; rank 0 builds the tensor metadata once per layout and
reuses it; the ``.metadata`` appears only after every rank's file is complete, or not at all, and
then every rank raises.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..comm import raise_everywhere
from ._flat_layout import (
    LocalItem,
    TensorLayout,
    file_name,
    flatten,
    full_metadata,
    local_items,
    object_bytes,
    tensor_layout,
    tensor_metadata,
)
from ._flat_load import load_flat
from ._flat_sidecar import SIDECAR, MeshRanks, sidecar_bytes, write_file
from ._safetensors import comm_device
from ._staged_writer import BackgroundStaging, StagedWriter, StagingPool

_DEFAULT_STAGING = 1 << 30


class PendingSave:
    """An async save in flight: ``wait()`` finishes it (every rank must call it).

    With ``stage_in_background``, ``wait_staged()`` returns once every chunk is copied to host memory
    (optimizer steps call it themselves); until then the saved tensors must not change.
    """

    def __init__(self, writer: StagedWriter, commit: Any, staging: BackgroundStaging | None = None) -> None:
        self._writer = writer
        self._commit = commit
        self._staging = staging
        self._done = False

    @property
    def peak_staged_bytes(self) -> int:
        """The most host bytes this rank held staged at once (bounded by the staging budget)."""
        return self._writer.peak_bytes

    def done(self) -> bool:
        """Whether ``wait()`` has finished this save."""
        return self._done

    def staged(self) -> bool:
        """Whether every chunk is copied, so the saved tensors may change."""
        return self._staging is None or self._staging.done()

    def wait_staged(self) -> None:
        """Block until every chunk is copied (torchtitan's ``maybe_wait_for_staging``); not a collective.

        Call it before changing a saved tensor in place other than by an optimizer step (an optimizer's
        ``step`` waits by itself).
        """
        if self._staging is not None:
            self._staging.wait()

    def wait(self) -> None:
        """Wait for this rank's file, then commit: rank 0 writes ``.metadata`` once every file is whole.

        A collective (two all-reduces of one integer). Raises ``OSError`` on every rank when any rank
        failed to write; the checkpoint then has no ``.metadata`` and DCP will not load it.
        """
        if self._done:
            return
        self._done = True
        if self._staging is not None:
            self._staging.wait()
        self._commit(self._writer.finish())


class ShardedCheckpointer:
    """Saves sharded state dicts as DCP checkpoints with no gather of plans, in place or in the background.

    Args:
        staging_bytes: the host memory an async save may hold in staged copies at once (a chunk larger
            than this is staged alone). The training thread blocks only while this budget is full.

    Keep one instance for a run: the layout's metadata is computed at the first save and reused while
    the state dict's keys, shapes, dtypes and placements stay the same.
    """

    def __init__(self, *, staging_bytes: int = _DEFAULT_STAGING) -> None:
        if type(staging_bytes) is not int or staging_bytes <= 0:
            raise ValueError(
                f"ShardedCheckpointer: staging_bytes must be a positive int, got {staging_bytes!r}."
            )
        self.staging_bytes = staging_bytes
        self._pool = StagingPool(staging_bytes)
        self._key: tuple[Any, ...] | None = None
        self._signature = 0
        self._local: list[LocalItem] = []
        self._tensors: Any = None
        self._sidecar: tuple[list[TensorLayout], list[MeshRanks | None]] = ([], [])
        self._pending: PendingSave | None = None
        self.plans_built = 0  # how often the layout was planned (once while it stays the same)

    def save(self, state: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
        """Write ``state`` to the checkpoint folder ``path`` and return once it is complete on every rank."""
        self._start(state, path, background=False).wait()

    def save_async(
        self, state: Mapping[str, Any], path: str | os.PathLike[str], *, stage_in_background: bool = False
    ) -> PendingSave:
        """Stage ``state`` within the budget and write it in the background; ``wait()`` the result.

        Returns once every chunk has been copied to host memory (so the caller may change the
        tensors); a save still in flight from an earlier call is waited for first.

        With ``stage_in_background``, only the plain tensors (buffers, step counts) are copied before
        it returns; the DTensor shards are copied by a thread, and the next optimizer ``step`` (any
        optimizer) waits for that copy to finish before it runs, as torchtitan waits before its step.
        The training path then blocks only where the forward and backward did not cover the copy.
        Anything else that changes a saved DTensor in place must call ``wait_staged()`` first.
        """
        return self._start(state, path, background=True, stage_in_background=stage_in_background)

    def load(self, state: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
        """Fill ``state``'s tensors in place from the checkpoint at ``path``, as ``dcp.load`` does.

        Every rank reads the ``.fsdp2_layout`` this class writes beside ``.metadata`` and, by the
        same arithmetic as the save, only the saved chunks that meet its own shards: no message, and
        per-rank work that does not grow with the world size. The world size, mesh and placements may
        differ from the save's. Non-tensor entries (``param_groups``, ...) are replaced. Then call
        ``set_model_state_dict`` / ``set_optimizer_state_dict``. Raises ``ValueError`` naming the key
        for an entry missing from the checkpoint or of another shape or dtype, before reading anything;
        and for a checkpoint without the sidecar (``dcp.save``'s: use ``dcp.load``).
        """
        if self._pending is not None:
            self._pending.wait()
        load_flat(state, path)

    def _start(
        self,
        state: Mapping[str, Any],
        path: str | os.PathLike[str],
        *,
        background: bool,
        stage_in_background: bool = False,
    ) -> PendingSave:
        if not isinstance(state, Mapping):
            raise TypeError(f"save_sharded: state must be a dict of state dicts, got {type(state).__name__}.")
        flat, paths = flatten(state)
        tensors = {key: value for key, value in flat.items() if isinstance(value, torch.Tensor)}
        layouts = [tensor_layout(key, value) for key, value in tensors.items()]
        rank = dist.get_rank() if dist.is_initialized() else 0
        self._plan(layouts, list(tensors.values()), rank)
        device = comm_device(tensors.values())
        self._agree(self._shape_problem(tensors), device)
        if self._pending is not None:
            self._pending.wait()
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        objects = (
            {key: object_bytes(value) for key, value in flat.items() if key not in tensors}
            if rank == 0
            else {}
        )
        writer = StagedWriter(folder / file_name(rank), self._pool if background else None)
        end = self._local[-1].file_offset + self._local[-1].slot if self._local else 0
        later = []  # DTensor shards staged by a thread; plain tensors (buffers change in the forward): now
        for item in self._local:
            tensor = tensors[item.key]
            if stage_in_background and isinstance(tensor, DTensor):
                later.append((item, tensor))
            else:
                writer.put(item, tensor, stage=background)
        staging = None
        if stage_in_background:
            staging = BackgroundStaging(writer, later, end, list(objects.values()))
        else:
            writer.close(end, list(objects.values()))
        lengths = {key: len(data) for key, data in objects.items()}
        planned = self._tensors  # this save's layout, even if a later save plans another
        sidecar = self._sidecar

        def commit(problem: str) -> None:
            raise_everywhere(problem, None, OSError, device=device)
            written = ""
            if rank == 0:
                metadata = full_metadata(planned, lengths, paths, list(flat))
                layout = sidecar_bytes(*sidecar, _object_places(planned, lengths))
                written = self._write_metadata(folder, metadata, layout)
            raise_everywhere(written, None, OSError, device=device)

        self._pending = PendingSave(writer, commit, staging)
        return self._pending

    def _plan(self, layouts: list[TensorLayout], values: list[torch.Tensor], rank: int) -> None:
        meshes = [value.device_mesh if isinstance(value, DTensor) else None for value in values]
        key = (rank, tuple(layouts), tuple(id(mesh) for mesh in meshes))
        if key == self._key:
            return
        coordinates = [None if mesh is None else _coordinate(mesh) for mesh in meshes]
        self._local = local_items(layouts, coordinates, rank)
        if rank == 0:
            ranks = {id(mesh): mesh.mesh.flatten().tolist() for mesh in meshes if mesh is not None}
            self._tensors = tensor_metadata(
                layouts, [None if mesh is None else ranks[id(mesh)] for mesh in meshes]
            )
            kept = {key: MeshRanks.of(tuple(mesh.mesh.shape), ranks[key]) for key, mesh in _by_id(meshes)}
            self._sidecar = (layouts, [None if mesh is None else kept[id(mesh)] for mesh in meshes])
        self._key = key
        self._signature = int.from_bytes(
            hashlib.blake2b(repr(layouts).encode(), digest_size=7).digest(), "big"
        )
        self.plans_built += 1

    def _agree(self, problem: str, device: torch.device) -> None:
        """One all-reduce: no rank has a ``problem``, every rank holds one layout (rank 0 plans for all)."""
        if not dist.is_initialized():
            return
        found = torch.tensor([1 if problem else 0, self._signature, -self._signature], device=device)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        if int(found[0]):
            raise_everywhere(problem, None, ValueError)  # every rank's message; nothing is written
        if int(found[1]) != -int(found[2]):
            self._key = None  # plan again at the next call
            raise ValueError(
                "save_sharded: the ranks' state dicts differ in keys, shapes, dtypes or placements (rank 0 "
                "computes every rank's chunks from its own). Every rank must pass the same entries; a "
                "pipeline stage's own parameters need torch.distributed.checkpoint.save. Nothing was written."
            )

    def _shape_problem(self, tensors: dict[str, torch.Tensor]) -> str:
        for item in self._local:
            value = tensors[item.key]
            local = value.to_local() if isinstance(value, DTensor) else value
            if tuple(local.shape) != item.sizes:
                return (
                    f"{item.key!r}: the local shard has shape {tuple(local.shape)}, but its placements "
                    f"{getattr(value, 'placements', ())} give this rank {item.sizes} (torch.chunk rows); "
                    "save it with torch.distributed.checkpoint.save."
                )
        return ""

    @staticmethod
    def _write_metadata(folder: Path, metadata: Any, layout: bytes) -> str:
        """The sidecar, then ``.metadata`` (the commit: a checkpoint without it does not load)."""
        try:
            write_file(folder / SIDECAR, layout)
            write_file(folder / ".metadata", pickle.dumps(metadata))
        except OSError as error:
            return f"rank 0 could not write {folder / '.metadata'} or {folder / SIDECAR}: {error}"
        return ""


def _by_id(meshes: list[Any]) -> list[tuple[int, Any]]:
    """Each distinct mesh of ``meshes`` once, with its ``id``."""
    return list({id(mesh): mesh for mesh in meshes if mesh is not None}.items())


def _object_places(tensors: Any, lengths: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Where rank 0 appends each non-tensor entry: after its tensors' slots, in order."""
    position = tensors[2].get(0, 0)
    places = {}
    for key, length in lengths.items():
        places[key] = (position, length)
        position += length
    return places


def _coordinate(mesh: Any) -> tuple[int, ...] | None:
    found = mesh.get_coordinate()
    return None if found is None else tuple(found)


def load_sharded(state: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Fill ``state`` from a ``save_sharded`` / ``ShardedCheckpointer`` checkpoint at any world size.

    The mirror of ``dcp.load(state, checkpoint_id=path)`` with no plan gather:
    ``ShardedCheckpointer().load(state, path)``. Every rank calls it; no collective runs.
    """
    load_flat(state, path)


def save_sharded(state: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Save ``state`` (e.g. ``{"model": ..., "optim": ...}``) as a DCP checkpoint without gathering plans.

    Every rank must call it. A one-off ``ShardedCheckpointer().save(state, path)``; keep a
    ``ShardedCheckpointer`` to reuse the plan across saves or to save in the background.
    """
    ShardedCheckpointer().save(state, path)
