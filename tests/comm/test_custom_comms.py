"""Custom collectives and the remaining communication setters, against the reference and torch.

- ``set_custom_all_gather`` / ``set_custom_reduce_scatter``: a recording implementation is called
  once per all-gather / reduce-scatter with buffers from its own ``allocate``; training equals the
  unsharded reference, and the calls match torch's ``fully_shard`` given the same objects;
- ``set_reduce_scatter_unused_params``: ranks that use different parameters still train like the
  reference (zero gradients join the reduction);
- ``set_separate_reduce_scatter_group``, ``set_allocate_memory_from_process_group_for_comm`` (gloo
  falls back to ordinary buffers) and ``set_reduce_scatter_max_input_buffers``: same numbers;
- the errors: bad objects, bad counts, custom plus allocator, symmetric memory without CUDA.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp2
from fsdp2.testing import record_collectives
from tests._harness import assert_sharded_parity, run_threaded
from tests._impls import get_impl
from tests._training import seeded, train_in_lockstep
from tests.models import MLP, make_input

DIM = 8


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLP(DIM) for _ in range(2))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _inputs(rank: int, step: int) -> torch.Tensor:
    return make_input((4, DIM), rank, seed=step)


class RecordingAllGather(fsdp2.AllGather):
    """Counts calls and checks every call writes into a buffer this object allocated."""

    def __init__(self) -> None:
        self.calls = 0
        self.allocations: list[torch.Tensor] = []

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buffer = torch.empty(tuple(size), dtype=dtype, device=device)
        self.allocations.append(buffer)
        return buffer

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
    ) -> Any:
        assert any(output_tensor.data_ptr() == b.data_ptr() for b in self.allocations), "foreign buffer"
        self.calls += 1
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class RecordingReduceScatter(fsdp2.ReduceScatter):
    def __init__(self) -> None:
        self.calls = 0
        self.groups: list[Any] = []
        self.allocations: list[torch.Tensor] = []

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buffer = torch.empty(tuple(size), dtype=dtype, device=device)
        self.allocations.append(buffer)
        return buffer

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        for tensor in (output_tensor, input_tensor):
            assert any(tensor.data_ptr() == b.data_ptr() for b in self.allocations), "foreign buffer"
        self.calls += 1
        self.groups.append(group)
        return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _shard(impl_name: str, model: _Stack) -> None:
    impl = get_impl(impl_name)
    for layer in model.layers:
        impl.fully_shard(layer)
    impl.fully_shard(model)


def _train_with_recording_comms(impl_name: str) -> tuple[list[int], list[int], list[float]]:
    ref = seeded(_Stack)
    model = copy.deepcopy(ref)
    _shard(impl_name, model)
    modules = [model.layers[0], model.layers[1], model]
    gathers = [RecordingAllGather() for _ in modules]
    reduces = [RecordingReduceScatter() for _ in modules]
    for module, gather, reduce in zip(modules, gathers, reduces, strict=True):
        module.set_custom_all_gather(gather)
        module.set_custom_reduce_scatter(reduce)
    losses = train_in_lockstep(model, ref, _inputs, 3, assert_sharded_parity)
    return [g.calls for g in gathers], [r.calls for r in reduces], losses


def test_custom_comms_are_called_once_per_collective_like_torch() -> None:
    # Each run checks its losses, gradients and parameters against its unsharded reference.
    gathers, reduces, _ = run_threaded(2, _train_with_recording_comms, "fsdp2")[0]
    torch_gathers, torch_reduces, _ = run_threaded(2, _train_with_recording_comms, "torch")[0]
    # 3 steps: each block gathers in forward and again in backward, the root (kept) once per step.
    assert gathers == torch_gathers == [6, 6, 3]
    assert reduces == torch_reduces == [3, 3, 3]


def _custom_comm_unused_at_world_one() -> None:
    model = seeded(_Stack)
    mesh = dist.device_mesh.init_device_mesh("cpu", (1,))
    fsdp2.fully_shard(model, mesh=mesh)
    gather, reduce = RecordingAllGather(), RecordingReduceScatter()
    model.set_custom_all_gather(gather)
    model.set_custom_reduce_scatter(reduce)
    model(_inputs(0, 0)).sum().backward()
    assert (gather.calls, len(gather.allocations), reduce.calls, len(reduce.allocations)) == (0, 0, 0, 0)


def test_custom_comms_not_used_for_a_single_rank() -> None:
    run_threaded(1, _custom_comm_unused_at_world_one)


# ---- unused parameters ------------------------------------------------------------------------


class _Branches(nn.Module):
    """Rank-dependent control flow: even ranks use ``a``, odd ranks ``b`` (both in one group).

    With ``masked`` (the reference) both branches run and the unused one is multiplied by zero, so
    its gradient is an exact zero instead of missing: what FSDP reduces with unused params on.
    """

    def __init__(self, masked: bool = False) -> None:
        super().__init__()
        self.trunk = nn.Linear(DIM, DIM)
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)
        self.masked = masked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        use_a = dist.get_rank() % 2 == 0
        if self.masked:
            return self.a(h) * float(use_a) + self.b(h) * float(not use_a)
        return self.a(h) if use_a else self.b(h)


def _train_unused(impl_name: str) -> list[float]:
    model = seeded(_Branches)
    ref = copy.deepcopy(model)
    ref.masked = True
    get_impl(impl_name).fully_shard(model)
    model.set_reduce_scatter_unused_params(True)
    return train_in_lockstep(model, ref, _inputs, 3, assert_sharded_parity)


@pytest.mark.parametrize("impl_name", ["fsdp2", "torch"])
def test_reduce_scatter_unused_params_trains_like_the_reference(impl_name: str) -> None:
    run_threaded(2, _train_unused, impl_name)


# ---- separate reduce-scatter group, process-group allocator, input-buffer cap ------------------


def _train_with_setting(setting: str) -> list[float]:
    ref = seeded(_Stack)
    model = copy.deepcopy(ref)
    _shard("fsdp2", model)
    reduce = None
    if setting == "separate_group":
        model.set_separate_reduce_scatter_group(True)
        reduce = RecordingReduceScatter()
        model.layers[0].set_custom_reduce_scatter(reduce)
    elif setting == "process_group_allocator":
        for module in (model.layers[0], model.layers[1], model):
            module.set_allocate_memory_from_process_group_for_comm(True)
    elif setting == "max_input_buffers":
        model.set_reduce_scatter_max_input_buffers(3)
    losses = train_in_lockstep(model, ref, _inputs, 3, assert_sharded_parity)
    if reduce is not None:
        shard_group = model.layers[0].in_proj.weight.device_mesh.get_group()
        assert reduce.calls == 3
        assert all(g is not shard_group for g in reduce.groups)
        assert len({id(g) for g in reduce.groups}) == 1
        assert dist.get_process_group_ranks(reduce.groups[0]) == [0, 1]
    return losses


@pytest.mark.parametrize("setting", ["separate_group", "process_group_allocator", "max_input_buffers"])
def test_comm_settings_keep_the_numbers(setting: str) -> None:
    run_threaded(2, _train_with_setting, setting)


# ---- errors ------------------------------------------------------------------------------------


def _errors() -> None:
    model = seeded(_Stack)
    _shard("fsdp2", model)
    with pytest.raises(TypeError, match=r"set_custom_all_gather expects an object with allocate"):
        model.set_custom_all_gather(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"subclass fsdp2.ReduceScatter"):
        model.set_custom_reduce_scatter(lambda *a: None)  # type: ignore[arg-type]
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match=r"max_input_buffers must be a positive int"):
            model.set_reduce_scatter_max_input_buffers(bad)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"needs CUDA tensors and NCCL"):
        model.set_symm_mem_for_comm()
    with pytest.raises(ValueError, match=r"backend='NCCL' only"):
        model.set_symm_mem_for_comm("GLOO")  # type: ignore[arg-type]
    model.set_custom_all_gather(RecordingAllGather())
    with pytest.raises(RuntimeError, match=r"cannot be combined with set_custom_all_gather"):
        model.set_allocate_memory_from_process_group_for_comm(True)
    # Nothing changed by the refused calls: training still works and counts are plain.
    with record_collectives(model) as counts:
        model(_inputs(dist.get_rank(), 0)).sum().backward()
    assert counts == Counter({"all_gather": 5, "reduce_scatter": 3})


def test_comm_setter_errors() -> None:
    run_threaded(2, _errors)
