"""torch.compile composition: FSDP hooks run eagerly, the compiled blocks give the same numbers.

The common pattern compiles each block after fully_shard; compiling the whole model works too (it
graph-breaks at each FSDP module). The ``aot_eager`` backend traces forward and backward through
dynamo and AOTAutograd without generating kernels, so it checks the composition in seconds.
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


def _train_compiled(where: str, reshard_after_forward: bool) -> None:
    model = broadcast_module_(_model())
    ref = copy.deepcopy(model)
    for block in model:
        fsdp2.fully_shard(block, reshard_after_forward=reshard_after_forward)
    fsdp2.fully_shard(model, reshard_after_forward=reshard_after_forward)
    if where == "blocks":
        for block in model:
            block.compile(backend="aot_eager")
    else:
        model.compile(backend="aot_eager")
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
@pytest.mark.parametrize("where", ["blocks", "whole"])
def test_compiled_training_matches_reference(where: str, reshard_after_forward: bool) -> None:
    torch._dynamo.reset()
    run_threaded(2, _train_compiled, where, reshard_after_forward)
