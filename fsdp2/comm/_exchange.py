"""The byte exchange: tensors packed into aligned bytes, one variable-size all-to-all, taken back.

Owns: ``pack`` (tensors' raw bytes back to back, each padded to ``align`` bytes), ``take`` (a tensor
viewed back out of such bytes), ``Scratch`` (send and receive buffers reused across exchanges),
``exchange`` (each rank's tensors for every peer, one ``all_to_all_single``), ``Packed`` (bytes a
caller packed itself) and ``Received`` (what an exchange brought, read per peer in the order it was
packed). Does not own: what goes where (the routes between row layouts, ``param._rows``) or what the
bytes mean (the callers').

[Note: Counts known and unknown]
A receiver that can compute what each peer sends (sizes from shapes, dtypes and routes) passes
``expect``: no counts travel. Its sizes are checked once, by one all-reduce of two integers: for each
of two weightings ``h``, each rank adds up ``bytes sent to j * h(i, j)`` and subtracts ``bytes
expected from j * h(j, i)`` modulo the prime ``2^31 - 1``, so the ranks' sums are zero when every
pair agrees. One pair that disagrees always shows (the prime divides neither a nonzero weight nor a
difference below 2 GiB); several that cancel in both sums at once are a chance of about 2^-62. Where
some rank's sizes are wrong every rank raises, so none waits in an all-to-all that would not match.
Without ``expect`` the counts are exchanged first (one small all-to-all) and nothing can disagree.

[Note: Sparse sends]
At thousands of ranks a rank exchanges rows with a few peers only (a chunk to its owner; an owner's
chunks from every rank only where it owns something). ``sends`` and ``expect`` may so name only those
peers (mappings), and ``Received`` cuts a peer's bytes out of the buffer when that peer is read: the
Python work of an exchange follows the peers it moves bytes with. What stays per rank of the group is
torch's own: the two lists of split sizes ``all_to_all_single`` takes (built in C from the sparse
sizes) and the offsets of the received parts (one running sum, in C).

Where one tensor's rows go to or come from many ranks (an owner scattering a matrix's rows, or
gathering them), even a view per rank adds up: a sender whose pieces lie back to back in one tensor
passes them as ``Packed`` (its bytes as they are, a size per rank), and ``Received.take_rows`` takes
rows from several peers as one view where they arrived back to back in row order (no padding between
them), else copies them into one tensor. Either way the values are the same bytes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["ALIGN", "Packed", "Received", "Scratch", "exchange", "nbytes_of", "pack", "padded", "take"]

ALIGN = 8  # every piece starts aligned for any dtype
_PRIME = 2**31 - 1
_BASES = (48271, 69621)  # two weightings of the size check (primitive roots modulo _PRIME)


def padded(nbytes: int, align: int = ALIGN) -> int:
    """``nbytes`` rounded up to a multiple of ``align``."""
    return -(-nbytes // align) * align


def nbytes_of(shape: Sequence[int], dtype: torch.dtype, align: int = ALIGN) -> int:
    """The packed size of a tensor of ``shape`` and ``dtype``."""
    return padded(math.prod(shape) * dtype.itemsize, align)


class Scratch:
    """A send and a receive byte buffer, reused by every exchange given it (grown when one needs more).

    Fresh buffers each time would cost a page fault per page of every tensor, and leave the allocator's
    peak above what one exchange needs.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, kind: str, nbytes: int) -> torch.Tensor:
        buffer = self._buffers.get(kind)
        if buffer is None or buffer.numel() < nbytes:
            self._buffers.pop(kind, None)  # freed before its successor is allocated
            buffer = self._buffers[kind] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buffer[:nbytes]


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def pack(
    tensors: Sequence[torch.Tensor],
    device: torch.device,
    align: int = ALIGN,
    scratch: Scratch | None = None,
) -> torch.Tensor:
    """The bytes of ``tensors`` one after another, each padded with zeros to ``align`` bytes.

    One tensor needing no padding is returned as its own bytes (no copy); otherwise the bytes go into
    ``scratch``'s send buffer when given, else a new one.
    """
    chunks: list[torch.Tensor] = []
    for tensor in tensors:
        data = _raw(tensor)
        if data.numel():
            chunks.append(data)
        pad = padded(data.numel(), align) - data.numel()
        if pad:
            chunks.append(data.new_zeros(pad))
    if len(chunks) == 1:
        return chunks[0]
    total = sum(c.numel() for c in chunks)
    out = scratch.take("send", total) if scratch is not None else None
    if not chunks:
        return torch.empty(0, dtype=torch.uint8, device=device) if out is None else out
    return torch.cat(chunks, out=out) if out is not None else torch.cat(chunks)


def take(
    buffer: torch.Tensor, offset: int, shape: Sequence[int], dtype: torch.dtype, align: int = ALIGN
) -> tuple[torch.Tensor, int]:
    """The tensor of ``shape`` and ``dtype`` at ``offset`` of ``buffer``, and the next piece's offset.

    A view of ``buffer``, or a copy where ``offset`` is not aligned for ``dtype`` (``align`` below it).
    """
    nbytes = math.prod(shape) * dtype.itemsize
    raw = buffer[offset : offset + nbytes]
    if raw.storage_offset() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype).view(tuple(shape)), offset + padded(nbytes, align)


class Received:
    """What one exchange brought: the bytes from each rank, all in ``buffer``, read per peer in order.

    A peer's bytes are cut out of ``buffer`` when first read (``part``): a receiver pays for the peers
    it reads, not for every rank of the group (see [Note: Sparse sends]).
    """

    def __init__(self, buffer: torch.Tensor, sizes: Sequence[int], align: int) -> None:
        self.buffer = buffer
        self._starts = list(itertools.accumulate(sizes, initial=0))  # in C: no view per rank
        self._align = align
        self._offsets: dict[int, int] = {}

    @property
    def parts(self) -> list[torch.Tensor]:
        """The bytes from every rank, in rank order (a view per rank: for callers that read them all)."""
        return [self.part(peer) for peer in range(len(self._starts) - 1)]

    def part(self, peer: int) -> torch.Tensor:
        """The bytes ``peer`` sent (a view of ``buffer``)."""
        return self.buffer[self._starts[peer] : self._starts[peer + 1]]

    def take(self, peer: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """The next tensor ``peer`` packed (of ``shape`` and ``dtype``)."""
        start = self._starts[peer]
        offset = self._offsets.get(peer, 0)
        raw = self.buffer[start : self._starts[peer + 1]]
        piece, self._offsets[peer] = take(raw, offset, shape, dtype, self._align)
        return piece

    def take_rows(
        self, peers: Sequence[int], rows: Sequence[int], width: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """The next ``rows[k]`` rows of ``width`` from each ``peers[k]``, joined: ``[sum(rows), width]``.

        One view of ``buffer`` where the pieces lie back to back (each peer's next bytes starting where
        the previous piece's end, none padded) and aligned for ``dtype``, else a new tensor. Offsets
        move as ``take`` moves them. No pieces: an empty ``[0, width]`` tensor.
        """
        row_bytes = width * dtype.itemsize
        ats = []
        for peer, count in zip(peers, rows, strict=True):
            offset = self._offsets.get(peer, 0)
            ats.append(self._starts[peer] + offset)
            self._offsets[peer] = offset + padded(count * row_bytes, self._align)
        total = sum(rows)
        first = ats[0] if ats else 0
        stop = first + total * row_bytes
        if first % dtype.itemsize == 0 and ats == list(
            itertools.accumulate((count * row_bytes for count in rows[:-1]), initial=first)
        ):
            return self.buffer[first:stop].view(dtype).view(total, width)
        pieces = [
            take(self.buffer, at, (count, width), dtype, self._align)[0]
            for at, count in zip(ats, rows, strict=True)
        ]
        return (
            torch.cat(pieces) if pieces else torch.empty((0, width), dtype=dtype, device=self.buffer.device)
        )


@dataclass(frozen=True)
class Packed:
    """Bytes already packed for an exchange, sent as they are.

    ``data`` holds ``sizes[r]`` bytes for each rank ``r`` named, in ascending rank order, each a
    multiple of the exchange's ``align``: a caller whose pieces lie back to back in one tensor sends
    them without a view and a copy per piece.
    """

    data: torch.Tensor  # uint8, one dimension
    sizes: Mapping[int, int]


Sends = Sequence[Sequence[torch.Tensor]] | Mapping[int, Sequence[torch.Tensor]] | Packed


def exchange(
    sends: Sends,
    group: dist.ProcessGroup | None,
    *,
    expect: Sequence[int] | Mapping[int, int] | None = None,
    scratch: Scratch | None = None,
    device: torch.device | None = None,
    align: int = ALIGN,
    check: bool = True,
    mismatch: str = "the ranks disagree on the sizes of an exchange",
) -> Received:
    """Send the tensors ``sends[r]`` (packed, see ``pack``) to each rank ``r`` of ``group``: one all-to-all.

    Args:
        sends: per rank of ``group``, the tensors for it, in the order it takes them back: a list of
            one entry per rank, or a mapping of only the ranks sent to (see [Note: Sparse sends]).
        group: the process group (``None``: the default one; one rank when none is initialized).
        expect: the bytes (packed) each rank sends this one, when the caller knows them (a list per
            rank, or a mapping of only the ranks that send): no counts travel, and with ``check`` one
            all-reduce checks them (see [Note: Counts known and unknown]); ``None``: the counts are
            exchanged first.
        scratch: buffers reused across exchanges (their device is the exchange's).
        device: where buffers go without ``scratch`` (default: the first tensor's, else the CPU).
        align: each tensor's bytes are padded to this.
        check: check ``expect`` against what the ranks send (one all-reduce).
        mismatch: the ``RuntimeError``'s message on every rank when the sizes disagree.
    """
    if isinstance(sends, Packed):
        sent = _packed_sizes(sends, align)
        device = device or (scratch.device if scratch is not None else sends.data.device)
        source = sends.data
    else:
        to = _sparse(sends)
        if device is None:
            device = scratch.device if scratch is not None else _first_device(to)
        sent = {
            peer: sum(padded(t.numel() * t.element_size(), align) for t in tensors)
            for peer, tensors in to.items()
        }
        source = pack([t for peer in sorted(to) for t in to[peer]], device, align, scratch)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        sizes = [source.numel()]
        if expect is not None and check and _dense(expect, 1) != sizes:
            raise RuntimeError(mismatch)
        out = _receive_buffer(scratch, source.numel(), device)
        out.copy_(source)
        return Received(out, sizes, align)
    out_sizes = _dense(sent, world)
    if expect is None:
        counts = _counts(sent, world, device)
        theirs = torch.empty_like(counts)
        dist.all_to_all_single(theirs, counts, group=group)
        sizes = theirs.tolist()
    else:
        sizes = _dense(expect, world)
        if check and not _sizes_agree(sent, _nonzero(expect), group, device):
            raise RuntimeError(mismatch)
    out = _receive_buffer(scratch, sum(sizes), device)
    dist.all_to_all_single(out, source, sizes, out_sizes, group=group)
    return Received(out, sizes, align)


def _packed_sizes(sends: Packed, align: int) -> dict[int, int]:
    """``sends.sizes`` (nonzero only), checked against its bytes before anything travels."""
    sizes = {peer: n for peer, n in sends.sizes.items() if n}
    if sends.data.dtype != torch.uint8 or sends.data.ndim != 1 or sends.data.numel() != sum(sizes.values()):
        raise ValueError(
            f"exchange: Packed bytes of {sends.data.numel()} {sends.data.dtype} elements for sizes adding "
            f"up to {sum(sizes.values())}; pass one-dimensional uint8 bytes holding exactly those sizes."
        )
    if any(n % align for n in sizes.values()) or list(sizes) != sorted(sizes):
        raise ValueError(
            f"exchange: Packed sizes must be multiples of {align} bytes, in ascending rank order; "
            "pad each rank's bytes and name the ranks in order (or pass tensors, which pack pads)."
        )
    return sizes


def _sparse(
    sends: Sequence[Sequence[torch.Tensor]] | Mapping[int, Sequence[torch.Tensor]],
) -> dict[int, Sequence[torch.Tensor]]:
    """The peers sent to, with their tensors (a list's empty entries left out)."""
    items = sends.items() if isinstance(sends, Mapping) else enumerate(sends)
    return {peer: tensors for peer, tensors in items if tensors}


def _nonzero(sizes: Sequence[int] | Mapping[int, int]) -> dict[int, int]:
    items = sizes.items() if isinstance(sizes, Mapping) else enumerate(sizes)
    return {peer: n for peer, n in items if n}


def _dense(sizes: Sequence[int] | Mapping[int, int], world: int) -> list[int]:
    """One size per rank (a mapping's absent ranks: 0)."""
    if not isinstance(sizes, Mapping):
        return list(sizes)
    out = [0] * world
    for peer, n in sizes.items():
        out[peer] = n
    return out


def _counts(sizes: Mapping[int, int], world: int, device: torch.device) -> torch.Tensor:
    """One size per rank as a tensor, filled from the peers named (no tensor built from N Python ints)."""
    counts = torch.zeros(world, dtype=torch.int64)
    if sizes:
        counts[torch.tensor(list(sizes), dtype=torch.int64)] = torch.tensor(list(sizes.values()))
    return counts.to(device)


def _receive_buffer(scratch: Scratch | None, nbytes: int, device: torch.device) -> torch.Tensor:
    if scratch is not None:
        return scratch.take("receive", nbytes)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _first_device(sends: Mapping[int, Sequence[torch.Tensor]]) -> torch.device:
    return next((t.device for tensors in sends.values() for t in tensors), torch.device("cpu"))


def _weight(base: int, sender: int, receiver: int) -> int:
    return pow(base, sender * 1_000_003 + receiver + 1, _PRIME)


def _sizes_agree(
    sent: Mapping[int, int], expect: Mapping[int, int], group: dist.ProcessGroup | None, device: torch.device
) -> bool:
    """Whether every rank sends every other what that one expects (one all-reduce; see the Note).

    ``sent`` and ``expect``: the nonzero sizes, by peer. Under torch's fake process group (one process
    standing in for a rank of a simulated world) the all-reduce returns this rank's own sum, so there
    is nothing to compare: the sizes are taken as agreed, and the exchange itself moves nothing.
    """
    if dist.get_backend(group) == "fake":
        return True
    me = dist.get_rank(group)
    sums = []
    for base in _BASES:
        mine = sum(n * _weight(base, me, peer) for peer, n in sent.items() if n)
        mine -= sum(n * _weight(base, peer, me) for peer, n in expect.items() if n)
        sums.append(mine % _PRIME)
    total = torch.tensor(sums, dtype=torch.int64, device=device)
    dist.all_reduce(total, group=group)
    return all(int(value) % _PRIME == 0 for value in total.tolist())
