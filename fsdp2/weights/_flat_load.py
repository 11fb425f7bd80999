"""Loading a ``ShardedCheckpointer`` checkpoint with per-rank work that does not grow with the world size.

Owns: ``load_flat`` (``ShardedCheckpointer.load`` / ``load_sharded``): every rank reads the sidecar
(``.fsdp2_layout``, no message), computes for each tensor of its state the chunk it holds (a DTensor's
local shard by the ``torch.chunk`` arithmetic of its own mesh and placements, the whole tensor for a
plain one), finds by the same arithmetic the saved chunks that meet it (per mesh dim only the indices
whose rows overlap; a saved ``_StridedShard`` layout is enumerated, O(its mesh)), the saving rank of
each and that rank's file offsets (``local_items`` for that rank, cached per rank), then reads those
slots and copies the overlaps into the local tensors in place. Non-tensor entries are read from rank
0's file and replace the state's, as ``dcp.load`` does.
Does not own: the arithmetic (``_flat_layout.py``), the sidecar's format (``_flat_sidecar.py``).
Invariants: every check (a missing key, a shape or dtype that differs, a local shard not where the
arithmetic puts it) runs before the first byte is read into the state; no collective is called (every
rank finds the same problems from the same files).
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ._flat_layout import LocalItem, TensorLayout, file_name, flatten, local_items, tensor_layout
from ._flat_sidecar import SavedLayout, read_sidecar

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in the global tensor


@dataclass(frozen=True)
class Piece:
    """One saved chunk's overlap with a local tensor: read ``item`` of ``rank``'s file, copy ``source``."""

    rank: int
    item: LocalItem
    source: Box  # the overlap, in the saved chunk's coordinates
    target: Box  # the overlap, in the local tensor's coordinates


@dataclass
class LoadPlan:
    """What one rank reads: per local tensor its pieces; per object its path and place in rank 0's file."""

    tensors: list[tuple[torch.Tensor, list[Piece]]]
    objects: list[tuple[tuple[Any, ...], int, int]]

    @property
    def chunks_read(self) -> int:
        return sum(len(pieces) for _, pieces in self.tensors)


class _SavedFiles:
    """Each saving rank's chunks (its ``local_items``), computed the first time a piece needs that rank."""

    def __init__(self, saved: SavedLayout) -> None:
        self._saved = saved
        self._items: dict[int, dict[str, LocalItem]] = {}

    def item(self, rank: int, key: str) -> LocalItem:
        found = self._items.get(rank)
        if found is None:
            coordinates = [None if m is None else m.coordinate_of(rank) for m in self._saved.meshes]
            found = {item.key: item for item in local_items(self._saved.layouts, coordinates, rank)}
            self._items[rank] = found
        return found[key]


def plan_load(saved: SavedLayout, state: Mapping[str, Any]) -> LoadPlan:
    """Check every entry of ``state`` against the checkpoint, then list the pieces this rank reads."""
    flat, paths = flatten(state)
    targets = []
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            targets.append((key, value, _check_tensor(saved, key, value)))
        elif key not in saved.objects:
            raise ValueError(_missing(key, "a non-tensor entry", saved))
    files = _SavedFiles(saved)
    tensors = []
    for key, value, (layout, mesh) in targets:
        local, box = _target(key, value)
        if box is not None and local.numel():
            tensors.append((local, list(_pieces(layout, mesh, box, files))))
    objects = [(paths[key], *saved.objects[key]) for key in flat if not isinstance(flat[key], torch.Tensor)]
    return LoadPlan(tensors, objects)


def _missing(key: str, what: str, saved: SavedLayout) -> str:
    kind = "a tensor" if key in saved.by_key else "no entry"
    return (
        f"load_sharded: the state's {what} {key!r} is {kind} in the checkpoint; pass a state with the "
        "keys that were saved (drop or rename that entry), or load with torch.distributed.checkpoint.load "
        "and planner=DefaultLoadPlanner(allow_partial_load=True)."
    )


def _check_tensor(saved: SavedLayout, key: str, value: torch.Tensor) -> tuple[TensorLayout, Any]:
    index = saved.by_key.get(key)
    if index is None:
        if key in saved.objects:
            raise ValueError(
                f"load_sharded: {key!r} is a tensor in the state but a non-tensor in the checkpoint."
            )
        raise ValueError(_missing(key, "tensor", saved))
    layout = saved.layouts[index]
    if tuple(value.shape) != layout.shape or value.dtype != layout.dtype:
        raise ValueError(
            f"load_sharded: {key!r} is {tuple(value.shape)} {value.dtype} in the state but {layout.shape} "
            f"{layout.dtype} in the checkpoint; build the model (and optimizer state) as it was saved."
        )
    return layout, saved.meshes[index]


def _target(key: str, value: torch.Tensor) -> tuple[torch.Tensor, Box | None]:
    """The local tensor to fill and the global box it holds (``None``: no rows on this rank)."""
    if not isinstance(value, DTensor):
        return value.detach(), ((0,) * value.dim(), tuple(value.shape))
    local = value.to_local().detach()
    coordinate = value.device_mesh.get_coordinate()
    if coordinate is None or not value.numel():
        return local, None
    layout = _new_layout(key, value)
    first_replica = tuple(
        0 if type(p) is Replicate else i for p, i in zip(value.placements, coordinate, strict=True)
    )
    box = layout.chunk(first_replica)  # a replica holds the chunk its first replica saves
    held = box[1] if box is not None else None
    if (held is None and local.numel()) or (held is not None and tuple(local.shape) != held):
        raise ValueError(
            f"load_sharded: {key!r}: the local shard has shape {tuple(local.shape)}, but its placements "
            f"{value.placements} give this rank {held} (torch.chunk rows); load it with "
            "torch.distributed.checkpoint.load."
        )
    return local, box


def _new_layout(key: str, value: DTensor) -> TensorLayout:
    try:
        return tensor_layout(key, value)
    except ValueError as error:  # the save's wording: point at the loader instead
        raise ValueError(
            str(error).replace("save_sharded", "load_sharded").replace("checkpoint.save", "checkpoint.load")
        ) from None


def _pieces(layout: TensorLayout, mesh: Any, box: Box, files: _SavedFiles) -> Iterator[Piece]:
    """The saved chunks of ``layout`` that meet ``box``, each with its saving rank and file slot."""
    found: list[tuple[tuple[int, ...], Box]]
    if mesh is None:  # a plain tensor: rank 0's whole
        found = [((), ((0,) * len(layout.shape), layout.shape))]
    else:
        found = [(c, chunk) for c in _candidates(layout, box) if (chunk := layout.chunk(c)) is not None]
    for coordinate, chunk in found:
        overlap = _overlap(chunk, box)
        if overlap is not None:
            rank = 0 if mesh is None else mesh.rank_at(coordinate)
            yield Piece(rank, files.item(rank, layout.key), *overlap)


def _candidates(layout: TensorLayout, box: Box) -> list[tuple[int, ...]]:
    """Mesh coordinates whose saved chunk may meet ``box``: per mesh dim the indices whose rows overlap."""
    if any(type(p) is _StridedShard for p in layout.placements):  # DTensor's order: enumerate the mesh
        return list(product(*(range(size) for size in layout.mesh_shape)))
    found: list[tuple[int, ...]] = []
    low, sizes = box
    high = tuple(start + size for start, size in zip(low, sizes, strict=True))

    def visit(coordinate: tuple[int, ...], offsets: list[int], extent: list[int]) -> None:
        mesh_dim = len(coordinate)
        if mesh_dim == len(layout.placements):
            found.append(coordinate)
            return
        placement = layout.placements[mesh_dim]
        if not isinstance(placement, Shard):  # Replicate: the first replica saved
            visit((*coordinate, 0), offsets, extent)
            return
        dim, parts = placement.dim, layout.mesh_shape[mesh_dim]
        step = -(-extent[dim] // parts)
        first = max(low[dim] - offsets[dim], 0) // step
        last = min((high[dim] - offsets[dim] - 1) // step, parts - 1)
        for index in range(first, last + 1):
            start = index * step
            rows = min(start + step, extent[dim]) - start
            if rows > 0:
                moved, cut = list(offsets), list(extent)
                moved[dim], cut[dim] = offsets[dim] + start, rows
                visit((*coordinate, index), moved, cut)

    visit((), [0] * len(layout.shape), list(layout.shape))
    return found


def _overlap(chunk: Box, box: Box) -> tuple[Box, Box] | None:
    """Where ``chunk`` and ``box`` meet, in each one's own coordinates (``None``: they do not)."""
    starts, ends = [], []
    for chunk_at, chunk_size, box_at, box_size in zip(*chunk, *box, strict=True):
        starts.append(max(chunk_at, box_at))
        ends.append(min(chunk_at + chunk_size, box_at + box_size))
    if any(end <= start for start, end in zip(starts, ends, strict=True)):
        return None
    sizes = tuple(end - start for start, end in zip(starts, ends, strict=True))
    source = tuple(start - at for start, at in zip(starts, chunk[0], strict=True))
    target = tuple(start - at for start, at in zip(starts, box[0], strict=True))
    return (source, sizes), (target, sizes)


def _region(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    for dim, (start, size) in enumerate(zip(*box, strict=True)):
        tensor = tensor.narrow(dim, start, size)
    return tensor


class _Slot(io.RawIOBase):
    """``length`` bytes of ``handle`` from ``offset``, seekable: ``torch.load`` reads its records in place."""

    def __init__(self, handle: io.FileIO, offset: int, length: int) -> None:
        super().__init__()
        self._handle, self._offset, self._length, self._at = handle, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, at: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._length}[whence]
        self._at = max(0, min(base + at, self._length))
        return self._at

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")[: max(0, self._length - self._at)]
        self._handle.seek(self._offset + self._at)
        count = self._handle.readinto(view) or 0
        self._at += count
        return count


class _Reader:
    """The saving ranks' files, each opened once per load."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._handles: dict[int, io.FileIO] = {}

    def slot(self, rank: int, offset: int, length: int) -> io.BufferedReader:
        """A file view of one slot (a short slot stays short: ``torch.load`` then reports the damage)."""
        handle = self._handles.get(rank)
        if handle is None:
            handle = self._handles[rank] = open(self._folder / file_name(rank), "rb", buffering=0)  # noqa: SIM115
        return io.BufferedReader(_Slot(handle, offset, length))

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()


def run_plan(plan: LoadPlan, folder: Path, state: Mapping[str, Any]) -> None:
    """Read each piece's slot once and copy its overlap; then replace the non-tensor entries."""
    reader = _Reader(folder)
    try:
        for local, pieces in plan.tensors:
            for piece in pieces:
                slot = reader.slot(piece.rank, piece.item.file_offset, piece.item.slot)
                chunk = torch.load(slot, map_location="cpu", weights_only=True)
                with torch.no_grad():
                    _region(local, piece.target).copy_(_region(chunk, piece.source))
        for path, offset, length in plan.objects:
            value = torch.load(reader.slot(0, offset, length), weights_only=False)  # as dcp.load
            _set(state, path, value)
    finally:
        reader.close()


def _set(state: Any, path: tuple[Any, ...], value: Any) -> None:
    for step in path[:-1]:
        state = state[step] if isinstance(state, list) else _key(state, step)
    state[path[-1] if isinstance(state, list) else _mapping_key(state, path[-1])] = value


def _key(state: Mapping[Any, Any], step: str) -> Any:
    return state[_mapping_key(state, step)]


def _mapping_key(state: Mapping[Any, Any], step: str) -> Any:
    """The mapping's own key whose ``str`` is ``step`` (the flattening joined ``str`` of the keys)."""
    if step in state:
        return step
    return next((key for key in state if str(key) == step), step)


def load_flat(state: Mapping[str, Any], path: str | os.PathLike[str]) -> LoadPlan:
    """Fill ``state`` from the checkpoint at ``path``; the plan it ran (for counting)."""
    if not isinstance(state, Mapping):
        raise TypeError(f"load_sharded: state must be a dict of state dicts, got {type(state).__name__}.")
    folder = Path(path)
    saved = read_sidecar(folder)
    plan = plan_load(saved, state)
    run_plan(plan, folder, state)
    return plan
