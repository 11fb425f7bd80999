"""The divergence guard's shared-memory board: ranks on one host meet there (threads stand in for ranks)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch.distributed as dist

from fsdp2.debug._board import Board, Outcome, digest, open_board


def _boards(world: int, prefix: str) -> list[Board]:
    store = dist.HashStore()
    with ThreadPoolExecutor(world) as pool:
        opened = list(
            pool.map(lambda r: open_board(store, prefix, list(range(world)), r, 5.0, False), range(world))
        )
    assert all(isinstance(b, Board) for b in opened)
    return [b for b in opened if b is not None]


def _meet_all(boards: list[Board], seq: int, values: list[int], timeout: float = 5.0) -> list[Outcome]:
    with ThreadPoolExecutor(len(boards)) as pool:
        return list(pool.map(lambda bv: bv[0].meet(seq, bv[1], timeout), zip(boards, values, strict=True)))


def test_same_and_different_digests_over_several_agreements() -> None:
    boards = _boards(3, "t1/")
    a, b = digest(b"all-gather of layers.0"), digest(b"all-gather of layers.1")
    assert a != b
    assert _meet_all(boards, 0, [a, a, a]) == [Outcome.SAME] * 3
    assert _meet_all(boards, 1, [b, b, b]) == [Outcome.SAME] * 3
    assert _meet_all(boards, 2, [a, b, a]) == [Outcome.DIFFER] * 3


def test_a_rank_that_does_not_come_is_late_and_a_rank_coming_later_sees_the_abort() -> None:
    boards = _boards(2, "t2/")
    assert _meet_all(boards, 0, [7, 7]) == [Outcome.SAME] * 2
    assert boards[0].meet(1, 7, timeout=0.2) is Outcome.LATE
    assert boards[0].missing(1) == [1]
    boards[0].abort()
    assert boards[1].meet(1, 7, timeout=5.0) is Outcome.ABORTED  # at once, not after its own timeout


def test_the_board_file_is_removed_once_every_rank_mapped_it() -> None:
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    before = set(os.listdir(folder)) if folder else set()
    boards = _boards(2, "t3/")
    assert _meet_all(boards, 0, [1, 1]) == [Outcome.SAME] * 2
    if folder:
        assert not {n for n in set(os.listdir(folder)) - before if n.startswith("fsdp2-guard-")}


def test_a_rank_that_cannot_map_it_sends_every_rank_to_the_store(monkeypatch: Any) -> None:
    import fsdp2.debug._board as board_module

    original = board_module._map
    lock = threading.Lock()
    calls: list[int] = []

    def map_once(path: str, size: int, token: bytes) -> Any:
        with lock:
            calls.append(1)
            first = len(calls) == 1
        return None if first else original(path, size, token)  # one rank fails (another host)

    monkeypatch.setattr(board_module, "_map", map_once)
    store = dist.HashStore()
    with ThreadPoolExecutor(2) as pool:
        opened = list(pool.map(lambda r: open_board(store, "t4/", [0, 1], r, 5.0, False), range(2)))
    assert opened == [None, None]
