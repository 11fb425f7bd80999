"""One rank's snapshot as bytes: a table of tensors, the tree around them, and the file that holds both.

Owns: ``Leaf`` (one tensor of the state: where it sits in the tree, its dtype, its global shape and the
dimension it is sharded on), ``capture`` (a state tree -> ``RankSnapshot``: every tensor's local values
copied into one host buffer), and the snapshot file (``write_file``, ``read_header``, ``read_file``).
Does not own where files live (``_store``) or how shards move between ranks (``_reshard``).

[Note: The snapshot file]
``MAGIC``, the header's length (8 bytes, little-endian), the header (a pickled dict: step, world size,
rank, the leaf table, the tree with every tensor replaced by ``LeafRef(i)``, each leaf's byte offset,
the payload's length and CRC-32), then the payload: each leaf's local values, in table order, each
starting at a multiple of 64 bytes so it can be viewed in its dtype where it lies. A file is written
under a temporary name and renamed into place, so a file with its final name is whole; its CRC tells
bytes damaged after that.
"""

from __future__ import annotations

import os
import pickle
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

MAGIC = b"FSDP2SNP"
VERSION = 1
_ALIGN = 64


@dataclass(frozen=True)
class Leaf:
    """One tensor of the state tree: its path of keys, dtype, global shape and sharded dimension.

    ``dim`` is the dimension a 1-D mesh shards it on (each rank holds ``torch.chunk``'s piece), or
    ``None`` for a tensor every rank holds whole (a step count, an unsharded buffer).
    """

    path: tuple[Any, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    dim: int | None

    @property
    def name(self) -> str:
        return "/".join(str(key) for key in self.path)


@dataclass(frozen=True)
class LeafRef:
    """Where leaf ``index`` of the table sat in the tree."""

    index: int


@dataclass
class RankSnapshot:
    """What one rank captured at one step: the header fields and the payload (uint8, on the host)."""

    step: int
    world: int
    rank: int
    leaves: list[Leaf]
    offsets: list[int]
    tree: Any
    payload: torch.Tensor

    def local(self, index: int) -> torch.Tensor:
        """Leaf ``index``'s local values, a view of the payload in the leaf's dtype and local shape."""
        leaf = self.leaves[index]
        shape = local_shape(leaf, self.world, self.rank)
        nbytes = _nbytes(shape, leaf.dtype)
        start = self.offsets[index]
        return self.payload[start : start + nbytes].view(leaf.dtype).view(shape)

    def tree_bytes(self) -> bytes:
        return pickle.dumps(self.tree, protocol=pickle.HIGHEST_PROTOCOL)


def rows(size: int, world: int, rank: int) -> tuple[int, int]:
    """The ``[start, stop)`` of ``rank``'s chunk of ``size`` rows over ``world`` ranks, as ``torch.chunk``."""
    chunk = -(-size // world) if size else 0
    start = min(rank * chunk, size)
    return start, min(start + chunk, size)


def local_shape(leaf: Leaf, world: int, rank: int) -> tuple[int, ...]:
    if leaf.dim is None:
        return leaf.shape
    start, stop = rows(leaf.shape[leaf.dim], world, rank)
    shape = list(leaf.shape)
    shape[leaf.dim] = stop - start
    return tuple(shape)


def fingerprint(leaves: list[Leaf]) -> int:
    """A number that differs when the leaf tables differ (names, dtypes, shapes, layouts)."""
    text = repr([(leaf.path, str(leaf.dtype), leaf.shape, leaf.dim) for leaf in leaves])
    return zlib.crc32(text.encode())


def capture(tree: Any, step: int, world: int, rank: int) -> RankSnapshot:
    """Copy every tensor of ``tree`` (this rank's local values) into one host buffer.

    Raises:
        ValueError: a DTensor is laid out other than sharded on one dimension of a 1-D mesh.
    """
    leaves: list[Leaf] = []
    locals_: list[torch.Tensor] = []

    def visit(node: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(node, torch.Tensor):
            leaf, local = _leaf(node, path)
            leaves.append(leaf)
            locals_.append(local)
            return LeafRef(len(leaves) - 1)
        if isinstance(node, dict):
            return type(node)((key, visit(value, (*path, key))) for key, value in node.items())
        if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
            return type(node)(visit(value, (*path, i)) for i, value in enumerate(node))
        return node

    skeleton = visit(tree, ())
    offsets, total = [], 0
    for local in locals_:
        offsets.append(total)
        total += _padded(local.numel() * local.element_size())
    payload = torch.empty(total, dtype=torch.uint8)
    for offset, local in zip(offsets, locals_, strict=True):
        nbytes = local.numel() * local.element_size()
        if nbytes:
            payload[offset : offset + nbytes].copy_(local.detach().contiguous().view(-1).view(torch.uint8))
    return RankSnapshot(step, world, rank, leaves, offsets, skeleton, payload)


def _leaf(tensor: torch.Tensor, path: tuple[Any, ...]) -> tuple[Leaf, torch.Tensor]:
    if not isinstance(tensor, DTensor):
        return Leaf(path, tensor.dtype, tuple(tensor.shape), None), tensor.detach().cpu()
    placements = tuple(tensor.placements)
    if tensor.device_mesh.ndim != 1 or not isinstance(placements[0], Shard):
        name = "/".join(str(key) for key in path)
        raise ValueError(
            f"fsdp2 snapshots reshard tensors sharded on one dimension of a 1-D mesh (FSDP); {name} has "
            f"placements {placements} on a {tensor.device_mesh.ndim}-D mesh. Save this layout (HSDP, tensor "
            "parallelism) with torch.distributed.checkpoint instead."
        )
    leaf = Leaf(path, tensor.dtype, tuple(tensor.shape), placements[0].dim)
    return leaf, tensor.to_local().detach().cpu()


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """A uint8 host tensor's bytes, without a copy."""
    array: Any = tensor.numpy()  # numpy arrays are buffers; its type stubs do not say so
    return memoryview(array).cast("B")


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * torch.empty((), dtype=dtype).element_size()


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


# -- the file --------------------------------------------------------------------------------------


def header_of(snapshot: RankSnapshot) -> dict[str, Any]:
    return {
        "version": VERSION,
        "step": snapshot.step,
        "world": snapshot.world,
        "rank": snapshot.rank,
        "leaves": snapshot.leaves,
        "offsets": snapshot.offsets,
        "tree": snapshot.tree,
        "fingerprint": fingerprint(snapshot.leaves),
        "nbytes": snapshot.payload.numel(),
        "crc": zlib.crc32(host_bytes(snapshot.payload)),
    }


def encode_header(snapshot: RankSnapshot) -> bytes:
    """The file's bytes before the payload: what a buddy receives first (the payload follows as it is)."""
    header = pickle.dumps(header_of(snapshot), protocol=pickle.HIGHEST_PROTOCOL)
    return MAGIC + struct.pack("<Q", len(header)) + header


def write_file(path: Path, parts: list[bytes | memoryview]) -> None:
    """Write ``parts`` one after another to ``path``, whole or not at all (a temporary name, a rename)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as handle:
        for part in parts:
            handle.write(part)
    os.replace(temporary, path)


def read_header(path: Path) -> dict[str, Any]:
    """The header of a snapshot file, without its payload.

    Raises:
        ValueError: not a snapshot file of this version, or cut short.
    """
    with open(path, "rb") as handle:
        start = handle.read(len(MAGIC) + 8)
        if len(start) != len(MAGIC) + 8 or not start.startswith(MAGIC):
            raise ValueError(f"{path} is not an fsdp2 snapshot file")
        (length,) = struct.unpack("<Q", start[len(MAGIC) :])
        header = handle.read(length)
    if len(header) != length:
        raise ValueError(f"{path} is cut short (its header)")
    try:
        decoded: dict[str, Any] = pickle.loads(header)
    except Exception as error:
        raise ValueError(f"{path}: its header does not unpickle ({error})") from None
    if decoded.get("version") != VERSION:
        raise ValueError(f"{path} is of snapshot format {decoded.get('version')}, expected {VERSION}")
    return decoded


def decode(data: bytes | memoryview, where: str) -> RankSnapshot:
    """A file's bytes back to a ``RankSnapshot``, its payload checked against its CRC.

    Raises:
        ValueError: the bytes are not a whole snapshot, or their CRC differs (damaged).
    """
    view = memoryview(data)
    if bytes(view[: len(MAGIC)]) != MAGIC or len(view) < len(MAGIC) + 8:
        raise ValueError(f"{where} is not an fsdp2 snapshot")
    (length,) = struct.unpack("<Q", view[len(MAGIC) : len(MAGIC) + 8])
    start = len(MAGIC) + 8 + length
    try:
        header = pickle.loads(view[len(MAGIC) + 8 : start])
    except Exception as error:
        raise ValueError(f"{where}: its header does not unpickle ({error})") from None
    body = view[start:]
    if len(body) != header["nbytes"]:
        raise ValueError(f"{where} holds {len(body)} payload bytes, its header says {header['nbytes']}")
    if zlib.crc32(body) != header["crc"]:
        raise ValueError(f"{where}: its bytes differ from those written (CRC-32 mismatch)")
    payload = (
        torch.frombuffer(bytearray(body), dtype=torch.uint8)
        if len(body)
        else torch.empty(0, dtype=torch.uint8)
    )
    return RankSnapshot(
        header["step"],
        header["world"],
        header["rank"],
        header["leaves"],
        header["offsets"],
        header["tree"],
        payload,
    )


def read_file(path: Path) -> RankSnapshot:
    return decode(path.read_bytes(), str(path))


def fill(tree: Any, values: list[Any]) -> Any:
    """``tree`` with each ``LeafRef(i)`` replaced by ``values[i]``."""
    if isinstance(tree, LeafRef):
        return values[tree.index]
    if isinstance(tree, dict):
        return type(tree)((key, fill(value, values)) for key, value in tree.items())
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(fill(value, values) for value in tree)
    return tree
