"""Sharded checkpoints of CUDA shards: staged in the background, loaded without a plan gather.

Skipped without CUDA (2 thread ranks on one GPU, threaded backend). ``save_async(...,
stage_in_background=True)`` copies the shards to pinned host buffers from a thread, on the stream
that was current at the call; the next optimizer step waits for the copies to be enqueued, so its
kernels run after them on that stream. Here the step runs right after the call, with a model large
enough that the copies take a while: the file must still hold the values of the call, and
``load_sharded`` must put them back into CUDA shards bit for bit. The call's time is printed (a
figure for docs/performance.md, not an assertion).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import fsdp2
from tests._harness import run_threaded

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

WIDTH, LAYERS = 2048, 8  # 8 x 16 MiB of weights, AdamW's moments twice that


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).cuda()
    for layer in model:
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
    return model


def _step(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    batch = torch.randn(16, WIDTH, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    model(batch).square().mean().backward()
    optim.step()
    optim.zero_grad()


def _full(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    flat: dict[str, torch.Tensor] = {}
    for key, value in state["model"].items():
        flat[key] = value.full_tensor().cpu() if hasattr(value, "full_tensor") else value.cpu()
    return flat


def _save_step_load(path: str) -> float:
    torch.cuda.set_device(0)
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, optim, dist.get_rank())
    saver = fsdp2.ShardedCheckpointer(staging_bytes=1 << 30)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    saved = _full(state)
    torch.cuda.synchronize()
    start = time.perf_counter()
    pending = saver.save_async(state, path, stage_in_background=True)
    call = time.perf_counter() - start
    _step(model, optim, 100 + dist.get_rank())  # changes every saved parameter in place, at once
    pending.wait()
    assert not torch.equal(_full({"model": get_model_state_dict(model)})["0.weight"], saved["0.weight"])
    fresh = _model()
    target = {"model": get_model_state_dict(fresh)}
    fsdp2.load_sharded(target, path)
    for key, value in _full(target).items():
        torch.testing.assert_close(value, saved[key], rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")
    return call


def test_cuda_background_staging_saves_the_values_of_the_call(tmp_path: Path) -> None:
    calls = run_threaded(2, _save_step_load, str(tmp_path / "ckpt"))
    print(f"save_async(stage_in_background=True) of 3 x 128 MiB per rank returned in {max(calls):.4f} s")
