"""Gradient divide factors: the reduce op and the divisions around it (torch 2.13's but for fp64)."""

from __future__ import annotations

import pytest
import torch

from fsdp2.comm._collectives import DivideFactors, ReduceOp, divide_factors

# fp64 averages safely too; fsdp2 uses AVG for it where torch 2.13 uses SUM with a split divisor
# (same mean up to rounding, one fewer pass over the buffer; see docs/differences.md).
AVG_DTYPES = [torch.float32, torch.bfloat16, torch.float64]

FP16_TABLE = [
    pytest.param(2, 2.0, None, id="2"),
    pytest.param(3, 2.0, 1.5, id="3"),
    pytest.param(4, 2.0, 2.0, id="4"),
    pytest.param(6, 4.0, 1.5, id="6"),  # the pre-factor need not divide the world size
    pytest.param(8, 4.0, 2.0, id="8"),
    pytest.param(16, 4.0, 4.0, id="16"),
    pytest.param(32, 8.0, 4.0, id="32"),
    pytest.param(128, 16.0, 8.0, id="128"),
]


@pytest.mark.parametrize("dtype", AVG_DTYPES, ids=str)
@pytest.mark.parametrize("world_size", [2, 3, 8, 128])
def test_avg_safe_dtypes_use_avg_without_factors(dtype: torch.dtype, world_size: int) -> None:
    assert divide_factors(world_size, dtype) == DivideFactors(ReduceOp.AVG, None, None)


@pytest.mark.parametrize("dtype", [*AVG_DTYPES, torch.float16, torch.float64], ids=str)
def test_single_rank_sums_without_division(dtype: torch.dtype) -> None:
    assert divide_factors(1, dtype) == DivideFactors(ReduceOp.SUM, None, None)


@pytest.mark.parametrize(("world_size", "pre", "post"), FP16_TABLE)
def test_fp16_splits_the_division(world_size: int, pre: float, post: float | None) -> None:
    factors = divide_factors(world_size, torch.float16)
    assert factors == DivideFactors(ReduceOp.SUM, pre, post)
    assert pre * (post or 1.0) == world_size


@pytest.mark.parametrize("world_size", range(2, 65))
def test_fp16_factors_follow_the_doubling_rule(world_size: int) -> None:
    # Reference rule: double the pre-factor while it divides N and N / pre > pre.
    pre = 1
    while world_size % pre == 0 and world_size / pre > pre:
        pre *= 2
    factors = divide_factors(world_size, torch.float16)
    assert factors.op == ReduceOp.SUM
    assert (factors.predivide or 1.0) == pre
    assert (factors.postdivide or 1.0) == world_size / pre


def test_fp16_mean_of_large_gradients_does_not_overflow() -> None:
    # 16 ranks of 10000: a plain fp16 sum (160000) overflows the fp16 max of 65504, the split one does not.
    world_size = 16
    factors = divide_factors(world_size, torch.float16)
    assert factors.predivide is not None
    assert factors.postdivide is not None
    grads = [torch.full((3,), 10000.0, dtype=torch.float16) for _ in range(world_size)]
    total = torch.zeros(3, dtype=torch.float16)
    for grad in grads:
        total += grad / factors.predivide
    total /= factors.postdivide
    torch.testing.assert_close(total, torch.full((3,), 10000.0, dtype=torch.float16))
    plain = torch.zeros(3, dtype=torch.float16)
    for grad in grads:
        plain += grad
    assert torch.isinf(plain).all(), "without the pre-divide the fp16 sum overflows"


class _GroupOfSize:
    """Stands in for a process group: torch's factor computation only asks for ``size()``."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_factors_agree_with_torch_fully_shard(dtype: torch.dtype) -> None:
    # Differential oracle: torch 2.13's own choice for a reduce-scatter group of N ranks (no HSDP, no
    # custom factor, no force-sum). A factor of None and a factor of 1 both mean "no division".
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    for world_size in range(1, 65):
        pre, post, op, _ = _get_gradient_divide_factors(_GroupOfSize(world_size), None, dtype)  # type: ignore[arg-type]
        ours = divide_factors(world_size, dtype)
        assert (ours.op, ours.predivide or 1.0, ours.postdivide or 1.0) == (op, pre or 1.0, post or 1.0), (
            f"world size {world_size}"
        )
