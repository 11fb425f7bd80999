"""Buckets of parameters gathered for ``WeightSync``: one all-gather of packed local shards each.

Owns: which parameters can share a gather (``row_group``: sharded by rows on one mesh dim, replicated
on the others, as FSDP and HSDP lay them out), cutting the parameters into buckets (consecutive ones
of one group, up to a byte cap), and one bucket's gather: its values (and the change masks of the
ones sent sparse) packed into one byte buffer per rank, one all-gather of it, and the full tensors
cut back out. Parameters of any other layout are gathered alone with DTensor's ``full_tensor``.
Does not own: what is sent (``_weight_sync``), or when (see [Note: No yield inside a collective]
there).

[Note: A packed bucket]
Each rank's part of a bucket is the same number of bytes on every rank: per parameter, room for
``ceil(rows / W)`` rows (torch.chunk's split, the one DTensor's ``Shard(0)`` uses) of its values in
the sync dtype, then as many one-byte mask values where the parameter goes sparse, each run rounded
up to 8 bytes so that every run starts aligned for any dtype. A rank with fewer rows (uneven shards)
leaves the rest of its room unwritten; the reader takes only each rank's rows. The rows, the
alignment and the row-shard test are the exchange floor's (``param._rows``, ``comm._exchange``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..comm import padded
from ..param import RowLayout, row_shard

__all__ = ["Item", "buckets", "full_bytes", "gather_bucket", "gather_device", "row_group"]


@dataclass
class Item:
    """One parameter to send.

    Its name, the parameter, this rank's values in the sync dtype, and this rank's change mask where
    it goes sparse (``None``: dense).
    """

    name: str
    param: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor | None = None


def row_group(param: torch.Tensor) -> Any | None:
    """The process group ``param``'s rows are sharded over, where it is laid out as FSDP lays them.

    That is a DTensor with one ``Shard(0)`` placement and ``Replicate`` on every other mesh dim (an
    FSDP or HSDP parameter); ``None`` for anything else (a plain tensor, tensor parallel layouts).
    """
    if not isinstance(param, DTensor) or param.dim() == 0:
        return None
    mesh_dim = row_shard(param)
    return None if mesh_dim is None else param.device_mesh.get_group(mesh_dim)


def _room(item: Item, world: int) -> tuple[int, int]:
    """Bytes a rank's part of the bucket keeps for ``item``: its values, its mask (aligned)."""
    shape = item.param.shape
    elems = RowLayout.chunked(shape[0], world).step * shape[1:].numel()  # the padded part
    values = padded(elems * item.values.element_size())
    mask = padded(elems) if item.mask is not None else 0
    return values, mask


def full_bytes(item: Item) -> int:
    """Bytes of ``item`` once gathered (values, and the mask if it goes sparse)."""
    per_element = item.values.element_size() + (item.mask is not None)
    return item.param.numel() * per_element


def buckets(items: Sequence[Item], cap_bytes: int) -> Iterator[tuple[Any | None, list[Item]]]:
    """``items`` cut into ``(group, bucket)`` runs, in order.

    A bucket is consecutive items of one row group, at most ``cap_bytes`` once gathered (an item
    larger than the cap alone; a cap of 0: one item each). Items of no row group come alone, with
    group ``None``.
    """
    group: Any | None = None
    bucket: list[Item] = []
    size = 0
    for item in items:
        here = row_group(item.param)
        grows = bucket and here is group and here is not None and size + full_bytes(item) <= cap_bytes
        if bucket and not grows:
            yield group, bucket
            bucket, size = [], 0
        group = here
        bucket.append(item)
        size += full_bytes(item)
    if bucket:
        yield group, bucket


def gather_bucket(
    group: Any | None, bucket: Sequence[Item], whole: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Every item's full values and full mask (``None`` where dense), in order, all gathered.

    A row group's bucket is one all-gather (see [Note: A packed bucket]); an item of no row group is
    gathered with ``whole(param, local)`` (DTensor's ``full_tensor``, one collective per tensor).
    Every collective has completed when this returns.
    """
    if group is None:
        return [
            (whole(i.param, i.values), None if i.mask is None else whole(i.param, i.mask)) for i in bucket
        ]
    world = dist.get_world_size(group)
    rooms = [_room(item, world) for item in bucket]
    part = sum(values + mask for values, mask in rooms)
    device = gather_device(bucket[0].param, bucket[0].values)
    mine = torch.empty(part, dtype=torch.uint8, device=device)
    offset = 0
    for item, (values, mask) in zip(bucket, rooms, strict=True):
        _put(mine, offset, item.values)
        if item.mask is not None:
            _put(mine, offset + values, item.mask)
        offset += values + mask
    everyone = torch.empty(world * part, dtype=torch.uint8, device=device)
    # torch >= 2.10 names it all_gather_single; looked up at each call, so a patch of it sees this one
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(everyone, mine, group=group, async_op=True).wait()
    return _unpack(everyone.view(world, part), bucket, rooms)


def gather_device(param: torch.Tensor, local: torch.Tensor) -> torch.device:
    """Where ``param``'s collectives run.

    Its local tensor's device, or its mesh's device type where the local tensor is elsewhere (shards
    offloaded to the CPU, gathered on the accelerator).
    """
    kind = param.device_mesh.device_type if isinstance(param, DTensor) else local.device.type
    return local.device if local.device.type == kind else torch.device(kind)


def _put(buffer: torch.Tensor, offset: int, local: torch.Tensor) -> None:
    if local.numel():
        flat = local.reshape(-1)
        buffer[offset : offset + flat.numel() * flat.element_size()].copy_(flat.view(torch.uint8))


def _unpack(
    parts: torch.Tensor, bucket: Sequence[Item], rooms: Sequence[tuple[int, int]]
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    world = parts.shape[0]
    out: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    offset = 0
    for item, (values, mask) in zip(bucket, rooms, strict=True):
        full = _cut(parts, offset, item.param.shape, item.values.dtype, world)
        where = _cut(parts, offset + values, item.param.shape, torch.bool, world) if mask else None
        out.append((full, where))
        offset += values + mask
    return out


def _cut(parts: torch.Tensor, offset: int, shape: torch.Size, dtype: torch.dtype, world: int) -> torch.Tensor:
    """The full tensor of ``shape`` whose rows each rank's part holds at ``offset``.

    torch.chunk's ranks hold ``step`` rows each up to the last holder, which may hold fewer, and the
    ranks after it none: so the full tensor is the first ranks' rooms back to back, then the last
    holder's rows. Two byte copies out of ``parts``, whatever the world size (no piece per rank).
    """
    step, rows = RowLayout.chunked(shape[0], world).step, shape[0]
    row_bytes = shape[1:].numel() * dtype.itemsize
    full = torch.empty(shape, dtype=dtype, device=parts.device)
    flat = full.view(-1).view(torch.uint8) if full.numel() else full.new_empty(0, dtype=torch.uint8)
    whole = rows // step if step else 0  # ranks holding step rows each
    room = step * row_bytes
    flat[: whole * room].view(whole, room).copy_(parts[:whole, offset : offset + room])
    rest = (rows - whole * step) * row_bytes  # the last holder's, when it holds fewer
    if rest:
        flat[whole * room :].copy_(parts[whole, offset : offset + rest])
    return full
