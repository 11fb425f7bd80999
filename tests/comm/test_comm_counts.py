"""Collective counts per forward and per backward, threads as ranks, for fsdp2 and torch alike.

The expected counts are those torch 2.13's ``fully_shard`` issues (the ``impl`` fixture runs both).

CommDebugMode cannot be used here: its module tracker is process-global, and the threaded
process group never reaches the c10d op dispatch anyway. ``count_collectives`` counts at the
threaded backend instead (per rank thread). The same table runs over real gloo processes with
CommDebugMode in ``tests/comm/test_comm_counts_gloo.py``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._harness import broadcast_module_, count_collectives, run_threaded
from tests._impls import Impl, shard_blocks_then_root
from tests.models import ModelArgs, Transformer, make_tokens

N_BLOCKS = 2
W = 4

# (reshard_after_forward, manual reshard() after forward) -> (forward all-gathers,
# backward all-gathers, backward reduce-scatters), for 2 blocks plus the root, and the size of
# the process group the backward all-gathers run over.
H_TABLE = [
    pytest.param(None, False, (3, 2, 3), W, id="None"),  # the root keeps its parameters
    pytest.param(True, False, (3, 3, 3), W, id="True"),  # 2.13 honours True on the root (2.6: 2)
    pytest.param(2, False, (3, 3, 3), 2, id="2"),  # backward re-gathers from the 2-way slices
    pytest.param(False, False, (3, 0, 3), W, id="False"),
    pytest.param(False, True, (3, 3, 3), W, id="False-manual_reshard"),
]


def _count_one_step(
    impl: Impl, raf: bool | int | None, manual_reshard: bool
) -> tuple[Counter[Any], Counter[Any]]:
    args = ModelArgs(n_layers=N_BLOCKS)
    torch.manual_seed(0)
    model = broadcast_module_(Transformer(args))
    shard_blocks_then_root(impl, model, model.layers, reshard_after_forward=raf)
    tokens = make_tokens(args, dist.get_rank())
    with count_collectives(by_group_size=True) as forward_counts:
        loss = model(tokens).sum()
    if manual_reshard:
        for module in model.modules():
            if isinstance(module, impl.FSDPModule):
                module.reshard()
    with count_collectives(by_group_size=True) as backward_counts:
        loss.backward()
    return forward_counts, backward_counts


@pytest.mark.parametrize(("raf", "manual_reshard", "expected", "backward_gather_size"), H_TABLE)
def test_collective_counts(
    impl: Impl,
    raf: bool | int | None,
    manual_reshard: bool,
    expected: tuple[int, int, int],
    backward_gather_size: int,
) -> None:
    forward_all_gathers, backward_all_gathers, backward_reduce_scatters = expected
    want_fwd = Counter({("all_gather", W): forward_all_gathers})
    want_bwd = Counter(
        {
            ("all_gather", backward_gather_size): backward_all_gathers,
            ("reduce_scatter", W): backward_reduce_scatters,
        }
    )
    # fsdp2's first backward adds one small all-reduce: the agreement on which submodules ran on some
    # rank, so that conditional compute leaves unused parameters out from the first step on
    # (docs/differences.md); torch issues none.
    want_bwd[("all_reduce", W)] = 1 if impl.name == "fsdp2" else 0
    for rank, (fwd, bwd) in enumerate(run_threaded(W, _count_one_step, impl, raf, manual_reshard)):
        assert fwd == want_fwd, f"rank {rank} forward"
        assert +bwd == +want_bwd, f"rank {rank} backward"


def test_counter_sees_threaded_collectives() -> None:
    """The counter itself: one count per collective, per calling thread only."""

    def body() -> Counter[str]:
        out, inp = torch.empty(8), torch.ones(2)
        dist.all_reduce(inp)  # not counted: outside the context
        with count_collectives() as counts:
            dist.all_gather_single(out, inp)
            dist.all_gather_single(out, inp)
            dist.reduce_scatter_single(inp, out)
        return counts

    assert run_threaded(4, body) == [Counter(all_gather=2, reduce_scatter=1)] * 4
