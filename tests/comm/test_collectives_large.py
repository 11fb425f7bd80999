"""fsdp2's all-gather and reduce-scatter at world size 32 (threads as ranks), uneven parameters.

The parameter sizes mirror torch's collective-op test: the 17-row ones have fewer rows than ranks,
so 15 of the 32 ranks hold an empty shard, padded to the others' one row. (torch's test runs 128
ranks; 32 shows the same cases: empty and padded shards, an int ``reshard_after_forward`` (8) on a
(4, 8) mesh, fp16 divided before and after the sum (by 8 and 4), with a quarter of the threads and
an eighth of the time.) Each check compares against an independent reference: the original tensors
for all-gathers, and an all-reduce of the full gradients, cut with ``torch.chunk``, for
reduce-scatters.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp2.base._api import MixedPrecisionPolicy, OffloadPolicy
from fsdp2.base._config import GroupConfig, ParamSpec
from fsdp2.base._lifecycle import ShardedState, TrainingState
from fsdp2.base._mesh import MeshInfo, post_forward_mesh_info
from fsdp2.comm._collectives import (
    divide_factors,
    foreach_all_gather,
    foreach_all_gather_copy_out,
    reduce_scatter,
    reduce_scatter_copy_in,
    view_out_shards,
)
from fsdp2.group._param_group import FSDPParamGroup, build_group
from fsdp2.param._dtensor import local_of
from fsdp2.param._param import chunk_rows
from fsdp2.testing import CollectiveLog
from fsdp2.testing._recording import Recording
from tests._harness import run_threaded

WORLD_SIZE = 32
PARAM_SIZES = [(17, 257), (17,), (64, 312), (64,), (64, 64), (512, 64), (256,), (64, 297)]
EXACT = {"rtol": 0.0, "atol": 0.0}

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]  # 32 rank threads


def _originals() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(42)  # identical on every rank thread
    return [torch.randn(size, generator=gen) for size in PARAM_SIZES]


def _chunk(tensor: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """``torch.chunk(tensor, world_size)[rank]``, or the empty dim-0 slice past the last chunk."""
    chunks = torch.chunk(tensor, world_size)
    return chunks[rank] if rank < len(chunks) else tensor[:0]


def _build_group(
    originals: list[torch.Tensor], reshard_after_forward: bool | int, mp_policy: MixedPrecisionPolicy
) -> tuple[nn.ParameterList, FSDPParamGroup]:
    module = nn.ParameterList([nn.Parameter(t.clone()) for t in originals])
    mesh_info = MeshInfo.from_mesh(init_device_mesh("cpu", (WORLD_SIZE,)))
    params = list(module.parameters())
    owners = {id(p): [(module, str(i))] for i, p in enumerate(params)}
    post_info = post_forward_mesh_info(reshard_after_forward, mesh_info)
    specs = [ParamSpec(p, tuple(owners[id(p)])) for p in params]
    config = GroupConfig(mesh_info, mp_policy, OffloadPolicy(), torch.device("cpu"))
    group = build_group(specs, (module,), config, post_info)
    group.lazy_init()
    return module, group


def _registered(module: nn.ParameterList) -> list[torch.Tensor]:
    return [module._parameters[str(i)] for i in range(len(module))]


def _assert_unsharded(module: nn.ParameterList, originals: list[torch.Tensor]) -> None:
    for i, (param, orig) in enumerate(zip(_registered(module), originals, strict=True)):
        assert type(param) is nn.Parameter, f"param {i}: {type(param).__name__}"
        torch.testing.assert_close(param, orig, **EXACT, msg=lambda m, i=i: f"param {i}: {m}")


# ---- all-gather ------------------------------------------------------------------------------------


def _all_gather_group(reshard_after_forward: bool | int) -> None:
    rank = dist.get_rank()
    originals = _originals()
    module, group = _build_group(originals, reshard_after_forward, MixedPrecisionPolicy())
    for param, orig in zip(_registered(module), originals, strict=True):
        assert isinstance(param, DTensor)
        assert param.placements == (Shard(0),)
        torch.testing.assert_close(local_of(param), _chunk(orig, WORLD_SIZE, rank), **EXACT)
        torch.testing.assert_close(param.full_tensor(), orig, **EXACT)

    group.unshard()
    group.wait_for_unshard()
    _assert_unsharded(module, originals)

    # Reshard as a post-forward does; an int k keeps a 1/k slice on a (W/k, k) mesh for backward.
    group.training_state = TrainingState.FORWARD
    group.reshard()
    if isinstance(reshard_after_forward, bool):
        assert group.sharded_state is ShardedState.SHARDED
    else:
        k = reshard_after_forward
        assert group.sharded_state is ShardedState.SHARDED_POST_FORWARD
        per_rank_ranks = WORLD_SIZE // k  # original ranks whose padded shards one post-forward rank keeps
        for param, orig, fsdp_param in zip(_registered(module), originals, group.fsdp_params, strict=True):
            # A placeholder whose local shape follows a k-way torch.chunk (as torch 2.13's is); for
            # uneven sizes its values do not describe the slice. The slice itself is 1/k of the padded
            # layout.
            assert isinstance(param, DTensor)
            assert param.placements == (Replicate(), Shard(0))
            assert param.device_mesh.shape == (WORLD_SIZE // k, k)
            assert local_of(param).shape == _chunk(orig, k, rank % k).shape
            first = (rank % k) * per_rank_ranks
            expected_slice = torch.cat(
                [_padded_shard(orig, WORLD_SIZE, r) for r in range(first, first + per_rank_ranks)]
            )
            torch.testing.assert_close(
                fsdp_param.all_gather_input(post_forward=True), expected_slice, **EXACT
            )
    group.training_state = TrainingState.PRE_BACKWARD
    # The group has no fully_shard state to record through: wrap its all-gather as the recorder does.
    counts = CollectiveLog()
    group.comms.all_gather = Recording(group.comms.all_gather, "all_gather", lambda: "", counts)
    group.unshard()
    group.wait_for_unshard()
    # The backward all-gather runs over the post-forward group: k ranks for an int, all of them for True.
    gather_size = WORLD_SIZE if isinstance(reshard_after_forward, bool) else reshard_after_forward
    assert [(c.kind, c.group_size) for c in counts.calls] == [("all_gather", gather_size)]
    _assert_unsharded(module, originals)

    group.training_state = TrainingState.IDLE
    group.reshard()
    for param, orig in zip(_registered(module), originals, strict=True):
        assert isinstance(param, DTensor)
        torch.testing.assert_close(local_of(param), _chunk(orig, WORLD_SIZE, rank), **EXACT)


@pytest.mark.parametrize("reshard_after_forward", [True, 8], ids=["True", "int8"])
def test_group_all_gather(reshard_after_forward: bool | int) -> None:
    run_threaded(WORLD_SIZE, _all_gather_group, reshard_after_forward)


def _padded_shard(tensor: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    padded_rows, _, _ = chunk_rows(tensor.size(0), world_size, rank)
    rows = _chunk(tensor, world_size, rank).reshape(-1)
    shard = torch.zeros(padded_rows * tensor[0].numel(), dtype=tensor.dtype)
    shard[: rows.numel()] = rows
    return shard


def _all_gather_free_functions() -> None:
    rank = dist.get_rank()
    pg = init_device_mesh("cpu", (WORLD_SIZE,)).get_group(0)
    originals = _originals()
    inputs = [_padded_shard(t, WORLD_SIZE, rank) for t in originals]
    for dtype, async_op in ((torch.float32, False), (torch.float32, True), (torch.bfloat16, False)):
        result = foreach_all_gather(inputs, pg, WORLD_SIZE, rank, dtype, async_op=async_op)
        assert (result.work is not None) == async_op
        if result.work is not None:
            result.work.wait()
        assert result.split_sizes == [t.numel() for t in inputs]
        outputs = [torch.empty(WORLD_SIZE * t.numel(), dtype=dtype) for t in inputs]
        foreach_all_gather_copy_out(result, outputs)
        for orig, output in zip(originals, outputs, strict=True):
            torch.testing.assert_close(output[: orig.numel()].view(orig.shape), orig.to(dtype), **EXACT)
            torch.testing.assert_close(
                output[orig.numel() :], torch.zeros_like(output[orig.numel() :]), **EXACT
            )


def test_foreach_all_gather_free_functions() -> None:
    run_threaded(WORLD_SIZE, _all_gather_free_functions)


# ---- reduce-scatter ----------------------------------------------------------------------------------


def _rank_grads(originals: list[torch.Tensor], kind: str, rank: int) -> list[torch.Tensor]:
    if kind == "rank":
        return [torch.ones_like(t) * rank for t in originals]
    gen = torch.Generator().manual_seed(1000 + rank)  # different on every rank
    return [torch.randn(t.shape, generator=gen) for t in originals]


def _reference_mean(grad: torch.Tensor, reduce_dtype: torch.dtype) -> torch.Tensor:
    """The mean over ranks by all-reduce, with the op and divisions ``divide_factors`` picks for
    ``reduce_dtype`` (docs/precision.md)."""
    factors = divide_factors(WORLD_SIZE, reduce_dtype)
    reduced = grad.to(reduce_dtype)
    if factors.predivide is not None:
        reduced.div_(factors.predivide)
    dist.all_reduce(reduced, op=factors.op)
    if factors.postdivide is not None:
        reduced.div_(factors.postdivide)
    return reduced.to(grad.dtype)


def _tolerance(reduce_dtype: torch.dtype) -> dict[str, float]:
    # fp32: the backend averages in another summation order than the all-reduce reference.
    # fp16: the reduce-scatter adds the 32 pre-divided rows one rank at a time in fp16, rounding each
    # partial sum, while the reference rounds one sum. Measured here: exact on the mean 15.5 of
    # ``ones * rank`` (every partial sum a multiple of 1/8 below 64), up to 2e-3 on random means. (At
    # 128 ranks: 0.25 on the mean 63.5, ulp 0.25 past 256; 1.5e-3 on random means.)
    return {"rtol": 1e-5, "atol": 1e-6} if reduce_dtype == torch.float32 else {"rtol": 1e-2, "atol": 5e-3}


def _reduce_scatter_free_functions(
    grads: list[torch.Tensor], reduce_dtype: torch.dtype, pg: dist.ProcessGroup
) -> list[torch.Tensor]:
    rank = dist.get_rank()
    factors = divide_factors(WORLD_SIZE, reduce_dtype)
    buffer = reduce_scatter_copy_in(grads, WORLD_SIZE, reduce_dtype)
    output = reduce_scatter(buffer, pg, WORLD_SIZE, factors.op, factors.predivide)
    if factors.postdivide is not None:
        output.div_(factors.postdivide)
    padded = [chunk_rows(g.size(0), WORLD_SIZE, rank)[0] * g[0].numel() for g in grads]
    sizes = [_chunk(g, WORLD_SIZE, rank).shape for g in grads]
    return view_out_shards(output, padded, sizes)


def _reduce_scatter(reduce_dtype: torch.dtype) -> None:
    rank = dist.get_rank()
    originals = _originals()
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    module, group = _build_group(originals, True, policy)
    pg = group.mesh_info.shard_group
    assert pg.size() == WORLD_SIZE
    tolerance = _tolerance(reduce_dtype)
    for kind in ("rank", "random"):
        grads = _rank_grads(originals, kind, rank)
        references = [_chunk(_reference_mean(g, reduce_dtype), WORLD_SIZE, rank) for g in grads]
        if kind == "rank":  # the exact mean over ranks is (W - 1) / 2 everywhere
            for ref in references:
                torch.testing.assert_close(ref, torch.full_like(ref, (WORLD_SIZE - 1) / 2), **EXACT)

        shards = _reduce_scatter_free_functions(grads, reduce_dtype, pg)
        for i, (shard, ref) in enumerate(zip(shards, references, strict=True)):
            assert shard.dtype == reduce_dtype
            label = f"{kind} {i}"
            torch.testing.assert_close(shard.float(), ref, **tolerance, msg=lambda m, n=label: f"{n}: {m}")

        # The same reduction through the group: post-backward assigns sharded DTensor gradients.
        group.unshard()
        group.wait_for_unshard()
        for fsdp_param, grad in zip(group.fsdp_params, grads, strict=True):
            fsdp_param.sharded_param.grad = None
            assert fsdp_param.unsharded_param is not None
            fsdp_param.unsharded_param.grad = grad.clone()
        taken = group.post_backward()  # takes the gradients; the group's own collective reduces them
        assert taken is not None
        group.reduce(*taken)
        group.training_state = TrainingState.IDLE
        for i, (fsdp_param, ref) in enumerate(zip(group.fsdp_params, references, strict=True)):
            sharded_grad = fsdp_param.sharded_param.grad
            assert isinstance(sharded_grad, DTensor)
            assert sharded_grad.placements == (Shard(0),)
            assert sharded_grad.shape == originals[i].shape
            assert sharded_grad.dtype == torch.float32
            label = f"group {kind} {i}"
            torch.testing.assert_close(
                local_of(sharded_grad), ref, **tolerance, msg=lambda m, n=label: f"{n}: {m}"
            )
    assert all(isinstance(p, DTensor) for p in _registered(module))


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_reduce_scatter(reduce_dtype: torch.dtype) -> None:
    run_threaded(WORLD_SIZE, _reduce_scatter, reduce_dtype)
