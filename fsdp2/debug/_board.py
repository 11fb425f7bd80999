"""The divergence guard's meeting place for ranks on one host: a board in shared memory.

Owns: ``Board`` (one mapped file per process group, one 16-byte slot per rank), setting it up through
the job's store (``open_board``), and the digest of a point. Does not own: what a point is, the errors
and their texts, or the store path for ranks on several hosts (``_guard``).

A meeting through the store costs each rank a few round trips to the store's server thread; on a host
whose cores all train, that was 0.2-0.3 ms a collective. On the board a rank writes one word (the
agreement's number and the digest of its point) into its slot and reads the others' until each shows
the same number, or the next one: a rank that moved on has passed this agreement, which it does only
after seeing every digest equal. It waits by yielding the processor (and the GIL) for up to 5 ms,
then by 1 ms sleeps. On the 2-core development VM that beat yielding 64 times and then sleeping
0.1 ms (each sleep overshoots the others' arrival by about that much) and yielding 0.2 ms then
sleeping 50 µs: debug / plain step 1.03-1.08 against 1.04-1.11 and 1.07-1.10 over the same runs.
Layout of a slot: word 0 = ``((seq + 1) mod 2**24) << 40 | digest`` (one aligned 8-byte store, so a
reader never sees a number with another agreement's digest; 0 until the rank first posts), word 1 =
1 once the rank gave up (timed out).
Set-up: the first rank of the group creates the file (in ``/dev/shm`` where it exists) with a random
token and publishes its path through the store; every rank maps it, checks the token and says whether
it could; all use the board only if all could (ranks on several hosts, or containers without a shared
``/dev/shm``, keep the store), and the creator then removes the file name (the mappings stay).
"""

from __future__ import annotations

import enum
import hashlib
import mmap
import os
import secrets
import struct
import tempfile
import time
from datetime import timedelta
from typing import Any

__all__ = ["Board", "Outcome", "board_key", "digest", "open_board"]

_YIELD_S = 0.005  # wait by yielding this long, then by 1 ms sleeps
_SLOT = 16
_SEQ_BITS, _DIGEST_BITS = 24, 40
_SEQ_MASK, _DIGEST_MASK = (1 << _SEQ_BITS) - 1, (1 << _DIGEST_BITS) - 1
_TOKEN = 16  # bytes of the random token at the start of the file


class Outcome(enum.Enum):
    SAME = "same"  # every rank posted the same digest (or moved on, having seen them equal)
    DIFFER = "differ"  # every rank arrived, with different digests
    LATE = "late"  # some rank did not arrive within the timeout
    ABORTED = "aborted"  # some rank gave up waiting (its reason is in the store)


def digest(text: bytes) -> int:
    """A 40-bit digest of a point's description."""
    return int.from_bytes(hashlib.blake2b(text, digest_size=5).digest(), "little")


def board_key(prefix: str, rank: int) -> str:
    """The store key where ``rank`` says whether it mapped the board."""
    return f"{prefix}board/{rank}"


class Board:
    """One rank's view of its process group's board: its slot index, the mapping, the group size."""

    def __init__(self, mapping: mmap.mmap, index: int, world: int) -> None:
        self._map, self._index, self._world = mapping, index, world

    def meet(self, seq: int, value: int, timeout: float) -> Outcome:
        """Post ``value`` for agreement ``seq`` and wait for every rank's (at most ``timeout`` s)."""
        mine = (((seq + 1) & _SEQ_MASK) << _DIGEST_BITS) | (value & _DIGEST_MASK)
        struct.pack_into("<q", self._map, _TOKEN + self._index * _SLOT, mine)
        start = time.monotonic()
        while True:
            outcome = self._read(seq, value)
            if outcome is not None:
                return outcome
            waited = time.monotonic() - start
            if waited < _YIELD_S:
                time.sleep(0)  # yield (and the GIL): the others are usually well under a millisecond away
            elif waited < timeout:
                time.sleep(0.001)  # a slow rank: poll each millisecond
            else:
                return Outcome.LATE

    def _read(self, seq: int, value: int) -> Outcome | None:
        words = struct.unpack_from(f"<{2 * self._world}q", self._map, _TOKEN)
        want, after = (seq + 1) & _SEQ_MASK, (seq + 2) & _SEQ_MASK
        differ = False
        for rank in range(self._world):
            word, gave_up = words[2 * rank], words[2 * rank + 1]
            if gave_up:
                return Outcome.ABORTED
            their = (word >> _DIGEST_BITS) & _SEQ_MASK
            if their == after:
                return Outcome.SAME  # that rank saw every digest equal and moved on
            if their != want:
                return None  # not here yet
            differ = differ or (word & _DIGEST_MASK) != value
        return Outcome.DIFFER if differ else Outcome.SAME

    def missing(self, seq: int) -> list[int]:
        """Group indices of the ranks that have not posted agreement ``seq``."""
        words = struct.unpack_from(f"<{2 * self._world}q", self._map, _TOKEN)
        want = (seq + 1) & _SEQ_MASK
        return [r for r in range(self._world) if (words[2 * r] >> _DIGEST_BITS) & _SEQ_MASK != want]

    def abort(self) -> None:
        """Tell the others this rank gave up (a rank arriving later raises at once)."""
        struct.pack_into("<q", self._map, _TOKEN + self._index * _SLOT + 8, 1)


def open_board(
    store: Any, prefix: str, ranks: list[int], me: int, timeout: float, waits: bool
) -> Board | None:
    """Set up the group's board (collective over ``ranks``); ``None`` if some rank could not map it.

    Raises the store's error if a rank does not come within ``timeout``.
    """
    index, world = ranks.index(me), len(ranks)
    size = _TOKEN + world * _SLOT
    path_key = f"{prefix}board/path"
    created = None
    if index == 0:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        token = secrets.token_bytes(_TOKEN)
        fd, created = tempfile.mkstemp(prefix="fsdp2-guard-", dir=folder)
        os.write(fd, token + bytes(size - _TOKEN))
        os.close(fd)
        store.set(path_key, created.encode() + b"\n" + token.hex().encode())
    try:
        if not waits:
            store.wait([path_key], timedelta(seconds=timeout))
        path, _, token_hex = store.get(path_key).decode().partition("\n")
        mapping = _map(path, size, bytes.fromhex(token_hex))
        store.set(board_key(prefix, me), b"1" if mapping is not None else b"0")
        keys = [board_key(prefix, r) for r in ranks]
        if not waits:
            store.wait(keys, timedelta(seconds=timeout))
        mapped = all(v == b"1" for v in store.multi_get(keys))
    finally:
        if created is not None:
            os.unlink(created)  # every rank has it mapped by now (or one never came)
    if not mapped:
        return None
    assert mapping is not None
    return Board(mapping, index, world)


def _map(path: str, size: int, token: bytes) -> mmap.mmap | None:
    try:
        with open(path, "r+b") as file:
            mapping = mmap.mmap(file.fileno(), size)
    except OSError:
        return None  # another host, or another /dev/shm
    if mapping[:_TOKEN] != token:
        mapping.close()
        return None
    return mapping
