"""Call sites that must type-check under ``mypy --strict`` without ignores (``nox -s typecheck``).

Never executed: mypy reads it to prove the public API's overloads give users the right types.
"""

from __future__ import annotations

import torch
from torch import nn

import fsdp2


def shard_transformer_like(blocks: list[nn.Module], root: nn.Module) -> fsdp2.FSDPModule:
    policy = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks:
        fsdp2.fully_shard(block, mp_policy=policy, reshard_after_forward=True)
    grouped: list[fsdp2.FSDPModule] = fsdp2.fully_shard(blocks[:2], reshard_after_forward=False)
    sharded: fsdp2.FSDPModule = fsdp2.fully_shard(
        root, offload_policy=fsdp2.CPUOffloadPolicy(pin_memory=False)
    )
    grouped[0].set_modules_to_backward_prefetch([grouped[1]])
    handle = sharded.unshard(async_op=True)
    if handle is not None:
        handle.wait()
    sharded.reshard()
    sharded.set_requires_gradient_sync(False, recurse=True)
    with fsdp2.record_events() as events:
        pass
    kinds: list[str] = [event.kind for event in events]
    del kinds
    report: fsdp2.CommunicationReport = fsdp2.communication_report(events)
    rows: tuple[fsdp2.CommunicationRow, ...] = report.rows
    exposed: float = report.total.exposed_s + sum(row.exposed_s for row in rows)
    del exposed
    sharded.set_bucket_cap_mb(25, 25)
    sharded.set_bucket_cap_mb(all_gather="auto", reduce_scatter=None)
    caps: fsdp2.BucketCaps = sharded.set_bucket_cap_mb("auto")
    fit: fsdp2.CollectiveFit | None = caps.all_gather_fit
    cap_mb: float | None = caps.reduce_scatter_mb
    del fit, cap_mb
    return sharded
