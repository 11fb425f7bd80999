"""``fsdp2/param/_dtensor.py`` against DTensor's public API.

``make_spec`` + ``wrap_local`` must build the same DTensor as ``DTensor.from_local(..., shape=,
stride=, run_check=False)``; ``set_local`` must re-point it at new storage. A mesh needs a process
group, so each case runs on a small threaded world.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from fsdp2.param._dtensor import local_of, make_spec, set_local, spec_of, wrap_local
from fsdp2.param._param import chunk_rows
from tests._harness import run_threaded


def _global(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)  # the same on every rank thread
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _rows(tensor: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    _, start, rows = chunk_rows(tensor.size(0), world_size, rank)
    return tensor[start : start + rows].clone()


def _assert_same_dtensor(actual: DTensor, expected: DTensor) -> None:
    assert type(actual) is type(expected) is DTensor
    assert actual.device_mesh is expected.device_mesh
    assert actual.placements == expected.placements
    assert actual.shape == expected.shape
    assert actual.stride() == expected.stride()
    assert actual.dtype == expected.dtype
    assert actual.requires_grad == expected.requires_grad
    assert spec_of(actual) == spec_of(expected)
    torch.testing.assert_close(actual.to_local(), expected.to_local(), rtol=0, atol=0)


def _check_wrap_matches_from_local(
    mesh: DeviceMesh, placements: tuple[Placement, ...], shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    full = _global(shape, dtype)
    shard_size, shard_rank = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
    local = _rows(full, shard_size, shard_rank)
    spec = make_spec(mesh, placements, full.size(), full.stride(), dtype)
    wrapped = wrap_local(local, spec)
    expected = DTensor.from_local(
        local, mesh, placements, shape=full.size(), stride=full.stride(), run_check=False
    )
    _assert_same_dtensor(wrapped, expected)
    assert local_of(wrapped) is local, "wrap_local must not copy"
    assert wrapped.grad_fn is None
    assert wrapped.is_leaf
    torch.testing.assert_close(wrapped.full_tensor(), full, rtol=0, atol=0)
    torch.testing.assert_close(expected.full_tensor(), full, rtol=0, atol=0)


CASES = [
    pytest.param((5, 3), torch.float32, id="uneven-5x3-fp32"),
    pytest.param((1, 4), torch.float32, id="empty-rank-1x4"),  # rank 1 holds a (0, 4) shard
    pytest.param((6,), torch.bfloat16, id="1d-bf16"),
    pytest.param((4, 2, 3), torch.float64, id="3d-fp64"),
]


@pytest.mark.parametrize(("shape", "dtype"), CASES)
def test_wrap_local_matches_from_local(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    def body() -> None:
        mesh = init_device_mesh("cpu", (2,))
        _check_wrap_matches_from_local(mesh, (Shard(0),), shape, dtype)

    run_threaded(2, body)


def test_wrap_local_matches_from_local_hsdp() -> None:
    def body() -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        _check_wrap_matches_from_local(mesh, (Replicate(), Shard(0)), (5, 3), torch.float32)

    run_threaded(4, body)


def test_wrap_local_requires_grad() -> None:
    def body() -> None:
        mesh = init_device_mesh("cpu", (2,))
        full = _global((3, 2), torch.float32)
        local = _rows(full, 2, dist.get_rank())
        spec = make_spec(mesh, (Shard(0),), full.size(), full.stride(), full.dtype)
        wrapped = wrap_local(local, spec, requires_grad=True)
        assert wrapped.requires_grad
        assert wrapped.is_leaf
        assert wrapped.grad_fn is None
        expected = (
            DTensor.from_local(
                local, mesh, (Shard(0),), shape=full.size(), stride=full.stride(), run_check=False
            )
            .detach()
            .requires_grad_(True)
        )
        _assert_same_dtensor(wrapped, expected)

    run_threaded(2, body)


def test_set_local_repoints_storage() -> None:
    def body() -> None:
        mesh = init_device_mesh("cpu", (2,))
        rank = dist.get_rank()
        full = _global((5, 3), torch.float32)
        spec = make_spec(mesh, (Shard(0),), full.size(), full.stride(), full.dtype)
        wrapped = wrap_local(_rows(full, 2, rank), spec)
        replacement_full = full * -2
        storage = torch.zeros(9)  # padded to chunk 0: 3 rows of 3
        new_local = storage[: _rows(full, 2, rank).numel()].view(-1, 3)
        new_local.copy_(_rows(replacement_full, 2, rank))
        set_local(wrapped, new_local)
        assert local_of(wrapped) is new_local
        assert wrapped.to_local().untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()
        torch.testing.assert_close(wrapped.full_tensor(), replacement_full, rtol=0, atol=0)
        # Writes through the new storage are visible in the DTensor, and the spec is untouched.
        storage.zero_()
        torch.testing.assert_close(wrapped.full_tensor(), torch.zeros(5, 3), rtol=0, atol=0)
        assert spec_of(wrapped) is spec

    run_threaded(2, body)


def _state_dict_deepcopy(rank: int) -> None:
    import copy

    from torch import nn

    import fsdp2

    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    fsdp2.fully_shard(model[0])
    fsdp2.fully_shard(model)
    model(torch.randn(2, 4)).sum().backward()
    saved = model.state_dict()
    # Every parameter after a group's first sits at an offset in the group's packed shards.
    assert any(local_of(v).storage_offset() > 0 for v in saved.values())
    copied = copy.deepcopy(saved)  # torch 2.13's own deepcopy of such a DTensor fails
    for key, value in saved.items():
        torch.testing.assert_close(copied[key].full_tensor(), value.full_tensor(), rtol=0, atol=0)
        assert copied[key].placements == value.placements
        assert (
            local_of(copied[key]).untyped_storage().data_ptr() != local_of(value).untyped_storage().data_ptr()
        )
    with torch.no_grad():
        for value in saved.values():
            value.zero_()  # the copy is independent
    assert all(v.full_tensor().abs().sum() > 0 for v in copied.values())
    params = copy.deepcopy(list(model.parameters()))  # parameters: still parameters, gradients copied
    for param, original in zip(params, model.parameters(), strict=True):
        assert isinstance(param, nn.Parameter)
        assert param.requires_grad
        torch.testing.assert_close(param.grad.full_tensor(), original.grad.full_tensor(), rtol=0, atol=0)


def test_deepcopy_of_a_sharded_state_dict() -> None:
    run_threaded(2, lambda: _state_dict_deepcopy(dist.get_rank()))
