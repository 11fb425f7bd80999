"""Where every chunk of a sharded checkpoint goes, computed from the sharded layout alone.

Owns: the flattening of a nested state dict into DCP's dotted keys, the arithmetic of a DTensor's
chunks (``Shard``: torch.chunk rows along a mesh dim, nested left to right; ``Replicate``: only
coordinate 0 writes; a layout with ``_StridedShard``, as FSDP over tensor or expert parallelism gives,
by DTensor's own offset rule, the one ``dcp.save`` uses), the per-rank file layout (one
``__<rank>_0.distcp`` per rank, its chunks in key order, each in a slot whose size follows from the
chunk's shape and dtype) and the DCP ``Metadata`` that rank 0 builds from that layout without
hearing from any other rank.
Does not own: the writing (``_flat_save.py``), the loading (``_flat_load.py`` by the same arithmetic;
torch's ``dcp.load`` and its ``FileSystemReader`` read the same files), the sidecar
(``_flat_sidecar.py``).
Invariants: a rank's own plan touches only its own chunks (O(1) in the world size); every rank's
offsets follow from shapes, dtypes and placements only, so rank 0's metadata matches what each rank
writes with no gather.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import product
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

DCP_VERSION = "1.0.0"  # the format version torch 2.13's FileSystemWriter stamps into .metadata
_ALIGN = 64
_SLOT_OVERHEAD = 4096  # torch.save's zip framing of one tensor: measured under 1.6 KB, ndim <= 3
_LARGE = (1 << 32) - _SLOT_OVERHEAD  # records this size or larger carry zip64 extra fields


def file_name(rank: int) -> str:
    """The data file ``rank`` writes (the name DCP's own writer gives a rank's first file)."""
    return f"__{rank}_0.distcp"


def slot_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The bytes reserved in a file for one ``torch.save``-d chunk of ``shape`` and ``dtype``.

    An upper bound on ``torch.save``'s output (the raw bytes, 64-byte aligned, plus the zip framing);
    the reader slices the slot and ``torch.load`` ignores the zero bytes after the archive. The writer
    checks each chunk fits its slot and fails the save on every rank otherwise.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    aligned = -(-nbytes // _ALIGN) * _ALIGN
    return aligned + _SLOT_OVERHEAD + 64 * len(shape) + (1024 if nbytes >= _LARGE else 0)


def flatten(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]]:
    """DCP's flattening: nested mappings and lists holding tensors become dotted keys; the rest are leaves."""
    flat: dict[str, Any] = {}
    paths: dict[str, tuple[Any, ...]] = {}

    def terminal(value: Any) -> bool:
        if isinstance(value, Mapping):
            return False
        if not isinstance(value, list):
            return True
        return not any(
            isinstance(entry, torch.Tensor) or (isinstance(entry, (Mapping, list)) and not terminal(entry))
            for entry in value
        )

    def visit(path: tuple[Any, ...], value: Any) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                visit((*path, str(key)), item)
        elif terminal(value):
            key = ".".join(map(str, path))
            if key in flat:
                raise ValueError(
                    f"save_sharded: two state-dict entries flatten to the key {key!r} (nested keys are "
                    "joined with '.'); rename one of them."
                )
            flat[key] = value
            paths[key] = path
        else:
            for index, item in enumerate(value):
                visit((*path, index), item)

    for key, value in state.items():
        visit((str(key),), value)
    return flat, paths


@dataclass(frozen=True)
class TensorLayout:
    """One tensor leaf's global layout: what every rank can compute without communication."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    mesh_shape: tuple[int, ...]  # () for a plain tensor (rank 0 writes it)
    placements: tuple[Any, ...]

    def chunk(self, coordinate: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """``(offsets, sizes)`` of the chunk the rank at mesh ``coordinate`` writes, or ``None`` (none)."""
        offsets = [0] * len(self.shape)
        sizes = list(self.shape)
        if math.prod(self.shape) == 0:  # an empty tensor: one empty chunk, from the first rank
            return (tuple(offsets), self.shape) if not any(coordinate) else None
        if any(type(placement) is _StridedShard for placement in self.placements):
            return self._strided_chunk(coordinate)
        for mesh_dim, placement in enumerate(self.placements):
            index = coordinate[mesh_dim]
            if isinstance(placement, Shard):
                dim, parts = placement.dim, self.mesh_shape[mesh_dim]
                step = -(-sizes[dim] // parts)
                start = min(index * step, sizes[dim])
                offsets[dim] += start
                sizes[dim] = min(start + step, sizes[dim]) - start
            elif index != 0:  # Replicate: the first replica writes
                return None
        if 0 in sizes:  # torch.chunk left this rank no rows
            return None
        return tuple(offsets), tuple(sizes)

    def _strided_chunk(self, coordinate: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """DTensor's offset rule (``dcp.save``'s) where a ``_StridedShard`` orders the splits otherwise."""
        replicated = (type(p) is Replicate and i for p, i in zip(self.placements, coordinate, strict=True))
        if any(replicated):  # the first replica writes
            return None
        sizes, offsets = _compute_local_shape_and_global_offset(
            self.shape, self.mesh_shape, list(coordinate), self.placements
        )
        return None if 0 in sizes else (tuple(offsets), tuple(sizes))


def tensor_layout(key: str, tensor: torch.Tensor) -> TensorLayout:
    """The layout of one tensor leaf; raises ``ValueError`` for a placement the arithmetic cannot place."""
    if tensor.is_meta:
        raise ValueError(
            f"save_sharded: {key!r} is on the meta device (no values to save); materialize it first."
        )
    if not isinstance(tensor, DTensor):
        return TensorLayout(key, tuple(tensor.shape), tensor.dtype, (), ())
    for placement in tensor.placements:
        if type(placement) not in (Shard, Replicate, _StridedShard):  # Partial: no values of its own yet
            raise ValueError(
                f"save_sharded: {key!r} has placement {placement!r}; only Shard(dim), _StridedShard and "
                "Replicate() place their chunks by arithmetic. Use torch.distributed.checkpoint.save for "
                "this state dict."
            )
    # DeviceMesh.shape, not mesh.mesh.shape: torch 2.13 builds that tensor at every access
    mesh_shape = tuple(tensor.device_mesh.shape)
    return TensorLayout(key, tuple(tensor.shape), tensor.dtype, mesh_shape, tuple(tensor.placements))


@dataclass(frozen=True)
class LocalItem:
    """One chunk this rank writes: where it sits in the global tensor and in this rank's file."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file_offset: int
    slot: int


def local_items(
    layouts: list[TensorLayout], coordinates: list[tuple[int, ...] | None], rank: int
) -> list[LocalItem]:
    """This rank's chunks in key order with their file offsets: one ``chunk`` call per tensor leaf.

    ``coordinates[i]``: this rank's coordinate on leaf ``i``'s mesh (``None``: not on that mesh).
    """
    items: list[LocalItem] = []
    position = 0
    for layout, coordinate in zip(layouts, coordinates, strict=True):
        found = _own_chunk(layout, coordinate, rank)
        if found is None:
            continue
        offsets, sizes = found
        slot = slot_bytes(sizes, layout.dtype)
        items.append(LocalItem(layout.key, offsets, sizes, position, slot))
        position += slot
    return items


def _own_chunk(
    layout: TensorLayout, coordinate: tuple[int, ...] | None, rank: int
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    if not layout.mesh_shape:
        return ((0,) * len(layout.shape), layout.shape) if rank == 0 else None
    return None if coordinate is None else layout.chunk(coordinate)


def _all_chunks(layout: TensorLayout, mesh_ranks: list[int] | None) -> list[tuple[int, Any, Any]]:
    """Every ``(rank, offsets, sizes)`` of one leaf, in mesh order (rank 0's only for a plain tensor)."""
    if mesh_ranks is None:
        return [(0, (0,) * len(layout.shape), layout.shape)]
    found = []
    for position, coordinate in enumerate(product(*(range(size) for size in layout.mesh_shape))):
        chunk = layout.chunk(coordinate)
        if chunk is not None:
            found.append((mesh_ranks[position], *chunk))
    return found


def tensor_metadata(
    layouts: list[TensorLayout], mesh_ranks: list[list[int] | None]
) -> tuple[dict[str, Any], dict[MetadataIndex, _StorageInfo], dict[int, int]]:
    """Rank 0's view of every rank's tensor chunks: DCP entries, storage places, each file's tensor bytes.

    Walks the leaves in key order and, within each, the mesh in order, so each file's offsets come out
    in the order its rank writes them (``local_items``). ``mesh_ranks[i]``: leaf ``i``'s mesh as the
    list of its global ranks in mesh order, one list object per mesh (``None``: a plain tensor). Leaves
    of one shape, placements and mesh share their chunks: computed once (a model's layers repeat).
    """
    entries: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    ends: dict[int, int] = {}
    shared: dict[tuple[Any, ...], tuple[list[tuple[int, Any, int]], list[ChunkStorageMetadata]]] = {}
    for layout, ranks in zip(layouts, mesh_ranks, strict=True):
        alike = (layout.shape, layout.dtype, layout.mesh_shape, layout.placements, id(ranks))
        if alike not in shared:
            found = _all_chunks(layout, ranks)
            places = [(rank, offsets, slot_bytes(sizes, layout.dtype)) for rank, offsets, sizes in found]
            chunks = [
                ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for _, offsets, sizes in found
            ]
            shared[alike] = places, chunks
        places, chunks = shared[alike]
        for rank, offsets, slot in places:
            position = ends.get(rank, 0)
            storage[MetadataIndex(layout.key, offsets)] = _StorageInfo(file_name(rank), position, slot)
            ends[rank] = position + slot
        entries[layout.key] = TensorStorageMetadata(
            TensorProperties(dtype=layout.dtype), torch.Size(layout.shape), list(chunks)
        )
    return entries, storage, ends


def object_bytes(value: Any) -> bytes:
    """A non-tensor leaf as DCP stores it (``torch.save`` of the object)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def full_metadata(
    tensors: tuple[dict[str, Any], dict[MetadataIndex, _StorageInfo], dict[int, int]],
    objects: dict[str, int],
    paths: dict[str, tuple[Any, ...]],
    order: list[str],
) -> Metadata:
    """The ``.metadata`` for one save: the cached tensor part plus rank 0's objects after its tensors.

    ``objects``: each non-tensor key's byte length, in the order rank 0 appends them to its file.
    """
    entries, storage, ends = tensors
    entries = dict(entries)
    storage = dict(storage)
    position = ends.get(0, 0)
    for key, length in objects.items():
        entries[key] = BytesStorageMetadata()
        storage[MetadataIndex(key)] = _StorageInfo(file_name(0), position, length)
        position += length
    ordered = {key: entries[key] for key in order}
    return Metadata(
        state_dict_metadata=ordered, planner_data=dict(paths), storage_data=storage, version=DCP_VERSION
    )
