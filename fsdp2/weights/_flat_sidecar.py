"""The ``.fsdp2_layout`` file beside a sharded checkpoint: what the loader's arithmetic needs.

Owns: the sidecar's format (JSON, versioned): per tensor key its global shape, dtype, the saving
mesh and placements (the ``TensorLayout``), each saving mesh once (its shape and its ranks in mesh
order, stored as a range where they are one, as the default mesh's ``range(N)`` is), and where rank
0's non-tensor entries lie in its file; its writing (rank 0, before ``.metadata``, so ``.metadata``
stays the last file of a save) and its reading (every rank at a load, no message).
Does not own: the chunk arithmetic (``_flat_layout.py``), the loader (``_flat_load.py``).
Invariants: the file's size is O(number of tensors + meshes), not O(world size) for a mesh whose
ranks form a range; the tensors are listed in the save's key order (the order each rank's file holds
its chunks in).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ._flat_layout import TensorLayout

SIDECAR = ".fsdp2_layout"
FORMAT = "fsdp2-flat-layout"
VERSION = 1


@dataclass
class MeshRanks:
    """A saving mesh: its shape and its global ranks in mesh order (a range, or a list)."""

    shape: tuple[int, ...]
    start: int = 0
    step: int = 1
    ranks: list[int] | None = None  # only where the ranks are not a range
    _positions: dict[int, int] | None = field(default=None, repr=False)

    @classmethod
    def of(cls, shape: tuple[int, ...], ranks: list[int]) -> MeshRanks:
        """``ranks`` (the mesh flattened), kept as ``start`` and ``step`` where they are a range."""
        start = ranks[0] if ranks else 0
        step = ranks[1] - ranks[0] if len(ranks) > 1 else 1
        if step > 0 and ranks == list(range(start, start + step * len(ranks), step)):
            return cls(shape, start, step)
        return cls(shape, ranks=list(ranks))

    def rank_at(self, coordinate: tuple[int, ...]) -> int:
        """The global rank at mesh ``coordinate``."""
        position = _ravel(coordinate, self.shape)
        return self.ranks[position] if self.ranks is not None else self.start + self.step * position

    def coordinate_of(self, rank: int) -> tuple[int, ...] | None:
        """``rank``'s mesh coordinate, or ``None`` where it is not on this mesh."""
        if self.ranks is None:
            position, off = divmod(rank - self.start, self.step)
            inside = not off and 0 <= position < math.prod(self.shape)
            return _unravel(position, self.shape) if inside else None
        if self._positions is None:  # a mesh of another order: its list, inverted once
            self._positions = {value: index for index, value in enumerate(self.ranks)}
        found = self._positions.get(rank)
        return None if found is None else _unravel(found, self.shape)

    def encode(self) -> dict[str, Any]:
        if self.ranks is None:
            return {"shape": list(self.shape), "start": self.start, "step": self.step}
        return {"shape": list(self.shape), "ranks": self.ranks}


def _ravel(coordinate: tuple[int, ...], shape: tuple[int, ...]) -> int:
    position = 0
    for index, size in zip(coordinate, shape, strict=True):
        position = position * size + index
    return position


def _unravel(position: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coordinate = []
    for size in reversed(shape):
        position, index = divmod(position, size)
        coordinate.append(index)
    return tuple(reversed(coordinate))


@dataclass
class SavedLayout:
    """A sidecar read back: the tensors' layouts in save order, their meshes, rank 0's objects."""

    layouts: list[TensorLayout]
    meshes: list[MeshRanks | None]  # per layout (``None``: a plain tensor, rank 0's)
    objects: dict[str, tuple[int, int]]  # key -> (offset, length) in rank 0's file
    by_key: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_key = {layout.key: index for index, layout in enumerate(self.layouts)}


def _encode_placement(placement: Any) -> list[Any]:
    if type(placement) is _StridedShard:
        return ["strided", placement.dim, int(placement.split_factor)]
    if isinstance(placement, Shard):
        return ["shard", placement.dim]
    return ["replicate"]


def _decode_placement(entry: list[Any]) -> Any:
    if entry[0] == "strided":
        return _StridedShard(entry[1], split_factor=entry[2])
    return Shard(entry[1]) if entry[0] == "shard" else Replicate()


def _dtype(name: str) -> torch.dtype:
    found = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"load_sharded: the sidecar names an unknown dtype {name!r}.")
    return found


def sidecar_bytes(
    layouts: list[TensorLayout], meshes: list[MeshRanks | None], objects: dict[str, tuple[int, int]]
) -> bytes:
    """The sidecar of one save: ``meshes`` per layout (one object per saving mesh), ``objects``' places."""
    mesh_ids: dict[int, int] = {}
    known: dict[str, int] = {}  # meshes of equal shape and ranks (one per fully_shard call) stored once
    encoded_meshes: list[dict[str, Any]] = []
    for mesh in meshes:
        if mesh is not None and id(mesh) not in mesh_ids:
            encoded = mesh.encode()
            mesh_ids[id(mesh)] = known.setdefault(json.dumps(encoded), len(encoded_meshes))
            if mesh_ids[id(mesh)] == len(encoded_meshes):
                encoded_meshes.append(encoded)
    tensors = [
        {
            "key": layout.key,
            "shape": list(layout.shape),
            "dtype": str(layout.dtype),
            "mesh": None if mesh is None else mesh_ids[id(mesh)],
            "placements": [_encode_placement(p) for p in layout.placements],
        }
        for layout, mesh in zip(layouts, meshes, strict=True)
    ]
    body = {
        "format": FORMAT,
        "version": VERSION,
        "meshes": encoded_meshes,
        "tensors": tensors,
        "objects": [[key, offset, length] for key, (offset, length) in objects.items()],
    }
    return json.dumps(body, separators=(",", ":")).encode()


def read_sidecar(folder: Path) -> SavedLayout:
    """Read ``folder``'s sidecar; ``ValueError`` pointing at ``dcp.load`` where there is none."""
    path = folder / SIDECAR
    if not (folder / ".metadata").exists():
        raise ValueError(
            f"load_sharded: {folder} holds no .metadata: not a complete checkpoint (a save that failed "
            "or is still running writes none). Pass the folder a finished save wrote."
        )
    if not path.exists():
        raise ValueError(
            f"load_sharded: {folder} has no {SIDECAR} (it was written by dcp.save, or by an fsdp2 before "
            "the flat loader); load it with torch.distributed.checkpoint.load(state, checkpoint_id=path)."
        )
    body = json.loads(path.read_bytes())
    if body.get("format") != FORMAT or body.get("version") != VERSION:
        raise ValueError(
            f"load_sharded: {path} is format {body.get('format')!r} version {body.get('version')!r}; "
            f"this fsdp2 reads {FORMAT!r} version {VERSION}. Load it with torch.distributed.checkpoint.load."
        )
    meshes = [
        MeshRanks(tuple(m["shape"]), m.get("start", 0), m.get("step", 1), m.get("ranks"))
        for m in body["meshes"]
    ]
    layouts, owners = [], []
    for entry in body["tensors"]:
        mesh = None if entry["mesh"] is None else meshes[entry["mesh"]]
        placements = tuple(_decode_placement(p) for p in entry["placements"])
        shape = () if mesh is None else mesh.shape
        layouts.append(
            TensorLayout(entry["key"], tuple(entry["shape"]), _dtype(entry["dtype"]), shape, placements)
        )
        owners.append(mesh)
    objects = {key: (offset, length) for key, offset, length in body["objects"]}
    return SavedLayout(layouts, owners, objects)


def write_file(path: Path, data: bytes) -> None:
    """``data`` into ``path`` under a temporary name, then renamed (a reader never sees half a file)."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
