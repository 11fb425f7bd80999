"""A tree-ordered reduction's Python work grows with ``log2`` of the ranks, not with the ranks.

- ``tree_sum`` is the pairwise tree (``tests/shared/ordered.py``'s ``pairwise_tree``, written
  separately) for 1 to 9 rows, bf16 and fp32, in any order, bit for bit, with one add per level,
  also when the first level of bf16 rows goes into a spent buffer (the packed one, in fsdp2);
- HSDP on 2 x 3 sums each replica's shard group by the tree, then the replicas by the tree (bit for
  bit against that sum of every rank's unsharded gradients; the shard group is no power of two, so
  the tree over all 6 ranks would differ);
- counted, not timed: the tensor adds (``aten.add`` / ``aten.add_``) one backward dispatches with
  ``set_deterministic_reduction()``, minus those of the same backward without gradient sync (no
  reduction at all; the threaded test backend sums a plain reduce-scatter on one rank's thread, so
  that is no baseline): one per tree level and group, ``ceil(log2 W) + ceil(log2 R)`` (summing every
  rank's row one after another took ``R * W - 1``). On 8 thread ranks (FSDP, and HSDP 2 x 4) and, in
  a fresh interpreter, as rank 1 of 4,096 simulated ranks (torch's fake process group: nothing is
  exchanged, only the work is counted) with HSDP 1,024 x 4, where the bytes each rank sends for the
  replicas are checked too: ``ceil(S / R)`` elements each way (one here: the shards are tiny).

Step times at such sizes: ``benchmarks/flat_costs.py``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fsdp2.group._ordered import tree_sum
from tests._harness import run_threaded
from tests._training import EXACT
from tests.shared.ordered import BF16, FP32, CountAdds, _batch, _model, _shard, pairwise_tree


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_the_tree_is_the_pairwise_tree_one_add_per_level(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    for count in range(1, 10):
        rows = (torch.randn(count, 33, generator=gen) * torch.logspace(-3, 3, 33)).to(dtype)
        order = tuple(torch.randperm(count, generator=gen).tolist())
        want = pairwise_tree([rows[i] for i in order])
        with CountAdds() as counter:
            got = tree_sum(rows.clone(), FP32, order)
        torch.testing.assert_close(got, want, **EXACT)
        assert counter.adds == math.ceil(math.log2(count)), count
        # bf16 rows: the first level may go into a spent buffer of the rows' size (even counts fit)
        scratch = torch.full_like(rows, float("nan"))
        got = tree_sum(rows.clone(), FP32, order, scratch=scratch)
        torch.testing.assert_close(got, want, **EXACT)
        in_scratch = got.untyped_storage().data_ptr() == scratch.untyped_storage().data_ptr()
        assert in_scratch == (dtype == BF16 and count > 1 and count % 2 == 0), (count, dtype)


def _two_level(shape: tuple[int, int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """First gradients on a ``(replicas, shards)`` mesh and the two-level tree sum of every rank's."""
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    model = _model()
    ref = copy.deepcopy(model)
    _shard(model, mesh).set_deterministic_reduction()
    model(_batch(0)).square().sum().backward()
    ref(_batch(0)).square().sum().backward()
    replicas, shards = shape
    pairs = []
    for param, grad in zip(model.parameters(), (p.grad for p in ref.parameters()), strict=True):
        every = [torch.empty_like(grad) for _ in range(replicas * shards)]
        dist.all_gather(every, grad)
        per_replica = [pairwise_tree(every[r * shards : (r + 1) * shards]) for r in range(replicas)]
        pairs.append((param.grad.full_tensor(), pairwise_tree(per_replica).div_(replicas * shards)))
    return pairs


def test_hsdp_sums_each_replica_by_the_tree_then_the_replicas() -> None:
    # 2 x 3: the shard group is no power of two, so this differs from the tree over all 6 ranks
    # ((g0 + g1) + g2) + ((g3 + g4) + g5) against ((g0 + g1) + (g2 + g3)) + (g4 + g5)
    for pairs in run_threaded(6, _two_level, (2, 3)):
        for got, want in pairs:
            torch.testing.assert_close(got, want, **EXACT)


def _adds(hsdp: bool, sync: bool) -> int:
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard")) if hsdp else None
    model = _shard(_model(), mesh)
    model.set_deterministic_reduction()
    model(_batch(0)).sum().backward()  # lazy init
    model.zero_grad()
    model.set_requires_gradient_sync(sync)
    loss = model(_batch(1)).sum()
    with CountAdds() as counter:
        loss.backward()
    return counter.adds


def _extra_adds(hsdp: bool) -> int:
    return _adds(hsdp, True) - _adds(hsdp, False)


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp-8", "hsdp-2x4"])
def test_each_group_adds_once_per_tree_level(hsdp: bool) -> None:
    levels = 2 + 1 if hsdp else 3  # log2(W = 4) + log2(R = 2), log2(W = 8)
    assert run_threaded(8, _extra_adds, hsdp) == [3 * levels] * 8  # 3 groups (the rank-order loop: 3 * 7)


_SIMULATED = """
import json, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
import fsdp2
from fsdp2.testing import record_collectives
from tests.shared.ordered import CountAdds, _model, _shard

dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4096)
mesh = init_device_mesh("cpu", (1024, 4), mesh_dim_names=("replicate", "shard"))
x = torch.randn(4, 6)
result = {}
for deterministic in (False, True):
    model = _shard(_model(), mesh)
    model.set_deterministic_reduction(deterministic)
    model(x).sum().backward()
    model.zero_grad()
    loss = model(x).sum()
    with CountAdds() as counter, record_collectives(model) as log:
        loss.backward()
    calls = [(c.kind, c.group_size, c.input_bytes, c.sent_bytes) for c in log.calls]
    result[deterministic] = [counter.adds, calls]
print(json.dumps(result))
"""


@pytest.mark.slow  # a fresh interpreter: about 10 s
def test_as_one_rank_of_4096_the_adds_and_bytes_stay_flat() -> None:
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-c", _SIMULATED], env=env, capture_output=True, text=True, timeout=240, cwd=root
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    (plain_adds, plain_calls), (adds, calls) = result["false"], result["true"]
    assert adds - plain_adds == 3 * (math.ceil(math.log2(4)) + math.ceil(math.log2(1024)))  # 36, not 3 * 4095
    all_reduces = [inp for kind, _, inp, _ in plain_calls if kind == "all_reduce"]
    replica_steps = [c for c in calls if c[1] == 1024]  # the replicate group's collectives
    assert len(all_reduces) == 3
    pairs = list(zip(replica_steps[::2], replica_steps[1::2], strict=True))
    for shard_bytes, (to_all, gather) in zip(all_reduces, pairs, strict=True):
        chunk_bytes = -(-shard_bytes // 4 // 1024) * 4  # ceil(S / R) fp32 elements: 1 here
        assert to_all == ["all_to_all", 1024, 1024 * chunk_bytes, 1023 * chunk_bytes]
        assert gather == ["all_gather", 1024, chunk_bytes, 1023 * chunk_bytes]
