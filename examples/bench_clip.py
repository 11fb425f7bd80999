"""Time ``torch.nn.utils.clip_grad_norm_`` against ``fsdp2.clip_grad_norm_`` on the same gradients.

64 blocks of ``Linear(64, 64) + LayerNorm(64)``, each its own fully_shard group (256 DTensor
gradients), in a one-process gloo group; prints the median of 25 calls of each (after 5 warm-up calls)
and their ratio. Run: ``python examples/bench_clip.py``.
"""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import fsdp2


def median_ms(fn: Callable[[], object], calls: int = 30, warmup: int = 5) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:]) * 1e3


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)) for _ in range(64)])
        for block in model:
            fsdp2.fully_shard(block)
        fsdp2.fully_shard(model)
        model(torch.randn(8, 64)).sum().backward()
        params = list(model.parameters())
        # A huge max_norm measures without changing the gradients between calls.
        ours = median_ms(lambda: fsdp2.clip_grad_norm_(params, 1e9))
        theirs = median_ms(lambda: torch.nn.utils.clip_grad_norm_(params, 1e9))
        print(
            f"{len(params)} gradients: torch {theirs:.2f} ms, fsdp2 {ours:.2f} ms, ratio {ours / theirs:.3f}"
        )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
