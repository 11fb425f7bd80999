"""fsdp2's storage tracker (behind estimate_memory / measure_memory) against torch's own MemTracker."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from fsdp2.plan._memory import MemoryTracker, process_hooks, tracking


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 384), nn.GELU(), nn.Linear(384, 96))
    return model, torch.optim.AdamW(model.parameters())


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_peak_equals_torch_mem_tracker() -> None:
    model, optimizer = _model_and_optimizer()
    x = torch.randn(32, 96)
    _step(model, optimizer, x)  # optimizer states exist before measuring

    reference = MemTracker()
    reference.track_external(model, optimizer, x)
    with reference:
        _step(model, optimizer, x)
    want = reference.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    tracker = MemoryTracker()
    with process_hooks(), tracking(tracker):
        for tensor in [*model.parameters(), x, *(v for s in optimizer.state.values() for v in s.values())]:
            tracker.track(tensor)
        _step(model, optimizer, x)
    got = max(snapshot.total for snapshot in tracker.snapshots.values())
    assert got == want


def test_storage_resizes_and_frees_are_counted() -> None:
    tracker = MemoryTracker()
    with process_hooks(), tracking(tracker):
        a = torch.empty(1000)  # 4000 B
        b = a[10:]  # a view: same storage, counted once
        assert tracker.total == 4000
        a.untyped_storage().resize_(0)  # how fsdp2 frees unsharded parameters
        assert tracker.total == 0
        a.untyped_storage().resize_(800)
        assert tracker.total == 800
        c = torch.zeros(50, dtype=torch.float64)
        assert tracker.total == 1200
        del a, b
        assert tracker.total == 400
        del c
        assert tracker.total == 0
    peak = max(snapshot.total for snapshot in tracker.snapshots.values())
    assert peak == 4000
