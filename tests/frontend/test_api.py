"""``fully_shard`` / ``FSDPModule`` API behaviour on a threaded process group.

Covers the return value and the dynamic ``FSDP<Name>`` class, deepcopy (torch refuses), the sharded
parameters (DTensor, ``Shard(0)``, torch.chunk row split), what is registered on the module
after forward and after backward, the unsharded parameter's identity, the explicit
``unshard``/``reshard`` calls, the sharded gradients and grouped ``fully_shard([a, b])``.
Every check runs on each rank and compares against the unsharded original where numbers exist.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from tests._harness import assert_sharded_parity, broadcast_module_, count_collectives, run_threaded
from tests._impls import Impl
from tests._training import seeded
from tests.models import MLP, make_input

DIM = 6


def _assert_sharded_param(param: Any, *, mesh_ndim: int = 1) -> None:
    assert isinstance(param, nn.Parameter), type(param)
    assert isinstance(param, DTensor), type(param)
    assert param.device_mesh.ndim == mesh_ndim
    expected = (Shard(0),) if mesh_ndim == 1 else (Replicate(), Shard(0))
    assert tuple(param.placements) == expected, param.placements


def _assert_plain_param(param: Any) -> None:
    assert type(param) is nn.Parameter, type(param)


# ---------------------------------------------------------------------------------------------
# Return value and the dynamic class
# ---------------------------------------------------------------------------------------------


def _return_value_and_class(impl: Impl) -> None:
    model = seeded(lambda: nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), MLP(DIM)))
    first, second = model[0], model[1]
    assert impl.fully_shard(first) is first
    modules = [model[2].in_proj, model[2].out_proj]
    assert impl.fully_shard(modules) is modules
    assert impl.fully_shard(second) is second
    assert impl.fully_shard(model) is model

    for module, orig_cls in [(first, nn.Linear), (model, nn.Sequential), (model[2].in_proj, nn.Linear)]:
        cls = type(module)
        assert cls.__name__ == f"FSDP{orig_cls.__name__}"
        # fsdp2's mixin has torch's FSDPModule as its base (torch's code recognises fsdp2 modules).
        mixins = (impl.FSDPModule,) if impl.name == "torch" else (impl.FSDPModule, TorchFSDPModule)
        assert cls.__mro__[: len(mixins) + 2] == (cls, *mixins, orig_cls)
        assert isinstance(module, TorchFSDPModule)
        assert isinstance(module, impl.FSDPModule)
        assert isinstance(module, orig_cls)
    # One dynamic class per original class, shared by every wrapped instance of it.
    assert type(first) is type(second) is type(model[2].in_proj) is type(model[2].out_proj)
    assert type(model[2]) is MLP  # grouped roots are swapped, their parent is not


def test_returns_argument_and_swaps_class(impl: Impl) -> None:
    run_threaded(2, _return_value_and_class, impl)


def _deepcopy(impl: Impl) -> None:
    model = seeded(lambda: nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)))
    impl.fully_shard(model[0])
    x = torch.ones(2, DIM)
    for target in (model[0], model):  # the module itself, and a plain parent containing it
        if impl.name == "torch":  # torch 2.13 refuses
            with pytest.raises((AssertionError, RuntimeError)):
                copy.deepcopy(target)
            continue
        twin = copy.deepcopy(target)  # fsdp2: an independent sharded copy (tests/weights/test_deepcopy.py)
        torch.testing.assert_close(twin(x), target(x), rtol=0, atol=0)


def test_deepcopy(impl: Impl) -> None:
    run_threaded(2, _deepcopy, impl)


# ---------------------------------------------------------------------------------------------
# Sharded parameters
# ---------------------------------------------------------------------------------------------


def _sharded_rows(impl: Impl, rows: int, expected_rows: list[int]) -> None:
    rank = dist.get_rank()
    lin = seeded(lambda: nn.Linear(3, rows))
    originals = {name: p.detach().clone() for name, p in lin.named_parameters()}
    impl.fully_shard(lin)
    for name, param in lin.named_parameters():
        _assert_sharded_param(param)
        assert param.shape == originals[name].shape
        assert param.to_local().shape == (expected_rows[rank], *originals[name].shape[1:]), name
        assert param.requires_grad
        torch.testing.assert_close(param.full_tensor(), originals[name], rtol=0, atol=0)
        # The local shard holds exactly this rank's torch.chunk rows (none when beyond the end).
        chunks = torch.chunk(originals[name], dist.get_world_size(), dim=0)
        want = chunks[rank] if rank < len(chunks) else originals[name][:0]
        torch.testing.assert_close(param.to_local(), want, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("world_size", "rows", "expected_rows"),
    [
        pytest.param(2, 5, [3, 2], id="5rows-ws2"),
        pytest.param(4, 6, [2, 2, 2, 0], id="6rows-ws4"),
        pytest.param(2, 1, [1, 0], id="1row-ws2"),
        pytest.param(4, 8, [2, 2, 2, 2], id="8rows-ws4"),
    ],
)
def test_sharded_parameters_follow_chunk_split(
    impl: Impl, world_size: int, rows: int, expected_rows: list[int]
) -> None:
    run_threaded(world_size, _sharded_rows, impl, rows, expected_rows)


# ---------------------------------------------------------------------------------------------
# What is registered on the module through an iteration
# ---------------------------------------------------------------------------------------------


def _registered_types(impl: Impl, child_raf: Any) -> None:
    model = seeded(lambda: nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM)))
    impl.fully_shard(model[0], reshard_after_forward=child_raf)
    impl.fully_shard(model)  # root with the automatic value: keeps its parameters after forward
    for param in model.parameters():
        _assert_sharded_param(param)

    loss = model(make_input((3, DIM), dist.get_rank())).sum()
    for param in model[2].parameters():  # the root's own parameters
        _assert_plain_param(param)
    for param in model[0].parameters():
        if child_raf is True:
            _assert_sharded_param(param)
        elif child_raf is False:
            _assert_plain_param(param)
        else:  # int: a placeholder on the (W / k, k) post-forward mesh
            _assert_sharded_param(param, mesh_ndim=2)
            assert param.device_mesh.shape == (dist.get_world_size() // child_raf, child_raf)

    loss.backward()
    for param in model.parameters():
        _assert_sharded_param(param)


@pytest.mark.parametrize(
    ("world_size", "child_raf"),
    [
        pytest.param(2, True, id="ws2-True"),
        pytest.param(2, False, id="ws2-False"),
        pytest.param(4, 2, id="ws4-2"),
    ],
)
def test_registered_parameters_after_forward_and_backward(
    impl: Impl, world_size: int, child_raf: Any
) -> None:
    run_threaded(world_size, _registered_types, impl, child_raf)


def _unsharded_identity(impl: Impl) -> None:
    model = seeded(lambda: MLP(DIM))
    impl.fully_shard(model.in_proj, reshard_after_forward=True)
    impl.fully_shard(model)
    seen: list[list[nn.Parameter]] = []
    # Runs after FSDP's own pre-forward hook, which is prepended: it sees the unsharded parameters.
    model.in_proj.register_forward_pre_hook(lambda m, args: seen.append(list(m.parameters())))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for it in range(3):
        model(make_input((2, DIM), dist.get_rank(), seed=it)).sum().backward()
        optim.step()
        optim.zero_grad()
    for params in seen:
        for param in params:
            _assert_plain_param(param)
    for first, later in zip(seen[0], seen[-1], strict=True):
        assert first is later
    for first, later in zip(seen[0], seen[1], strict=True):
        assert first is later


def test_unsharded_parameter_is_reused_across_iterations(impl: Impl) -> None:
    run_threaded(2, _unsharded_identity, impl)


# ---------------------------------------------------------------------------------------------
# Explicit unshard / reshard
# ---------------------------------------------------------------------------------------------


def _unshard_before_forward(impl: Impl, async_op: bool) -> None:
    model = seeded(lambda: MLP(DIM, hidden_dim=7))
    ref = copy.deepcopy(model)
    impl.fully_shard(model)
    handle = model.unshard(async_op=async_op)
    if async_op:
        assert handle is not None
        handle.wait()
    else:
        assert handle is None
    for (name, ref_param), param in zip(ref.named_parameters(), model.parameters(), strict=True):
        _assert_plain_param(param)
        torch.testing.assert_close(param, ref_param, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    model.reshard()
    for param in model.parameters():
        _assert_sharded_param(param)
    # A normal iteration still matches the reference afterwards.
    x = make_input((2, DIM), dist.get_rank())
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_unshard_before_first_forward(impl: Impl, async_op: bool) -> None:
    run_threaded(2, _unshard_before_forward, impl, async_op)


def _unshard_without_params(impl: Impl) -> None:
    model = seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    originals = [p.detach().clone() for p in model.parameters()]
    for lin in model:
        impl.fully_shard(lin)
    impl.fully_shard(model)  # the root manages no parameters of its own
    with count_collectives() as counts:
        handle = model.unshard(async_op=True)
        assert handle is not None
        handle.wait()
        handle.wait()
        assert model.unshard() is None
    assert not counts
    for param, original in zip(model.parameters(), originals, strict=True):
        _assert_sharded_param(param)  # not recursive: the children stay sharded
        torch.testing.assert_close(param.full_tensor(), original, rtol=0, atol=0)


def test_unshard_module_without_parameters(impl: Impl) -> None:
    run_threaded(2, _unshard_without_params, impl)


# ---------------------------------------------------------------------------------------------
# Gradients and grouped modules
# ---------------------------------------------------------------------------------------------


def _sharded_grads(impl: Impl) -> None:
    model = seeded(lambda: MLP(5, hidden_dim=7))
    ref = copy.deepcopy(model)
    impl.fully_shard(model.in_proj)
    impl.fully_shard(model)
    x = make_input((3, 5), dist.get_rank())
    ref(x).sum().backward()
    for param in ref.parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
    model(x).sum().backward()
    for name, param in model.named_parameters():
        grad = param.grad
        assert isinstance(grad, DTensor), f"{name}: {type(grad)}"
        assert tuple(grad.placements) == tuple(param.placements), name
        assert grad.to_local().shape == param.to_local().shape, name
        assert grad.dtype == param.dtype, name
    assert_sharded_parity(ref, model, grads=True)


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_gradients(impl: Impl, world_size: int) -> None:
    run_threaded(world_size, _sharded_grads, impl)


def _grouped_call(impl: Impl, grouped: bool) -> dict[str, Any]:
    model = seeded(lambda: nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, 3)))
    ref = copy.deepcopy(model)
    if grouped:
        impl.fully_shard([model[0], model[1]])
    else:
        impl.fully_shard(model[0])
        impl.fully_shard(model[1])
    impl.fully_shard(model)
    x = make_input((2, DIM), dist.get_rank())
    with impl.record_events() as events, count_collectives() as counts:
        loss = model(x).sum()
    unshards = [fqn for kind, fqn, _ in events if kind == "unshard"]
    torch.testing.assert_close(loss, ref(x).sum(), rtol=0, atol=0)
    return {"all_gathers": counts["all_gather"], "unshards": unshards}


def test_list_call_makes_one_group(impl: Impl) -> None:
    grouped = run_threaded(2, _grouped_call, impl, True)
    separate = run_threaded(2, _grouped_call, impl, False)
    assert grouped == [{"all_gathers": 2, "unshards": ["", "0, 1"]}] * 2
    assert separate == [{"all_gathers": 3, "unshards": ["", "0", "1"]}] * 2


def _trace_one_step(path: str) -> list[str]:
    import json

    import fsdp2

    model = broadcast_module_(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    fsdp2.fully_shard(model[0])
    fsdp2.fully_shard(model[2])
    fsdp2.fully_shard(model)
    with fsdp2.record_events() as events:
        model(torch.ones(2, 4)).sum().backward()
    times = [e.time_us for e in events]
    assert times == sorted(times)
    assert times[0] > 0
    if dist.get_rank() == 0:
        fsdp2.save_chrome_trace(events, path)
        with open(path) as f:
            trace = json.load(f)["traceEvents"]
        markers = [e for e in trace if e["ph"] == "i"]
        assert [m["name"] for m in markers] == [f"{e.kind} ({e.training_state.name})" for e in events]
        tracks = {e["args"]["name"] for e in trace if e["ph"] == "M"}
        assert tracks == {"0", "2"}  # the root owns no parameters: no group, no track
    return [str(e) for e in events]


def test_chrome_trace_of_one_step(tmp_path: Any) -> None:
    lines = run_threaded(2, _trace_one_step, str(tmp_path / "trace.json"))[0]
    assert lines[0].startswith("unshard")
    assert lines[0].endswith("0 (FORWARD)")
