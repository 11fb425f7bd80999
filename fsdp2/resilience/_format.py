"""One rank's snapshot as bytes: a table of tensors, the tree around them, and the file that holds both.

Owns: ``Leaf`` (one tensor of the state: where it sits in the tree, its dtype, its global shape and the
dimension it is sharded on; ``rows_of``, ``position`` and ``rank_at``: its pieces' rows and which rank
holds which), ``capture`` (a state tree -> ``RankSnapshot``: every tensor's local values
copied into one host buffer), and the snapshot file (``write_file``, ``read_header``, ``read_file``).
Does not own where files live (``_store``) or how shards move between ranks (``_reshard``).

[Note: The snapshot file]
``MAGIC``, the header's length (8 bytes, little-endian), the header (a pickled dict: step, world size,
rank, the leaf table, the tree with every tensor replaced by ``LeafRef(i)``, each leaf's byte offset,
the payload's length and CRC-32), then the payload: each leaf's local values, in table order, each
starting at a multiple of 64 bytes so it can be viewed in its dtype where it lies (``comm.padded`` and
``comm.take`` at 64 bytes; the leaves are copied one by one into the host buffer rather than through
``comm.pack``, which would concatenate them where they lie: a second copy of the shards on the GPU). A
file is written under a temporary name and renamed into place, so a file with its final name is whole
(a write that fails removes its temporary file); its CRC tells bytes damaged after that.
"""

from __future__ import annotations

import os
import pickle
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..comm import padded, take
from ..param import RowLayout, row_shard

MAGIC = b"FSDP2SNP"
_PREFIX = len(MAGIC) + 8  # the magic, then the header's length
VERSION = 1
_ALIGN = 64


@dataclass(frozen=True)
class Leaf:
    """One tensor of the state tree: its path of keys, dtype, global shape and sharded dimension.

    ``dim`` is the dimension its rows are cut on (each rank holds ``torch.chunk``'s piece), or ``None``
    for a tensor every rank holds whole and that is no DTensor (a step count, an unsharded buffer).
    ``shards`` is how many pieces that dimension is cut into: ``None`` for the whole world (FSDP on a
    1-D mesh), the shard mesh dim's size for HSDP (rank ``r`` holds piece ``r % shards``: the ranks
    ``r``, ``r + shards``, ... are replicas of one another), 1 for a replicated DTensor (every rank
    holds all rows). ``replicas`` above 1: each of the ``shards`` pieces cut again into that many
    (optimizer state of ``fsdp2.shard_optimizer_across_replicas``, ``RowLayout.nested``): every rank
    holds its own piece, rank ``r`` the one at position ``(r % shards) * replicas + r // shards``.
    """

    path: tuple[Any, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    dim: int | None
    shards: int | None = None
    replicas: int = 1

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
        return take(self.payload, self.offsets[index], shape, leaf.dtype, _ALIGN)[0]


def local_shape(leaf: Leaf, world: int, rank: int) -> tuple[int, ...]:
    if leaf.dim is None:
        return leaf.shape
    shape = list(leaf.shape)
    shape[leaf.dim] = rows_of(leaf, world).count(position(leaf, world, rank))
    return tuple(shape)


def rows_of(leaf: Leaf, world: int) -> RowLayout:
    """How a sharded leaf's rows lie over its pieces (``torch.chunk``'s, or cut twice for slices)."""
    assert leaf.dim is not None, "a whole-held leaf has no row layout"
    shards = leaf.shards or world
    return RowLayout.nested(leaf.shape[leaf.dim], shards, leaf.replicas)


def position(leaf: Leaf, world: int, rank: int) -> int:
    """The piece of ``rows_of(leaf, world)`` that ``rank`` holds."""
    shards = leaf.shards or world
    return (rank % shards) * leaf.replicas + rank // shards if leaf.replicas > 1 else rank % shards


def rank_at(leaf: Leaf, world: int, piece: int) -> int:
    """The lowest rank holding piece ``piece`` (the only one for slices)."""
    if leaf.replicas == 1:
        return piece
    shard, replica = divmod(piece, leaf.replicas)
    return replica * (leaf.shards or world) + shard


def fingerprint(leaves: list[Leaf]) -> int:
    """A number that differs when the leaf tables differ (names, dtypes, shapes, layouts)."""
    text = repr([(leaf.path, str(leaf.dtype), leaf.shape, leaf.dim, leaf.shards) for leaf in leaves])
    if any(leaf.replicas > 1 for leaf in leaves):  # tables of the layouts before slices keep their number
        text += repr([leaf.replicas for leaf in leaves])
    return zlib.crc32(text.encode())


def capture(tree: Any, step: int, world: int, rank: int) -> RankSnapshot:
    """Copy every tensor of ``tree`` (this rank's local values) into one host buffer.

    Raises:
        ValueError: a DTensor is laid out other than ``layout_of`` takes.
    """
    leaves: list[Leaf] = []
    locals_: list[torch.Tensor] = []

    def take(tensor: torch.Tensor, path: tuple[Any, ...]) -> LeafRef:
        leaves.append(_leaf(tensor, path))
        locals_.append((tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach())
        return LeafRef(len(leaves) - 1)

    skeleton = _map(tree, torch.Tensor, take)
    offsets, total = [], 0
    for local in locals_:
        offsets.append(total)
        total += padded(local.numel() * local.element_size(), _ALIGN)
    payload = torch.empty(total, dtype=torch.uint8)
    for offset, local in zip(offsets, locals_, strict=True):
        nbytes = local.numel() * local.element_size()
        if nbytes:
            payload[offset : offset + nbytes].copy_(local.contiguous().view(-1).view(torch.uint8))
    return RankSnapshot(step, world, rank, leaves, offsets, skeleton, payload)


def check_layouts(tree: Any) -> None:
    """Raise what ``capture`` would raise for ``tree``'s layouts, without copying anything."""
    _map(tree, torch.Tensor, _leaf)


def fill(tree: Any, values: list[Any]) -> Any:
    """``tree`` with each ``LeafRef(i)`` replaced by ``values[i]``."""
    return _map(tree, LeafRef, lambda ref, _: values[ref.index])


def _map(
    node: Any, kind: type, on_leaf: Callable[[Any, tuple[Any, ...]], Any], path: tuple[Any, ...] = ()
) -> Any:
    """``node`` with each ``kind`` in its dicts, lists and tuples replaced by ``on_leaf(it, its path)``."""
    if isinstance(node, kind):
        return on_leaf(node, path)
    if isinstance(node, dict):
        return type(node)((key, _map(value, kind, on_leaf, (*path, key))) for key, value in node.items())
    if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
        return type(node)(_map(value, kind, on_leaf, (*path, i)) for i, value in enumerate(node))
    return node


def _leaf(tensor: torch.Tensor, path: tuple[Any, ...]) -> Leaf:
    """``tensor``'s leaf: a plain tensor is whole on every rank; a DTensor's rows as ``layout_of`` says."""
    if not isinstance(tensor, DTensor):
        return Leaf(path, tensor.dtype, tuple(tensor.shape), None)
    layout = layout_of(tensor)
    if layout is None:
        name = "/".join(str(key) for key in path)
        raise ValueError(
            f"fsdp2 snapshots reshard tensors sharded on one dimension of a 1-D mesh (FSDP), of the shard "
            f"dim of a (replicate, shard) mesh (HSDP), replicated on a 1-D mesh (replicate) or sliced "
            f"across the replicas of such a mesh (fsdp2.shard_optimizer_across_replicas), the mesh "
            f"over every rank in order; {name} has placements {tuple(tensor.placements)} on a "
            f"{tensor.device_mesh.ndim}-D mesh of ranks {tensor.device_mesh.mesh.flatten().tolist()}. "
            "Save this layout (tensor parallelism) with "
            "torch.distributed.checkpoint instead."
        )
    return Leaf(path, tensor.dtype, tuple(tensor.shape), *layout)


def layout_of(tensor: DTensor) -> tuple[int, int | None, int] | None:
    """``(dim, shards, replicas)`` of a DTensor whose rows a snapshot can cut (see ``Leaf``), else ``None``.

    ``Shard(d)`` on a 1-D mesh; ``(Replicate(), Shard(d))`` on a 2-D mesh whose ranks are the world's
    in order (rank ``r`` at ``(r // shards, r % shards)``, as ``init_device_mesh`` lays them out);
    ``Replicate()`` on a 1-D mesh of every rank, for a tensor of one dimension or more (its rows on
    dimension 0, one piece); ``(Shard(d), Shard(d))`` on the (shard, replicate) view of such a 2-D mesh
    (replica slices: rank ``r`` at ``(r % shards, r // shards)``). A ``_StridedShard`` (tensor
    parallelism's) is not: its rows interleave.
    """
    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    in_order = _every_rank_in_order(mesh.mesh.flatten())
    if mesh.ndim == 1 and isinstance(placements[0], Shard):
        shard = placements[0]
        return (shard.dim, None, 1) if row_shard(tensor, shard.dim) == 0 else None
    if mesh.ndim == 1 and placements == (Replicate(),) and tensor.ndim and in_order:
        return 0, 1, 1
    if mesh.ndim == 2 and in_order and type(placements[1]) is Shard and placements[0] == Replicate():
        dim = placements[1].dim
        return (dim, mesh.size(1), 1) if row_shard(tensor, dim) == 1 else None
    sliced = mesh.ndim == 2 and _every_rank_in_order(mesh.mesh.t().flatten())
    if sliced and type(placements[0]) is Shard and placements[1] == placements[0]:
        return placements[0].dim, mesh.size(0), mesh.size(1)
    return None


def _every_rank_in_order(ranks: torch.Tensor) -> bool:
    """Whether ``ranks`` are the world's ranks in order (one tensor comparison: no list of N ranks)."""
    world = dist.get_world_size()
    return ranks.numel() == world and bool((ranks == torch.arange(world)).all())


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """A uint8 host tensor's bytes, without a copy."""
    array: Any = tensor.numpy()  # numpy arrays are buffers; its type stubs do not say so
    return memoryview(array).cast("B")


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
    """Write ``parts`` one after another to ``path``, whole or not at all (a temporary name, a rename).

    A write that fails (a full disk) removes what it wrote of the temporary file before it raises.
    """
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as handle:
            for part in parts:
                handle.write(part)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def read_header(path: Path) -> dict[str, Any]:
    """The header of a snapshot file, without its payload.

    Raises:
        ValueError: not a snapshot file of this version, or cut short.
    """
    with open(path, "rb") as handle:
        length = _header_length(handle.read(_PREFIX), str(path))
        return _header(handle.read(length), length, str(path))


def decode(data: bytes | bytearray, where: str) -> RankSnapshot:
    """A file's bytes back to a ``RankSnapshot`` (its payload a view of ``data``), checked against its CRC.

    Raises:
        ValueError: the bytes are not a whole snapshot, or their CRC differs (damaged).
    """
    data = data if isinstance(data, bytearray) else bytearray(data)  # the payload views it: writable
    view = memoryview(data)
    length = _header_length(bytes(view[:_PREFIX]), where)
    header = _header(view[_PREFIX : _PREFIX + length], length, where)
    start = _PREFIX + length
    body = view[start:]
    if len(body) != header["nbytes"]:
        raise ValueError(f"{where} holds {len(body)} payload bytes, its header says {header['nbytes']}")
    if zlib.crc32(body) != header["crc"]:
        raise ValueError(f"{where}: its bytes differ from those written (CRC-32 mismatch)")
    payload = (
        torch.frombuffer(data, dtype=torch.uint8, offset=start)
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


def _header_length(start: bytes, where: str) -> int:
    if len(start) != _PREFIX or not start.startswith(MAGIC):
        raise ValueError(f"{where} is not an fsdp2 snapshot file")
    return int(struct.unpack("<Q", start[len(MAGIC) :])[0])


def _header(raw: bytes | memoryview, length: int, where: str) -> dict[str, Any]:
    if len(raw) != length:
        raise ValueError(f"{where} is cut short (its header)")
    try:
        header: dict[str, Any] = pickle.loads(raw)
    except Exception as error:
        raise ValueError(f"{where}: its header does not unpickle ({error})") from None
    if header.get("version") != VERSION:
        raise ValueError(f"{where} is of snapshot format {header.get('version')}, expected {VERSION}")
    return header


def read_file(path: Path) -> RankSnapshot:
    data = bytearray(path.stat().st_size)
    with open(path, "rb") as handle:
        handle.readinto(data)
    return decode(data, str(path))
