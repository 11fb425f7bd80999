"""The rest of torch 2.13's surface, checked against torch's own ``fully_shard`` (threads as ranks).

- ``DataParallelMeshDims`` with replicate dims only (data parallel like DDP on a full SPMD mesh, no
  sharding) and with several shard dims (flattened into one, as torch does), also combined with
  tensor parallelism and with a replicate dim: the same placements as torch, the same losses and
  gradients (bit for bit) and the same parameters after AdamW steps; every gradient is also the
  unsharded reference's data-parallel mean. One known difference, on purpose (docs/differences.md):
  for ``down.bias``, whose gradient autograd leaves ``Replicate()`` on the data-parallel dims, torch's
  is the data-parallel size times the mean. Bad dim names raise the exception types torch raises.
- All-gather extension hooks defined on the weight class after ``fully_shard``: honoured from the
  first forward like torch (whose numbers match, and a bf16-rounding reference's); hooks that appear or
  go away after the first forward raise, as in torch, with the same exception types.
- Setter arguments of the wrong type: the exception type torch raises (at the call or at the next
  step); fsdp2 raises at the call, before anything changes.

torch's ``fully_shard`` on a full SPMD mesh refuses a mesh that is merely equal to one used before in
the process (its parameters' specs come from DTensor's caches), so each case names its mesh dims after
itself, and torch runs first. fsdp2 then runs on a mesh of the same names, in the same rank threads:
DTensor's sharding propagation, cached per thread, serves it what torch's run computed for the same
ops on the same specs (where a 3-D case spends most of its time: half the case's time).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import fsdp2
from tests._harness import run_threaded
from tests._impls import Impl, get_impl
from tests._training import EXACT, TIGHT, seeded
from tests.models import MLP, make_input
from tests.shared.dp_mesh import DIM, FeedForward
from tests.shared.extension import Net, WrapperWeight

# ---- DataParallelMeshDims ------------------------------------------------------------------------

# case -> (mesh shape, mesh dim names, DataParallelMeshDims fields); a dim named "tp" is tensor parallel
CASES: dict[str, tuple[tuple[int, ...], tuple[str, ...], dict[str, Any]]] = {
    "replicate": ((2, 2), ("dp", "tp"), {"replicate": "dp"}),
    "replicate_two_dims": ((2, 2), ("r1", "r2"), {"replicate": ("r1", "r2")}),
    "two_shard_dims": ((2, 2), ("dp", "cp"), {"shard": ("dp", "cp")}),
    "two_shard_dims_tp": ((2, 2, 2), ("dp", "cp", "tp"), {"shard": ("dp", "cp")}),
    "hsdp_two_shard_dims": ((2, 2, 2), ("rep", "dp", "cp"), {"shard": ("dp", "cp"), "replicate": "rep"}),
}
# what torch 2.13 gives the sharded parameters: (mesh dim names, placements) per parameter
EXPECTED_LAYOUT: dict[str, dict[str, tuple[tuple[str, ...], str]]] = {
    "two_shard_dims_tp": {
        "up.weight": (("dp_cp", "tp"), "(_StridedShard(dim=0, sf=2), Shard(dim=0))"),
        "down.weight": (("dp_cp", "tp"), "(Shard(dim=0), Shard(dim=1))"),
    },
    "hsdp_two_shard_dims": {"up.weight": (("rep", "dp_cp"), "(Replicate(), Shard(dim=0))")},
    "replicate": {"up.weight": (("dp", "tp"), "(Replicate(), Shard(dim=0))")},
}
_TP = {"up.weight": Shard(0), "up.bias": Shard(0), "down.weight": Shard(1), "down.bias": Replicate()}


def _dims_class(impl: Impl) -> Any:
    if impl.name == "fsdp2":
        return fsdp2.DataParallelMeshDims
    from torch.distributed.fsdp import DataParallelMeshDims

    return DataParallelMeshDims


def _named(prefix: str, value: Any) -> Any:
    """``value``'s dim names (a name, a tuple or list of them, or ``None``) with ``prefix``."""
    if value is None:
        return None
    if isinstance(value, str):
        return prefix + value
    return type(value)(prefix + name for name in value)


def _spmd_model(mesh: DeviceMesh, names: tuple[str, ...], base: nn.Module | None = None) -> FeedForward:
    """A copy of ``base`` distributed on ``mesh``: Replicate() on every dim but ``tp``."""
    model = copy.deepcopy(base) if base is not None else seeded(FeedForward)
    for name, param in list(model.named_parameters()):
        owner, attr = name.rsplit(".", 1)
        placements = [_TP[name] if dim == "tp" else Replicate() for dim in names]
        value = distribute_tensor(param.detach(), mesh, placements)
        setattr(model.get_submodule(owner), attr, nn.Parameter(value))
    assert isinstance(model, FeedForward)
    return model


def _dp_index(mesh: DeviceMesh, names: tuple[str, ...]) -> int:
    """This rank's index among the data-parallel ranks (every dim but ``tp``, in mesh order)."""
    index = 0
    for dim, name in enumerate(names):
        if name != "tp":
            index = index * mesh.size(dim) + mesh.get_local_rank(dim)
    return index


def _batch(mesh: DeviceMesh, names: tuple[str, ...], step: int) -> tuple[torch.Tensor, DTensor]:
    local = torch.randn(4, DIM, generator=torch.Generator().manual_seed(10 * _dp_index(mesh, names) + step))
    placements = [Replicate() if name == "tp" else Shard(0) for name in names]
    return local, DTensor.from_local(local, mesh, placements)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    assert isinstance(tensor, DTensor)
    return tensor.full_tensor()


def _train_spmd(impl: Impl, case: str, base: nn.Module, steps: int = 3) -> dict[str, Any]:
    """``steps`` AdamW steps of ``impl`` on ``case``: losses, gradients, parameters and layouts."""
    shape, names, fields = CASES[case]
    prefix = f"{case}_"  # the same for both implementations (see the module's docstring)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=tuple(prefix + name for name in names))
    dims = _dims_class(impl)(**{key: _named(prefix, value) for key, value in fields.items()})
    model = _spmd_model(mesh, names, base)
    impl.fully_shard(model.up, mesh=mesh, dp_mesh_dims=dims)
    impl.fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    layouts = {
        name: (tuple(n.replace(prefix, "") for n in p.device_mesh.mesh_dim_names), str(p.placements))
        for name, p in model.named_parameters()
    }
    local_shapes = {name: tuple(p.to_local().shape) for name, p in model.named_parameters()}
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(steps):
        _, x = _batch(mesh, names, step)
        loss = model(x).sum()
        loss.backward()
        losses.append(_full(loss))
        grads.append({name: _full(p.grad) for name, p in model.named_parameters()})
        optim.step()
        optim.zero_grad()
    params = {name: _full(p) for name, p in model.named_parameters()}
    return {"layouts": layouts, "shapes": local_shapes, "losses": losses, "grads": grads, "params": params}


def _reference(
    case: str, base: nn.Module, steps: int = 3
) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """The unsharded block on every data-parallel rank's batch: summed losses, mean gradients."""
    shape, names, _ = CASES[case]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=tuple(f"ref_{case}_{name}" for name in names))
    ref = copy.deepcopy(base)
    optim = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    tp_size = mesh.size(names.index("tp")) if "tp" in names else 1
    losses, grads = [], []
    for step in range(steps):
        local, _ = _batch(mesh, names, step)
        loss = ref(local).sum()
        loss.backward()
        everyone = [torch.zeros(()) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, loss.detach())
        losses.append(torch.stack(everyone).sum() / tp_size)  # tp ranks hold copies of one batch
        for p in ref.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        grads.append({name: p.grad.clone() for name, p in ref.named_parameters() if p.grad is not None})
        optim.step()
        optim.zero_grad()
    return losses, grads


def _compare_with_torch(case: str, base: nn.Module) -> None:
    theirs = _train_spmd(get_impl("torch"), case, base)
    ours = _train_spmd(get_impl("fsdp2"), case, base)
    ref_losses, ref_grads = _reference(case, base)
    assert ours["layouts"] == theirs["layouts"]
    assert ours["shapes"] == theirs["shapes"]
    for name, layout in EXPECTED_LAYOUT.get(case, {}).items():
        assert ours["layouts"][name] == layout, name
    shape, names, _ = CASES[case]
    dp_size = math.prod(size for size, name in zip(shape, names, strict=True) if name != "tp")
    for step, (loss, torch_loss, ref_loss) in enumerate(
        zip(ours["losses"], theirs["losses"], ref_losses, strict=True)
    ):
        torch.testing.assert_close(loss, torch_loss, **EXACT, msg=lambda m, s=step: f"loss {s}: {m}")
        torch.testing.assert_close(loss, ref_loss, **TIGHT, msg=lambda m, s=step: f"loss {s}: {m}")
        for name, grad in ours["grads"][step].items():
            torch_grad = theirs["grads"][step][name]
            if name == "down.bias":  # Replicate() on the data-parallel dims: torch does not average it
                torch_grad = torch_grad / dp_size
            msg = lambda m, n=name, s=step: f"{n} grad {s}: {m}"  # noqa: E731
            torch.testing.assert_close(grad, torch_grad, **EXACT, msg=msg)
            torch.testing.assert_close(grad, ref_grads[step][name], **TIGHT, msg=msg)
    for name, param in ours["params"].items():
        torch.testing.assert_close(param, theirs["params"][name], **TIGHT, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_dp_mesh_dims_matches_torch(case: str) -> None:
    torch.manual_seed(0)  # one model for every run, built here (rank threads would race on the RNG)
    run_threaded(math.prod(CASES[case][0]), _compare_with_torch, case, FeedForward())


# case -> (mesh shape, dim names, DataParallelMeshDims fields, reshard_after_forward, exception type,
# fsdp2's message)
ERROR_CASES: dict[str, tuple[tuple[int, ...], tuple[str, ...], dict[str, Any], Any, type[Exception], str]] = {
    "out_of_mesh_order": (
        (2, 2),
        ("dp", "cp"),
        {"shard": ("cp", "dp")},
        None,
        KeyError,
        "does not follow the order of the mesh dims",
    ),
    "named_twice": ((2, 2), ("dp", "cp"), {"shard": ("dp", "dp")}, None, RuntimeError, "names a dim twice"),
    "shard_and_replicate": (
        (2, 2),
        ("dp", "cp"),
        {"shard": "dp", "replicate": "dp"},
        None,
        RuntimeError,
        "as both shard and replicate dims",
    ),
    "shard_dims_not_adjacent": (
        (2, 1, 2),
        ("dp", "tp", "cp"),
        {"shard": ("dp", "cp")},
        None,
        RuntimeError,
        "must be adjacent in the mesh",
    ),
    "no_dims": ((2, 2), ("dp", "cp"), {"shard": ()}, None, RuntimeError, "names no mesh dim"),
    "int_reshard_two_shard_dims": (
        (2, 2),
        ("dp", "cp"),
        {"shard": ("dp", "cp")},
        2,
        NotImplementedError,
        r"reshard_after_forward=2 \(an int\)",
    ),
}


def _refused(impl: Impl, case: str) -> None:
    shape, names, fields, reshard, error, message = ERROR_CASES[case]
    prefix = f"{case}_"  # the same for both implementations (see the module's docstring)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=tuple(prefix + name for name in names))
    dims = _dims_class(impl)(**{key: _named(prefix, value) for key, value in fields.items()})
    model = _spmd_model(mesh, names)
    params = list(model.parameters())
    with pytest.raises(error, match=message if impl.name == "fsdp2" else None):
        impl.fully_shard(model, mesh=mesh, dp_mesh_dims=dims, reshard_after_forward=reshard)
    if impl.name == "fsdp2":  # nothing changed
        assert not isinstance(model, fsdp2.FSDPModule)
        assert all(p is q for p, q in zip(model.parameters(), params, strict=True))


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_dp_mesh_dims_refusals_match_torch(impl: Impl, case: str) -> None:
    run_threaded(math.prod(ERROR_CASES[case][0]), _refused, impl, case)


def _replicate_only_controls(impl: Impl) -> None:
    """Replicas only: an int reshard_after_forward is ignored; set_reshard_after_forward is refused."""
    prefix = f"{impl.name}_controls_"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=(prefix + "dp", prefix + "tp"))
    model = _spmd_model(mesh, ("dp", "tp"))
    dims = _dims_class(impl)(replicate=prefix + "dp")
    impl.fully_shard(model.up, mesh=mesh, dp_mesh_dims=dims, reshard_after_forward=2)
    impl.fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    before = _controls(model) if impl.name == "fsdp2" else None
    message = r"FSDPFeedForward replicates its parameters without sharding them" if before else None
    with pytest.raises(AssertionError, match=message):
        model.set_reshard_after_forward(True)  # type: ignore[operator]
    if before is not None:
        assert _controls(model) == before  # refused before any change
    model(_batch(mesh, ("dp", "tp"), 0)[1]).sum().backward()  # still trains
    assert all(isinstance(p.grad, DTensor) for p in model.parameters())


def test_replicate_only_controls_match_torch(impl: Impl) -> None:
    run_threaded(4, _replicate_only_controls, impl)


# ---- all-gather extension hooks set on the class after fully_shard --------------------------------


def _bf16_pre_all_gather(
    self: WrapperWeight, mesh: Any, orig_size: torch.Size, stride: Any, module: nn.Module, mp_policy: Any
) -> tuple[tuple[torch.Tensor], None]:
    """All-gather the weight in bfloat16."""
    calls = type(self).__dict__.get("calls")
    if calls is not None:
        calls.append("pre")
    return (self._data.to(torch.bfloat16),), None


def _bf16_post_all_gather(
    self: WrapperWeight,
    outputs: Sequence[torch.Tensor],
    metadata: Any,
    param_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
    """Compute with the bf16-rounded weight in ``param_dtype``."""
    full = outputs[0].to(param_dtype)
    if out is not None:
        out.data.copy_(full)
        return None
    return full, (full,)


def _add_hooks(cls: type) -> None:
    cls.fsdp_pre_all_gather = _bf16_pre_all_gather  # type: ignore[attr-defined]
    cls.fsdp_post_all_gather = _bf16_post_all_gather  # type: ignore[attr-defined]


class Bf16RoundLinear(nn.Linear):
    """The reference: computes with the bf16-rounded weight, straight-through in backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rounded = self.weight.detach().to(torch.bfloat16).to(self.weight.dtype)
        return nn.functional.linear(x, self.weight + (rounded - self.weight).detach(), self.bias)


def _hooked_net(impl: Impl, base: nn.Module | None = None) -> tuple[Net, type]:
    """A sharded copy of ``base`` whose two weights are of a fresh weight class without hooks (yet)."""
    cls = type("LateHookWeight", (WrapperWeight,), {"calls": []})
    model = copy.deepcopy(base) if base is not None else seeded(Net)
    assert isinstance(model, Net)
    for layer in (model.l1, model.l2):
        layer.weight = nn.Parameter(cls(layer.weight.detach().clone()))
    for layer in (model.l1, model.l2):
        impl.fully_shard(layer)
    impl.fully_shard(model)
    assert type(model.l1.weight.to_local()) is cls  # the local shard keeps its class, hooks or not
    return model, cls


def _train_with_late_hooks(
    impl_name: str, base: Net
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], int]:
    impl = get_impl(impl_name)
    ref = Net(Bf16RoundLinear)
    ref.load_state_dict(base.state_dict())
    model, cls = _hooked_net(impl, base)
    _add_hooks(cls)  # after fully_shard, before the first forward
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        x = make_input((4, 8), dist.get_rank(), seed=step)
        loss, ref_loss = model(x).sum(), ref(x).sum()
        loss.backward()
        ref_loss.backward()
        for p in ref.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        torch.testing.assert_close(loss, ref_loss, **TIGHT)
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(_full(p.grad), q.grad, **TIGHT, msg=lambda m, n=name: f"{n}: {m}")
        for o in (optim, ref_optim):
            o.step()
            o.zero_grad()
        losses.append(loss.detach())
    params = {}
    for name, p in model.named_parameters():
        full = _full(p)
        params[name] = full._data if isinstance(full, WrapperWeight) else full
    return losses, params, len(cls.calls)  # type: ignore[attr-defined]


def test_hooks_set_after_fully_shard_are_honoured_like_torch() -> None:
    torch.manual_seed(0)  # one model for both runs, built here (rank threads would race on the RNG)
    base = Net()
    theirs = run_threaded(2, _train_with_late_hooks, "torch", base)
    ours = run_threaded(2, _train_with_late_hooks, "fsdp2", base)
    for (losses, params, calls), (ref_losses, ref_params, ref_calls) in zip(ours, theirs, strict=True):
        torch.testing.assert_close(losses, ref_losses, **EXACT)
        for name, param in params.items():
            torch.testing.assert_close(param, ref_params[name], **EXACT, msg=lambda m, n=name: f"{n}: {m}")
        assert calls == ref_calls == 3 * 2 * 2  # per step: forward and backward, two weights


def _hooks_changed_after_first_forward(impl: Impl, change: str) -> None:
    model, cls = _hooked_net(impl)
    if change == "removed":
        _add_hooks(cls)
    model(make_input((4, 8), dist.get_rank())).sum().backward()
    if change == "added":
        _add_hooks(cls)
        error: type[Exception] = AttributeError
        message = r"l1\.weight: its local tensor's class LateHookWeight gained fsdp_pre_all_gather"
    else:
        del cls.fsdp_pre_all_gather, cls.fsdp_post_all_gather  # type: ignore[attr-defined]
        error, message = RuntimeError, r"l1\.weight: its local tensor \(LateHookWeight\) no longer defines"
    with pytest.raises(error, match=message if impl.name == "fsdp2" else None):
        model(make_input((4, 8), dist.get_rank(), seed=1))


@pytest.mark.parametrize("change", ["added", "removed"])
def test_hooks_changed_after_the_first_forward_raise_like_torch(impl: Impl, change: str) -> None:
    run_threaded(2, _hooks_changed_after_first_forward, impl, change)


# ---- setter argument types -------------------------------------------------------------------------


class _NotAComm:
    pass


# Stand-ins resolved on each rank: an FSDP module of the model, a plain module, an arbitrary object.
_FSDP_CHILD, _PLAIN_MODULE, _OBJECT = "<fsdp child>", "<plain module>", "<object>"

# (setter, bad argument, exception torch raises, at the call or at the next step)
SETTER_CASES: list[tuple[str, Any, type[Exception]]] = [
    ("set_reduce_scatter_max_input_buffers", True, TypeError),
    ("set_reduce_scatter_max_input_buffers", 1.5, TypeError),
    ("set_reduce_scatter_max_input_buffers", "2", TypeError),
    ("set_reduce_scatter_max_input_buffers", None, TypeError),
    ("set_reduce_scatter_max_input_buffers", 0, ValueError),
    ("set_gradient_divide_factor", "2", TypeError),
    ("set_gradient_divide_factor", 0, ZeroDivisionError),
    ("set_reduce_scatter_divide_factor", "2", TypeError),
    ("set_modules_to_forward_prefetch", None, TypeError),
    ("set_modules_to_forward_prefetch", _FSDP_CHILD, TypeError),
    ("set_modules_to_forward_prefetch", "in_proj", ValueError),
    ("set_modules_to_forward_prefetch", [_PLAIN_MODULE], ValueError),
    ("set_modules_to_backward_prefetch", None, TypeError),
    ("set_modules_to_backward_prefetch", _FSDP_CHILD, TypeError),
    ("set_modules_to_backward_prefetch", [_PLAIN_MODULE], ValueError),
    ("set_all_reduce_hook", 5, TypeError),
    ("set_custom_all_gather", None, AttributeError),
    ("set_custom_all_gather", _OBJECT, AttributeError),
    ("set_custom_reduce_scatter", 5, AttributeError),
    ("set_custom_reduce_scatter", _OBJECT, AttributeError),
    ("set_symm_mem_for_comm", None, TypeError),
    ("set_symm_mem_for_comm", 5, TypeError),
    ("set_symm_mem_for_comm", "GLOO", RuntimeError),
    ("set_reshard_after_forward", None, ValueError),
    ("set_reshard_after_forward", 1, ValueError),
    ("_set_unshard_async_op", "yes", TypeError),
]
# Arguments torch accepts silently (or fails on only with CUDA or NCCL) that fsdp2 refuses at the call.
FSDP2_ONLY_CASES: list[tuple[str, Any, type[Exception]]] = [
    ("set_gradient_divide_factor", None, TypeError),
    ("set_gradient_divide_factor", True, TypeError),
    ("set_gradient_divide_factor", -1.0, ValueError),
    ("set_gradient_divide_factor", math.nan, ValueError),
    ("set_gradient_divide_factor", math.inf, ValueError),
    ("set_post_optim_event", 5, TypeError),
    ("_set_unshard_async_op", None, TypeError),
    ("_set_unshard_async_op", 1, TypeError),
]


def _resolve(value: Any, model: MLP) -> Any:
    if isinstance(value, list):
        return [_resolve(v, model) for v in value]
    stand_ins = {_FSDP_CHILD: model.in_proj, _PLAIN_MODULE: nn.Linear(2, 2), _OBJECT: _NotAComm()}
    return stand_ins.get(value, value) if isinstance(value, str) else value


def _step(model: nn.Module) -> torch.Tensor:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(make_input((2, 8), dist.get_rank())).sum()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def _controls(model: nn.Module) -> list[Any]:
    """Everything a setter may change on fsdp2's states (compared by identity and value)."""
    out: list[Any] = []
    for module in model.modules():
        if isinstance(module, fsdp2.FSDPModule):
            state = module._get_fsdp_state()
            out += [list(state.forward_prefetch), list(state.backward_prefetch), state.auto_reshard]
            out.append(state.shared_context().post_optim_event)
            for group in state.groups:
                out += [dict(vars(group.controls)), dict(vars(group.comms)), group.post_forward_mesh_info]
    return out


def _setter_refuses(impl: Impl, setter: str, value: Any, error: type[Exception]) -> None:
    model = seeded(lambda: MLP(8))
    assert isinstance(model, MLP)
    impl.fully_shard(model.in_proj)
    impl.fully_shard(model)
    before = _controls(model) if impl.name == "fsdp2" else None
    call: Callable[[Any], Any] = getattr(model, setter)
    refused: Exception | None = None
    try:
        call(_resolve(value, model))
    except error as raised:
        refused = raised
    if refused is None:
        assert impl.name == "torch", f"fsdp2's {setter}({value!r}) must raise {error.__name__} at the call"
        with pytest.raises(error):
            _step(model)  # torch raises when it first uses the value
        return
    if impl.name == "fsdp2":
        assert "got" in str(refused), f"the message says what {setter} got: {refused}"
        assert _controls(model) == before  # refused before any change
        _step(model)  # and the model still trains


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize(
    ("setter", "value", "error"),
    SETTER_CASES,
    ids=[f"{s}-{v if isinstance(v, str) else type(v).__name__}-{e.__name__}" for s, v, e in SETTER_CASES],
)
def test_setter_argument_errors_match_torch(
    impl: Impl, setter: str, value: Any, error: type[Exception]
) -> None:
    run_threaded(2, _setter_refuses, impl, setter, value, error)


@pytest.mark.parametrize(
    ("setter", "value", "error"),
    FSDP2_ONLY_CASES,
    ids=[f"{s}-{v!r}-{e.__name__}" for s, v, e in FSDP2_ONLY_CASES],
)
def test_setter_arguments_torch_accepts_are_refused(setter: str, value: Any, error: type[Exception]) -> None:
    run_threaded(2, _setter_refuses, get_impl("fsdp2"), setter, value, error)


def test_setter_errors_keep_fsdp2s_earlier_types() -> None:
    """Where fsdp2 raised another type before, its errors are of both types (callers catching either)."""
    from fsdp2.frontend._setter_checks import (
        ArgumentTypeError,
        CommTypeError,
        NotShardedError,
        UnknownBackendError,
        ZeroDivideFactorError,
    )

    for error, bases in (
        (ArgumentTypeError, (TypeError, ValueError)),
        (CommTypeError, (AttributeError, TypeError)),
        (ZeroDivideFactorError, (ZeroDivisionError, ValueError)),
        (UnknownBackendError, (RuntimeError, ValueError)),
        (NotShardedError, (AssertionError, ValueError)),
    ):
        for base in bases:
            assert issubclass(error, base), (error, base)
