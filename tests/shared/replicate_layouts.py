"""torchtitan-style ``replicate`` layouts trained three ways in lockstep: fsdp2, torch, the unsharded model.

Used by the threaded tests of ``fsdp2.replicate`` (tests/frontend/test_replicate.py) and by the
spawned gloo world of tests/end_to_end/test_pipelining_replicate_gloo.py (torchtitan's DDP pattern
across processes).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2.testing import count_collectives
from tests._training import average_grads, seeded
from tests.models import ModelArgs, Transformer, make_tokens

ARGS = ModelArgs(n_layers=2)
STEPS = 3


def per_block(replicate: Any, fully_shard: Any, model: nn.Module, **kwargs: Any) -> None:
    for block in model.layers:
        replicate(block, **kwargs)
    replicate(model, **kwargs)


def mixed(replicate: Any, fully_shard: Any, model: nn.Module, **kwargs: Any) -> None:
    """Replicated embeddings, sharded blocks, a sharded root (torch's own tests mix them so)."""
    replicate([model.tok_embeddings, model.pos_embeddings], **kwargs)
    for block in model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def torchtitan(replicate: Any, fully_shard: Any, model: nn.Module, **kwargs: Any) -> None:
    """torchtitan's DDP pattern before 0.3.0: embeddings, each block, ``[norm, output]`` (one group), root."""
    replicate(model.tok_embeddings, **kwargs)
    for block in model.layers:
        replicate(block, **kwargs)
    replicate([model.norm, model.output], **kwargs)
    replicate(model, **kwargs)


LAYOUTS = {"per_block": per_block, "mixed": mixed, "torchtitan": torchtitan}
# all-reduces of each backward after the first (the mixed layout also shards 3 groups)
ALL_REDUCES = {"per_block": 3, "mixed": 1, "torchtitan": 5}


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def assert_same(model: nn.Module, other: nn.Module, grads: bool, exact: bool = True) -> None:
    tolerance = {"rtol": 0.0, "atol": 0.0} if exact else {"rtol": 1e-5, "atol": 1e-6}
    for (name, p), q in zip(model.named_parameters(), other.parameters(), strict=True):
        a, b = (p.grad, q.grad) if grads else (p, q)
        torch.testing.assert_close(full(a), full(b), **tolerance, msg=lambda m, n=name: f"{n}: {m}")


def train_three(layout: str, bf16: bool, args: ModelArgs = ARGS, *, threads: bool = True) -> None:
    """fsdp2, torch and the unsharded reference in lockstep; the collectives of each fsdp2 backward.

    ``threads``: ranks are threads, whose all-reduces add in rank order whatever the layout, so the
    reference (its gradients averaged one tensor at a time) is met bit for bit. Across gloo processes
    with 3 or more ranks, the ring's order follows each element's place in the buffer: torch's is met
    bit for bit, the reference within float32 rounding, and the usage row may take an all-reduce of
    its own (``comm.all_reduce_before_tail``), so the collectives are not counted.
    """
    base = seeded(lambda: Transformer(args))
    ours, theirs, ref = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    dtype = {"param_dtype": torch.bfloat16} if bf16 else {}
    LAYOUTS[layout](fsdp2.replicate, fsdp2.fully_shard, ours, mp_policy=fsdp2.MixedPrecisionPolicy(**dtype))
    LAYOUTS[layout](torch_replicate, torch_fully_shard, theirs, mp_policy=TorchMixedPrecisionPolicy(**dtype))
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert p.placements == q.placements, name
        assert p.device_mesh.mesh_dim_names == q.device_mesh.mesh_dim_names, name
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs, ref)]
    for step in range(STEPS):
        tokens = make_tokens(ARGS, dist.get_rank() + 10 * step)
        with count_collectives() as counts:
            loss = ours(tokens).sum()
            loss.backward()
        their_loss = theirs(tokens).sum()
        their_loss.backward()
        ref_loss = ref(tokens).sum()
        ref_loss.backward()
        average_grads(ref)
        assert torch.equal(loss, their_loss), (step, loss, their_loss)
        assert_same(ours, theirs, grads=True)
        if not bf16:
            assert torch.equal(loss, ref_loss) or not threads, (step, loss, ref_loss)
            assert_same(ours, ref, grads=True, exact=threads)
        if step > 0 and threads:  # the first backward also agrees on which parameters are used
            expected = {"all_reduce": ALL_REDUCES[layout]}
            if layout == "mixed":
                expected.update(all_gather=5, reduce_scatter=3)  # the blocks regather in backward
            assert dict(counts) == expected, dict(counts)
        for optim in optims:
            optim.step()
            optim.zero_grad()
    assert_same(ours, theirs, grads=False)
    if not bf16:
        assert_same(ours, ref, grads=False, exact=threads)
