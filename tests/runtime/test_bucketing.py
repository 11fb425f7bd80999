"""``FSDPModule.set_bucket_cap_mb``: several small groups share one collective, threads as ranks.

- parity: a model of many small ``fully_shard`` blocks trained with AdamW, bucketed and unbucketed in
  the same rank thread from the same initial weights: losses, gradients and parameters are exactly
  equal (reshard_after_forward True/False, bf16 params with fp32 reduce, no-sync accumulation, dims
  not divisible by the world size, random caps and dims); the unbucketed run is also close to an
  unsharded reference with rank-averaged gradients;
- collective counts per step: with a cap that holds everything, one all-gather per pass and one
  reduce-scatter per step; with a small cap, the counts of a greedy split computed here from the
  shapes;
- events: a bucketed step records the same unshard / reshard / post_backward events per group as an
  unbucketed one;
- errors: bad caps and calls on non-root modules raise before changing anything.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import fsdp2
from tests._harness import broadcast_module_, run_threaded
from tests._training import EXACT, average_grads
from tests.shared.bucketing import Block, Blocks, _caps, _input, _shard, _train

MIB = 1024 * 1024
ALL = 25.0  # MiB: every group of the test models fits


def _parity_body(
    dims: list[int],
    raf: bool,
    caps: tuple[float | None, float | None],
    steps: int = 3,
    micro_steps: int = 1,
    mixed: bool = False,
    reference: bool = False,
) -> None:
    torch.manual_seed(0)
    base = broadcast_module_(Blocks(dims))
    mp = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
    plain, bucketed = copy.deepcopy(base), copy.deepcopy(base)
    _shard(plain, raf, mp)
    _shard(bucketed, raf, mp)
    bucketed.set_bucket_cap_mb(*caps)
    want = _train(plain, dims[0], steps, micro_steps)
    got = _train(bucketed, dims[0], steps, micro_steps)
    for name, w, g in zip(("loss", "grad", "param"), want, got, strict=True):
        assert len(w) == len(g)
        for i, (a, b) in enumerate(zip(w, g, strict=True)):
            torch.testing.assert_close(b, a, **EXACT, msg=lambda m, n=name, i=i: f"{n} {i}: {m}")
    if reference:
        _check_reference(base, plain, dims[0], steps, micro_steps, want)


def _check_reference(
    base: Blocks,
    sharded: Blocks,
    dim: int,
    steps: int,
    micro_steps: int,
    want: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]],
) -> None:
    """An unsharded copy with rank-averaged gradients follows the same trajectory (fp32 only)."""
    ref = copy.deepcopy(base)
    rank = dist.get_rank()
    optim = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(steps):
        for micro in range(micro_steps):
            ref(_input(dim, rank, step, micro)).sum().backward()
        average_grads(ref)
        if step == 0:
            for g, p in zip(want[1], ref.parameters(), strict=True):
                assert p.grad is not None
                torch.testing.assert_close(g, p.grad)
        optim.step()
        optim.zero_grad()
    for w, p in zip(want[2], ref.parameters(), strict=True):
        torch.testing.assert_close(w, p.detach(), rtol=1e-5, atol=1e-5)


DIMS_EVEN = [32] * 13  # 12 blocks of dim 32
DIMS_UNEVEN = [16, 19, 23, 17, 31, 21, 18, 29, 22, 25]  # no dim divisible by 4 or 3 beyond chance


# Even dims at world 2: the world changes no layout here. Bucketing at 4 ranks (and 3) runs below:
# uneven shapes, mixed precision, accumulation, collective counts, HSDP, the random caps and dims.
@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("world", [2])
@pytest.mark.parametrize("raf", [True, False])
@pytest.mark.parametrize("caps", [(ALL, ALL), (0.01, 0.02), (ALL, None), (None, 0.01)], ids=str)
def test_parity_exact(world: int, raf: bool, caps: tuple[float | None, float | None]) -> None:
    run_threaded(world, _parity_body, DIMS_EVEN, raf, caps, 3, 1, False, world == 2 and caps == (ALL, ALL))


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("world", [2, 4])
def test_parity_uneven_shapes(world: int) -> None:
    run_threaded(world, _parity_body, DIMS_UNEVEN, True, (0.003, 0.004), 3, 1, False, True)


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("raf", [True, False])
def test_parity_mixed_precision(raf: bool) -> None:
    run_threaded(4, _parity_body, DIMS_UNEVEN, raf, (ALL, 0.002), 3, 1, True)


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("raf", [True, False])
def test_parity_gradient_accumulation(raf: bool) -> None:
    run_threaded(2, _parity_body, DIMS_UNEVEN, raf, (ALL, ALL), 2, 3, False, True)
    run_threaded(4, _parity_body, DIMS_EVEN, raf, (0.01, 0.01), 2, 3, True)


@pytest.mark.slow
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    world=st.integers(2, 4),
    dims=st.lists(st.integers(3, 24), min_size=3, max_size=9),
    ag_kib=st.one_of(st.none(), st.floats(0.5, 8.0)),
    rs_kib=st.one_of(st.none(), st.floats(0.5, 8.0)),
    raf=st.booleans(),
)
def test_parity_random_caps_and_dims(
    world: int, dims: list[int], ag_kib: float | None, rs_kib: float | None, raf: bool
) -> None:
    caps = (None if ag_kib is None else ag_kib / 1024, None if rs_kib is None else rs_kib / 1024)
    run_threaded(world, _parity_body, dims, raf, caps, 2)


# ---- collective counts ---------------------------------------------------------------------------


def _group_bytes(module: nn.Module, world: int, itemsize: int = 4, usage_row: bool = False) -> int:
    """A group's collective bytes: W * its padded per-rank elements (computed from the shapes here).

    ``usage_row``: a reduce-scatter input, whose rows also carry one usage element per parameter (see
    fsdp2/group/_usage.py).
    """
    params = list(module.parameters(recurse=False) if not isinstance(module, Block) else module.parameters())
    total = len(params) if usage_row else 0
    for p in params:
        rows = p.shape[0]
        total += math.ceil(rows / world) * (p.numel() // rows)
    return world * total * itemsize


def _greedy(sizes: list[int], cap: int) -> int:
    """How many buckets a greedy split of ``sizes`` (in order) under ``cap`` makes."""
    buckets, total = 0, None
    for size in sizes:
        if total is None or total + size > cap:
            buckets, total = buckets + 1, 0
        total += size
    return buckets


def _root_bytes(model: Blocks, world: int, usage_row: bool = False) -> int:
    # The root's group holds both layers: one usage row for its four parameters.
    return sum(_group_bytes(m, world, usage_row=usage_row) for m in (model.inp, model.out))


def _counts_body(dims: list[int], raf: bool, cap_mb: float) -> list[Counter[str]]:
    torch.manual_seed(0)
    model = broadcast_module_(Blocks(dims))
    _shard(model, raf)
    model.set_bucket_cap_mb(cap_mb, cap_mb)
    counts: list[Counter[str]] = []
    _train(model, dims[0], 3, 1, counts)
    return counts


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("raf", [True, False])
@pytest.mark.parametrize("cap_mb", [ALL, 0.013, 0.03])
def test_collective_counts(raf: bool, cap_mb: float) -> None:
    world = 4
    model = Blocks(DIMS_EVEN)
    cap = int(cap_mb * MIB)
    blocks = [_group_bytes(b, world) for b in model.blocks]
    root = _root_bytes(model, world)
    forward = [root, *blocks]  # pre-forward order: the root first
    backward = list(reversed(forward)) if raf else []  # groups gathered again in backward
    # The root's post-backward runs at the end of backward
    post_backward = [*(_group_bytes(b, world, usage_row=True) for b in reversed(model.blocks))]
    post_backward.append(_root_bytes(model, world, usage_row=True))
    n_groups = len(forward)
    want_first = Counter(
        all_gather=n_groups + (_greedy(backward, cap) if backward else 0),
        reduce_scatter=_greedy(post_backward, cap),
    )
    want_steady = Counter(
        all_gather=_greedy(forward, cap) + (_greedy(backward, cap) if backward else 0),
        reduce_scatter=_greedy(post_backward, cap),
    )
    if cap_mb == ALL:
        assert want_steady == Counter(all_gather=2 if raf else 1, reduce_scatter=1)
    else:
        assert 1 < want_steady["all_gather"] < n_groups * (2 if raf else 1)
    for counts in run_threaded(world, _counts_body, DIMS_EVEN, raf, cap_mb):
        assert counts[0] == want_first, counts
        assert counts[1] == counts[2] == want_steady, counts


def test_no_caps_keeps_one_collective_per_group() -> None:
    def body() -> list[Counter[str]]:
        torch.manual_seed(0)
        model = broadcast_module_(Blocks(DIMS_EVEN))
        _shard(model, True)
        model.set_bucket_cap_mb(ALL, ALL)
        model.set_bucket_cap_mb()  # back to the default
        counts: list[Counter[str]] = []
        _train(model, DIMS_EVEN[0], 2, 1, counts)
        return counts

    n = len(DIMS_EVEN)  # blocks + root
    for counts in run_threaded(2, body):
        assert counts == [Counter(all_gather=2 * n, reduce_scatter=n)] * 2


# ---- events --------------------------------------------------------------------------------------


def _events_body(raf: bool) -> tuple[Counter[tuple[str, str, str]], Counter[tuple[str, str, str]]]:
    torch.manual_seed(0)
    base = broadcast_module_(Blocks(DIMS_UNEVEN))
    seen = []
    for caps in ((None, None), (ALL, ALL)):
        model = copy.deepcopy(base)
        _shard(model, raf)
        model.set_bucket_cap_mb(*caps)
        model(_input(DIMS_UNEVEN[0], 0, 0)).sum().backward()  # the first step records the order
        with fsdp2.record_events() as events:
            model(_input(DIMS_UNEVEN[0], 0, 1)).sum().backward()
        seen.append(Counter(e.as_tuple() for e in events))
    return seen[0], seen[1]


@pytest.mark.parametrize("raf", [True, False])
def test_events_of_every_group(raf: bool) -> None:
    for plain, bucketed in run_threaded(2, _events_body, raf):
        assert bucketed == plain
        names = {fqn for _, fqn, _ in bucketed}
        assert names == {"", *(f"blocks.{i}" for i in range(len(DIMS_UNEVEN) - 1))}
        for name in names:
            kinds = {kind for kind, fqn, _ in bucketed if fqn == name}
            assert kinds == {"unshard", "reshard", "post_backward"}, (name, kinds)


# ---- errors --------------------------------------------------------------------------------------


BAD_CAPS: list[tuple[Any, Any, str]] = [
    (-1, None, "all_gather"),
    (None, -0.5, "reduce_scatter"),
    (0, None, "positive"),
    ("25", None, "number of MiB"),
    (True, None, "number of MiB"),
    (None, float("nan"), "finite"),
    (None, [1], "number of MiB"),
]


def _errors_body() -> None:
    torch.manual_seed(0)
    model = broadcast_module_(Blocks([8, 8, 8]))
    _shard(model, True)
    model.set_bucket_cap_mb(1, 2)
    for ag, rs, words in BAD_CAPS:
        with pytest.raises(ValueError, match=words):
            model.set_bucket_cap_mb(ag, rs)
        assert _caps(model) == (MIB, 2 * MIB)  # unchanged
    model(_input(8, dist.get_rank(), 0)).sum().backward()
    child = model.blocks[0]
    assert isinstance(child, fsdp2.FSDPModule)
    with pytest.raises(RuntimeError, match="root"):
        child.set_bucket_cap_mb(ALL)
    assert _caps(model) == (MIB, 2 * MIB)
    # A cap set on a module that turns out not to be the root: refused at the first forward.
    other = broadcast_module_(Blocks([8, 8, 8]))
    _shard(other, True)
    other_child = other.blocks[1]
    assert isinstance(other_child, fsdp2.FSDPModule)
    other_child.set_bucket_cap_mb(ALL)
    with pytest.raises(RuntimeError, match="call set_bucket_cap_mb on the root"):
        other(_input(8, dist.get_rank(), 0))
    other_child.set_bucket_cap_mb(None, None)
    other.set_bucket_cap_mb(ALL, ALL)
    other(_input(8, dist.get_rank(), 0)).sum().backward()


def test_errors() -> None:
    run_threaded(2, _errors_body)


def test_cap_refused_mid_iteration() -> None:
    def body() -> None:
        torch.manual_seed(0)
        model = broadcast_module_(Blocks([8, 8, 8]))
        _shard(model, True)
        seen: list[BaseException] = []

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            try:
                model.set_bucket_cap_mb(ALL)
            except RuntimeError as error:
                seen.append(error)

        model.blocks[0].register_forward_hook(hook)
        model(_input(8, dist.get_rank(), 0)).sum().backward()
        assert len(seen) == 1
        assert "between training steps" in str(seen[0])
        assert _caps(model) == (None, None)

    run_threaded(2, body)


# ---- other settings ------------------------------------------------------------------------------


def _settings_body(
    configure: Callable[[Blocks], None],
    build: Callable[[], Blocks] = lambda: Blocks(DIMS_UNEVEN),
    shard: Callable[[Blocks], None] = lambda m: _shard(m, True),
) -> None:
    """Bucketed and unbucketed training of the same model, sharded by ``shard``: exactly equal."""
    torch.manual_seed(0)
    base = broadcast_module_(build())
    results = []
    for caps in ((None, None), (ALL, ALL)):
        model = copy.deepcopy(base)
        shard(model)
        configure(model)
        model.set_bucket_cap_mb(*caps)
        results.append(_train(model, model.inp.in_features, 3, 2))
        with torch.no_grad():  # an eval forward between steps: bucketed too, same output
            results[-1][0].append(model(_input(model.inp.in_features, dist.get_rank(), 99)))
    for want, got in zip(*results, strict=True):
        for a, b in zip(want, got, strict=True):
            torch.testing.assert_close(b, a, **EXACT)


def _no_reshard_after_backward(model: Blocks) -> None:
    model.set_reshard_after_backward(False)


def _explicit_prefetch(model: Blocks) -> None:
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        assert isinstance(block, fsdp2.FSDPModule)
        block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 2])  # type: ignore[arg-type]
        block.set_modules_to_backward_prefetch(blocks[max(i - 1, 0) : i][::-1])  # type: ignore[arg-type]


def _custom_divide_and_unused_params(model: Blocks) -> None:
    model.blocks[1].set_gradient_divide_factor(3.0)  # type: ignore[operator]
    model.set_reduce_scatter_unused_params(True)


def _one_block_keeps_its_params(model: Blocks) -> None:
    model.blocks[2].set_reshard_after_forward(False)  # type: ignore[operator]


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize(
    "configure",
    [
        _no_reshard_after_backward,
        _explicit_prefetch,
        _custom_divide_and_unused_params,
        _one_block_keeps_its_params,
    ],
)
def test_other_settings_still_exact(configure: Callable[[Blocks], None]) -> None:
    run_threaded(2, _settings_body, configure)


def test_cpu_offload_exact() -> None:
    def body() -> None:
        torch.manual_seed(0)
        base = broadcast_module_(Blocks(DIMS_UNEVEN))
        results = []
        for caps in ((None, None), (ALL, ALL)):
            model = copy.deepcopy(base)
            policy = fsdp2.CPUOffloadPolicy(pin_memory=False)
            for block in model.blocks:
                fsdp2.fully_shard(block, offload_policy=policy)
            fsdp2.fully_shard(model, offload_policy=policy)
            model.set_bucket_cap_mb(*caps)
            results.append(_train(model, DIMS_UNEVEN[0], 2, 1))
        for want, got in zip(*results, strict=True):
            for a, b in zip(want, got, strict=True):
                torch.testing.assert_close(b, a, **EXACT)

    run_threaded(2, body)


def _nothing(model: Blocks) -> None:
    pass


def _hsdp(model: Blocks) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)


def _checkpointed(model: Blocks) -> None:
    from torch.distributed._composable import checkpoint

    for block in model.blocks:
        checkpoint(block)
    _shard(model, True)


class Reused(Blocks):
    """Block 0 runs twice per forward: its state stands alone in the bucket plan."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](self.inp(x))
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class WithEmpty(Blocks):
    """A zero-element parameter on the root and an unused one in every block."""

    def __init__(self, dims: list[int]) -> None:
        super().__init__(dims)
        self.empty = nn.Parameter(torch.zeros(0, 3))
        for block in self.blocks:
            block.unused = nn.Parameter(torch.ones(5, 2))


def _shard_with_unused(model: Blocks) -> None:
    _shard(model, True)
    model.set_reduce_scatter_unused_params(True)


def _shard_dim1(model: Blocks) -> None:
    """``Shard(1)`` for the 2-D weights whose columns split evenly (staged copy-out, dim-0 regrouping)."""
    world = dist.get_world_size()

    def placement(param: nn.Parameter) -> Shard | None:
        return Shard(1) if param.ndim == 2 and param.size(1) % world == 0 else None

    for block in model.blocks:
        fsdp2.fully_shard(block, shard_placement_fn=placement)
    fsdp2.fully_shard(model, shard_placement_fn=placement)


def _shard_in_pairs(model: Blocks) -> None:
    """``fully_shard([block_i, block_i+1])``: one group for two modules."""
    blocks = list(model.blocks)
    for i in range(0, len(blocks) - 1, 2):
        fsdp2.fully_shard(blocks[i : i + 2], reshard_after_forward=True)
    fsdp2.fully_shard(model, reshard_after_forward=True)


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize(
    ("world", "build", "shard"),
    [
        pytest.param(4, lambda: Blocks(DIMS_UNEVEN), _hsdp, id="hsdp"),
        pytest.param(2, lambda: Blocks(DIMS_UNEVEN), _checkpointed, id="activation-checkpointing"),
        pytest.param(2, lambda: Reused([16] * 6), lambda m: _shard(m, True), id="module-reused"),
        pytest.param(4, lambda: WithEmpty(DIMS_UNEVEN), _shard_with_unused, id="empty-and-unused-params"),
        pytest.param(4, lambda: Blocks([16, 32, 20, 32, 24, 12]), _shard_dim1, id="shard-dim-1"),
        pytest.param(2, lambda: Blocks(DIMS_UNEVEN), _shard_in_pairs, id="grouped-modules"),
    ],
)
def test_other_layouts_still_exact(
    world: int, build: Callable[[], Blocks], shard: Callable[[Blocks], None]
) -> None:
    run_threaded(world, _settings_body, _nothing, build, shard)


def test_deepcopy_keeps_the_caps() -> None:
    def body() -> list[Counter[str]]:
        torch.manual_seed(0)
        model = broadcast_module_(Blocks(DIMS_EVEN))
        _shard(model, True)
        model.set_bucket_cap_mb(ALL, 0.01)
        _train(model, DIMS_EVEN[0], 1, 1)
        twin = copy.deepcopy(model)
        assert _caps(twin) == (int(ALL * MIB), int(0.01 * MIB))
        counts: list[Counter[str]] = []
        want = _train(model, DIMS_EVEN[0], 2, 1)
        got = _train(twin, DIMS_EVEN[0], 2, 1, counts)
        for w, g in zip(want, got, strict=True):
            for a, b in zip(w, g, strict=True):
                torch.testing.assert_close(b, a, **EXACT)
        return counts

    for counts in run_threaded(2, body):
        assert counts[1]["all_gather"] == 2


class _CountingAllGather(fsdp2.AllGather):
    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(tuple(size), dtype=dtype, device=device)

    def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, async_op: bool = False) -> Any:
        self.calls += 1
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class _CountingReduceScatter(fsdp2.ReduceScatter):
    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(tuple(size), dtype=dtype, device=device)

    def __call__(
        self, output_tensor: Any, input_tensor: Any, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        self.calls += 1
        return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def test_custom_collectives_stay_per_group() -> None:
    """A block with its own collectives splits the buckets around it and keeps its own calls."""

    def body() -> tuple[list[Counter[str]], int, int]:
        torch.manual_seed(0)
        base = broadcast_module_(Blocks(DIMS_EVEN))
        results = []
        gather, scatter = _CountingAllGather(), _CountingReduceScatter()
        counts: list[Counter[str]] = []
        for caps in ((None, None), (ALL, ALL)):
            model = copy.deepcopy(base)
            _shard(model, True)
            model.set_bucket_cap_mb(*caps)
            if caps[0] is not None:
                custom = model.blocks[3]
                assert isinstance(custom, fsdp2.FSDPModule)
                custom.set_custom_all_gather(gather)
                custom.set_custom_reduce_scatter(scatter)
            results.append(_train(model, DIMS_EVEN[0], 3, 1, counts if caps[0] is not None else None))
        for want, got in zip(*results, strict=True):
            for a, b in zip(want, got, strict=True):
                torch.testing.assert_close(b, a, **EXACT)
        return counts, gather.calls, scatter.calls

    for counts, gathers, scatters in run_threaded(2, body):
        assert (gathers, scatters) == (2 * 3, 3)  # its forward and backward all-gather, its reduce-scatter
        # [root, blocks 0-2] [block 3] [blocks 4-11] in forward, reversed in backward; same for gradients
        assert counts[1] == counts[2] == Counter(all_gather=6, reduce_scatter=3)
