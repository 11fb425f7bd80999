"""torch.compile of each block: FSDP hooks run eagerly, the compiled blocks give the same numbers.

The common pattern compiles each block after fully_shard (the root's eager hooks prefetch across
blocks). The ``aot_eager`` backend traces forward and backward through dynamo and AOTAutograd without
generating kernels, so it checks the composition in seconds. Compiling the whole model takes the
compiled path (the collectives in the graph), which thread ranks cannot run (torch's threaded process
group has no functional reduce-scatter): ``tests/multiprocess/test_compile_gloo.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp2
from tests._harness import assert_sharded_parity, broadcast_module_, run_threaded
from tests._training import average_grads, forward_backward, step_all


def _model() -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)], nn.Linear(8, 3))


def _train_compiled(reshard_after_forward: bool) -> None:
    model = broadcast_module_(_model())
    ref = copy.deepcopy(model)
    for block in model:
        fsdp2.fully_shard(block, reshard_after_forward=reshard_after_forward)
    fsdp2.fully_shard(model, reshard_after_forward=reshard_after_forward)
    for block in model:
        block.compile(backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        x = torch.randn(4, 8, generator=gen)
        loss, ref_loss = forward_backward(x, model, ref)
        average_grads(ref)
        torch.testing.assert_close(loss, ref_loss)
        assert_sharded_parity(ref, model, grads=True)
        step_all(opt, ref_opt)
    assert_sharded_parity(ref, model)


@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["reshard", "keep"])
def test_compiled_blocks_match_reference(reshard_after_forward: bool) -> None:
    torch._dynamo.reset()
    run_threaded(2, _train_compiled, reshard_after_forward)
