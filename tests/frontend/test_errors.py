"""Every user-facing validation error of ``fully_shard`` and ``FSDPModule`` (docs/errors.md).

Errors raised by ``fully_shard`` itself must leave the module exactly as it was: same classes, same
parameter objects and values, no FSDP state, no hooks. Errors that need a mesh run on a small threaded
world; the checks that fail before any mesh is touched run without a process group.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp2 import FSDPModule, fully_shard
from tests._harness import broadcast_module_, run_threaded

WORLD_SIZE = 2


@dataclass(frozen=True)
class Snapshot:
    classes: list[tuple[str, type]]
    params: list[tuple[str, nn.Parameter]]
    values: list[torch.Tensor]
    hook_counts: list[tuple[int, int]]


def _snapshot(module: nn.Module) -> Snapshot:
    modules = list(module.named_modules())
    params = list(module.named_parameters())
    return Snapshot(
        classes=[(name, type(m)) for name, m in modules],
        params=params,
        values=[p.detach().clone() for _, p in params],
        hook_counts=[(len(m._forward_pre_hooks), len(m._forward_hooks)) for _, m in modules],
    )


def _assert_unchanged(module: nn.Module, before: Snapshot) -> None:
    after = _snapshot(module)
    assert after.classes == before.classes
    assert [name for name, _ in after.params] == [name for name, _ in before.params]
    for (name, param), (_, old) in zip(after.params, before.params, strict=True):
        assert param is old, f"{name} was replaced"
    for (name, _), value, old in zip(after.params, after.values, before.values, strict=True):
        torch.testing.assert_close(value, old, rtol=0, atol=0, msg=f"{name} changed")
    assert after.hook_counts == before.hook_counts


def _mlp() -> nn.Sequential:
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    return model


def _mesh(shape: tuple[int, ...] = (WORLD_SIZE,), names: tuple[str, ...] | None = None) -> DeviceMesh:
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


class _WithParam(nn.Module):
    """A module whose own parameter comes last, after a valid child, to catch partial sharding."""

    def __init__(self, param: nn.Parameter) -> None:
        super().__init__()
        self.inner = nn.Linear(3, 3)
        self.odd = param

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


# ---- argument errors before any mesh is needed ----------------------------------------------------

NOT_MODULES = [
    pytest.param(42, id="int"),
    pytest.param("str", id="str"),
    pytest.param(torch.ones(2), id="tensor"),
    pytest.param([], id="empty-list"),
]


@pytest.mark.parametrize("value", NOT_MODULES)
def test_non_module_argument(value: Any) -> None:
    with pytest.raises(TypeError, match=r"expects an nn\.Module or a non-empty list of nn\.Module"):
        fully_shard(value)


def test_list_with_a_non_module() -> None:
    linear = nn.Linear(2, 2)
    before = _snapshot(linear)
    with pytest.raises(TypeError, match=r"non-empty list of nn\.Module, got a list of Linear, int"):
        fully_shard([linear, 3])  # type: ignore[list-item]
    _assert_unchanged(linear, before)


@pytest.mark.parametrize("container", [nn.ModuleList, nn.ModuleDict])
def test_container_without_forward(container: type) -> None:
    children = [nn.Linear(2, 2)] if container is nn.ModuleList else {"a": nn.Linear(2, 2)}
    module = container(children)
    before = _snapshot(module)
    match = rf"does not support {container.__name__} directly: it has no forward"
    with pytest.raises(ValueError, match=match):
        fully_shard(module)
    _assert_unchanged(module, before)


def test_mesh_of_the_wrong_type() -> None:
    model = _mlp()
    before = _snapshot(model)
    with pytest.raises(TypeError, match=r"mesh must be a DeviceMesh, got str 'cpu'"):
        fully_shard(model, mesh="cpu")  # type: ignore[arg-type]
    _assert_unchanged(model, before)


# ---- fully_shard validation with a mesh ------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    kwargs: Callable[[], dict[str, Any]]  # called on the rank thread (meshes need the process group)
    error: type[Exception]
    match: str
    world_size: int = WORLD_SIZE


def _noncontiguous() -> nn.Module:
    return _WithParam(nn.Parameter(torch.randn(4, 3).t()))


def _case(
    case_id: str,
    kwargs: Callable[[], dict[str, Any]],
    error: type[Exception],
    match: str,
    *,
    build: Callable[[], nn.Module] = _mlp,
    world_size: int = WORLD_SIZE,
) -> Any:
    return pytest.param(Case(build, kwargs, error, match, world_size), id=case_id)


RAF_NOT_A_FACTOR = r"reshard_after_forward={} must divide the shard world size 4"
# fmt: off
VALIDATION_CASES = [
    _case("3d-mesh", lambda: {"mesh": _mesh((1, 1, WORLD_SIZE))}, ValueError,
          r"expects a 1-D mesh .* got a 3-D mesh of shape \(1, 1, 2\)"),
    _case("2d-mesh-no-names", lambda: {"mesh": _mesh((1, WORLD_SIZE))}, ValueError,
          r"2-D mesh without dim names"),
    _case("raf-float", lambda: {"reshard_after_forward": 2.0}, ValueError,
          r"reshard_after_forward must be a bool, an int or None, got float 2\.0"),
    _case("raf-str", lambda: {"reshard_after_forward": "yes"}, ValueError,
          r"must be a bool, an int or None, got str 'yes'"),
    _case("raf-3-of-4", lambda: {"reshard_after_forward": 3}, ValueError, RAF_NOT_A_FACTOR.format(3),
          world_size=4),
    _case("raf-8-of-4", lambda: {"reshard_after_forward": 8}, ValueError, RAF_NOT_A_FACTOR.format(8),
          world_size=4),
    _case("raf-0", lambda: {"reshard_after_forward": 0}, ValueError, r"reshard_after_forward=0 must divide"),
    _case("mp-policy-type", lambda: {"mp_policy": torch.bfloat16}, TypeError,
          r"mp_policy must be a MixedPrecisionPolicy, got dtype"),
    _case("offload-policy-type", lambda: {"offload_policy": None}, TypeError,
          r"offload_policy must be an OffloadPolicy, got NoneType"),
    _case("ignored-params", lambda: {"ignored_params": {1, 2}}, TypeError,
          r"ignored_params must be a set of parameters"),
    _case("scalar", dict, ValueError, r"cannot shard the scalar parameter _WithParam\.odd: .* got shape \(\)",
          build=lambda: _WithParam(nn.Parameter(torch.tensor(1.0)))),
    _case("non-contiguous", dict, NotImplementedError,
          r"does not support the non-contiguous parameter _WithParam\.odd \(stride \(1, 3\)\)",
          build=_noncontiguous),
    _case("placement-shard1-uneven", lambda: {"shard_placement_fn": lambda p: Shard(1)}, NotImplementedError,
          r"Shard\(1\) for Linear\.weight needs its size on dim 1 \(3\) to be divisible by the shard world "
          r"size 2", build=lambda: nn.Linear(3, 4)),
    _case("placement-dim-out-of-range", lambda: {"shard_placement_fn": lambda p: Shard(2)}, ValueError,
          r"returned Shard\(2\) for Linear\.weight of shape \(4, 3\): expected a dim in \[-2, 2\)",
          build=lambda: nn.Linear(3, 4)),
    _case("placement-replicate", lambda: {"shard_placement_fn": lambda p: Replicate()}, ValueError,
          r"shard_placement_fn returned Replicate\(\) for .*: expected a Shard\(dim\) placement, a "
          r"ShardPlacementResult or None"),
    _case("placement-int-reshard", lambda: {"shard_placement_fn": lambda p: Shard(p.ndim - 1),
                                            "reshard_after_forward": 2}, NotImplementedError,
          r"reshard_after_forward=2 \(an int\) is not supported with Shard\(1\)",
          build=lambda: nn.Linear(4, 4), world_size=4),
]
# fmt: on


@pytest.mark.parametrize("case", VALIDATION_CASES)
def test_fully_shard_validation(case: Case) -> None:
    def body() -> None:
        model = case.build()
        before = _snapshot(model)
        with pytest.raises(case.error, match=case.match):
            fully_shard(model, **case.kwargs())
        _assert_unchanged(model, before)

    run_threaded(case.world_size, body)


def test_grouped_call_validates_every_module_first() -> None:
    def body() -> None:
        first, second = nn.Linear(3, 3), _noncontiguous()
        before = [_snapshot(first), _snapshot(second)]
        with pytest.raises(NotImplementedError, match=r"non-contiguous parameter _WithParam\.odd"):
            fully_shard([first, second], mesh=_mesh())
        _assert_unchanged(first, before[0])
        _assert_unchanged(second, before[1])

    run_threaded(WORLD_SIZE, body)


def test_applying_twice() -> None:
    def body() -> None:
        model = fully_shard(_mlp(), mesh=_mesh())
        before = _snapshot(model)
        with pytest.raises(ValueError, match=r"fully_shard was already applied to this FSDPSequential"):
            fully_shard(model, mesh=_mesh())
        _assert_unchanged(model, before)

    run_threaded(WORLD_SIZE, body)


def test_child_after_parent_sees_a_dtensor_parameter() -> None:
    def body() -> None:
        model = fully_shard(_mlp(), mesh=_mesh())
        child = model[0]
        before = _snapshot(child)
        with pytest.raises(ValueError, match=r"Parameter Linear\.weight is already a DTensor.*bottom-up"):
            fully_shard(child, mesh=_mesh())
        _assert_unchanged(child, before)

    run_threaded(WORLD_SIZE, body)


# ---- FSDPModule method errors ----------------------------------------------------------------------


def _sharded_mlp() -> nn.Sequential:
    model = _mlp()
    fully_shard(model[0], mesh=_mesh())
    fully_shard(model[2], mesh=_mesh())
    fully_shard(model, mesh=_mesh())
    return model


def test_prefetch_lists_reject_non_fsdp_modules() -> None:
    def body() -> None:
        model = _sharded_mlp()
        state = model._get_fsdp_state()
        for method in (model.set_modules_to_forward_prefetch, model.set_modules_to_backward_prefetch):
            with pytest.raises(
                ValueError, match=rf"{method.__name__} expects FSDPModule entries .* got Linear"
            ):
                method([model[2], nn.Linear(2, 2)])
            with pytest.raises(ValueError, match=rf"{method.__name__} expects a list of FSDPModule, got"):
                method(model[2])
        assert state.forward_prefetch == []
        assert state.backward_prefetch == []

    run_threaded(WORLD_SIZE, body)


def test_set_reshard_after_forward_rejects_non_bool() -> None:
    def body() -> None:
        model = _sharded_mlp()
        infos = [m._get_fsdp_state().groups[0].post_forward_mesh_info for m in (model[0], model[2])]
        with pytest.raises(ValueError, match=r"reshard_after_forward should be a bool, got int 2"):
            model.set_reshard_after_forward(2)  # type: ignore[arg-type]
        assert [m._get_fsdp_state().groups[0].post_forward_mesh_info for m in (model[0], model[2])] == infos

    run_threaded(WORLD_SIZE, body)


def test_reset_iter_state_on_a_non_root() -> None:
    def body() -> None:
        model = _sharded_mlp()
        model(torch.ones(2, 3)).sum().backward()  # lazy init decides the root
        with pytest.raises(
            RuntimeError,
            match=r"reset_iter_state must be called on the root module, not on "
            r"FSDPLinear",
        ):
            model[0].reset_iter_state()
        model.reset_iter_state()  # the root may

    run_threaded(WORLD_SIZE, body)


# ---- errors at the first forward (root lazy init) ---------------------------------------------------


def _assert_all_sharded(module: nn.Module) -> None:
    for name, param in module.named_parameters():
        assert isinstance(param, DTensor), f"{name} is registered unsharded after a failed lazy init"


def test_child_runs_before_its_root() -> None:
    def body() -> None:
        model = _sharded_mlp()
        model[0](torch.ones(2, 3))
        with pytest.raises(
            RuntimeError,
            match=r"The fully_shard module '0' already ran forward on its own "
            r"before its root FSDPSequential",
        ):
            model(torch.ones(2, 3))

    run_threaded(WORLD_SIZE, body)


def test_grouped_call_as_root() -> None:
    def body() -> None:
        first, second = nn.Linear(3, 3), nn.Linear(3, 3)
        fully_shard([first, second], mesh=_mesh())
        with pytest.raises(
            RuntimeError,
            match=r"fully_shard on a list of modules \(FSDPLinear, FSDPLinear\) "
            r"cannot be the root",
        ):
            first(torch.ones(2, 3))
        _assert_all_sharded(first)
        _assert_all_sharded(second)

    run_threaded(WORLD_SIZE, body)


def test_same_parameter_in_two_groups() -> None:
    def body() -> None:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        model[1].weight = model[0].weight
        fully_shard(model[0], mesh=_mesh())
        fully_shard(model[1], mesh=_mesh())
        fully_shard(model, mesh=_mesh())
        with pytest.raises(ValueError, match=r"Parameter 1\.weight is the same tensor as 0\.weight"):
            model(torch.ones(2, 4))

    run_threaded(WORLD_SIZE, body)


def test_meta_parameters_not_materialized() -> None:
    def body() -> None:
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        fully_shard(model, mesh=_mesh())
        names = r"\['0\.weight', '0\.bias', '1\.weight', '1\.bias'\]"
        with pytest.raises(RuntimeError, match=rf"Parameters {names} are still on the meta device"):
            model(torch.ones(2, 3))
        _assert_all_sharded(model)
        # The failed first forward changed nothing: materialize, then the same model trains and its
        # forward equals the unsharded reference built from the same full weights.
        model.to_empty(device="cpu")
        with torch.no_grad():
            for param in model.parameters():
                param.fill_(0.1 * param.ndim)  # a DTensor fill: every shard gets the value
        ref = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        with torch.no_grad():
            for param in ref.parameters():
                param.fill_(0.1 * param.ndim)
        x = torch.ones(2, 3)
        out = model(x)
        out.sum().backward()
        torch.testing.assert_close(out, ref(x))
        assert model._get_fsdp_state().is_root is True

    run_threaded(WORLD_SIZE, body)


class _MixedDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 2).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).double())


def test_mixed_dtypes_in_one_group_train_like_the_reference() -> None:
    # torch 2.13 rejects trainable parameters of several dtypes in one group; fsdp2 gathers their bytes
    # in one all-gather and reduces each dtype in its own reduce-scatter.
    def body() -> None:
        model = broadcast_module_(_MixedDtypes())
        ref = copy.deepcopy(model)
        fully_shard(model, mesh=_mesh())
        x = torch.full((2, 3), float(dist.get_rank() + 1))
        model(x).sum().backward()
        ref(x).sum().backward()
        for ref_param, param in zip(ref.parameters(), model.parameters(), strict=True):
            assert ref_param.grad is not None
            assert param.grad is not None
            dist.all_reduce(ref_param.grad, op=dist.ReduceOp.AVG)
            assert param.grad.dtype == ref_param.dtype
            torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad)
            torch.testing.assert_close(param.full_tensor(), ref_param)

    run_threaded(WORLD_SIZE, body)


def test_fsdp_module_isinstance_after_success() -> None:
    # The counterpart of the "unchanged" checks: a successful call does change class and parameters.
    def body() -> None:
        model = _mlp()
        before = _snapshot(model)
        fully_shard(model, mesh=_mesh())
        assert isinstance(model, FSDPModule)
        assert type(model).__name__ == "FSDPSequential"
        for (name, param), value in zip(model.named_parameters(), before.values, strict=True):
            assert isinstance(param, DTensor), name
            torch.testing.assert_close(param.full_tensor(), value, rtol=0, atol=0)

    run_threaded(WORLD_SIZE, body)


# ---- policies and ignored_params are validated when given --------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"param_dtype": "bfloat16"},
            TypeError,
            r"param_dtype=\.\.\.\) expects a torch\.dtype.*pass torch\.bfloat16",
        ),
        ({"reduce_dtype": torch.int32}, ValueError, r"reduce_dtype=torch\.int32\) must be a floating-point"),
        (
            {"output_dtype": 16},
            TypeError,
            r"output_dtype=\.\.\.\) expects a torch\.dtype or None, got int 16",
        ),
        ({"cast_forward_inputs": 1}, TypeError, r"cast_forward_inputs=\.\.\.\) expects a bool"),
    ],
)
def test_mixed_precision_policy_is_validated_when_built(
    kwargs: dict[str, Any], error: type, match: str
) -> None:
    from fsdp2 import MixedPrecisionPolicy

    with pytest.raises(error, match=match):
        MixedPrecisionPolicy(**kwargs)


def test_cpu_offload_policy_is_validated_when_built() -> None:
    from fsdp2 import CPUOffloadPolicy

    with pytest.raises(TypeError, match=r"pin_memory=\.\.\.\) expects a bool, got str 'yes'"):
        CPUOffloadPolicy(pin_memory="yes")  # type: ignore[arg-type]


def test_ignored_params_must_belong_to_the_model() -> None:
    def body() -> None:
        model = _mlp()
        stranger = nn.Parameter(torch.zeros(7, 5))  # e.g. a parameter of another copy of the model
        ignored = {model[0].weight, stranger}
        fully_shard(model[2], mesh=_mesh(), ignored_params=ignored)  # the same set for every call is fine
        fully_shard(model, mesh=_mesh(), ignored_params=ignored)
        with pytest.raises(ValueError, match=r"not parameters of the model.*\(7, 5\) torch\.float32"):
            model(torch.ones(2, 3))  # checked against the whole tree, before any collective
        assert not isinstance(model[0].weight, DTensor)

    run_threaded(WORLD_SIZE, body)
