"""``FSDPModule`` controls and module-level helpers, as torch 2.13 defines them, threads as ranks.

- ``set_gradient_divide_factor(f)``: gradients equal the rank sum divided by ``f``, only for the
  module it is called on; the deprecated ``set_reduce_scatter_divide_factor`` warns and does the same;
- ``set_force_sum_reduction_for_comms(True)``: same numbers as the default;
- ``set_all_reduce_hook``: the hook sees (and may change) the reduced gradients;
- ``register_fsdp_forward_method``: a ``generate`` that calls forward pieces gathers parameters;
- ``share_comm_ctx``: two roots share one communication context and both train correctly;
- ``set_post_optim_event``: accepted on CPU, nothing changes;
- errors: ``replicate``/``fully_shard`` exclusivity, prefetching a module of another root, and
  the parameters an optimizer sees after a ``no_grad`` forward.

The reference is always an unsharded copy on the same per-rank inputs with gradients reduced by
hand (all-reduce SUM, then the divisor under test).

Not covered here: ``set_gradient_divide_factor`` under gloo, where torch's ``PREMUL_SUM`` fails;
that needs real gloo processes (``tests/comm/test_gloo_features.py``).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests._harness import run_threaded
from tests._impls import Impl, get_impl
from tests._training import EXACT, TIGHT, seeded, step_all
from tests.models import MLP, make_input

DIM = 13


def _fsdp2() -> Any:
    get_impl("fsdp2")  # skips while fsdp2 is not importable
    import fsdp2

    return fsdp2


def _shard_mlp(impl: Impl, model: nn.Module, **kwargs: Any) -> None:
    impl.fully_shard(model.in_proj, **kwargs)
    impl.fully_shard(model, **kwargs)


def _reduce_grads(ref: nn.Module, divisor: Callable[[str], float]) -> None:
    """All-reduce SUM each reference gradient, then divide by ``divisor(name)``."""
    for name, param in ref.named_parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
            param.grad.div_(divisor(name))


def _assert_parity(ref: nn.Module, model: nn.Module, *, grads: bool, tol: dict[str, float] = TIGHT) -> None:
    for (name, ref_param), (sharded_name, param) in zip(
        ref.named_parameters(), model.named_parameters(), strict=True
    ):
        assert name == sharded_name
        torch.testing.assert_close(param.full_tensor(), ref_param, **tol, msg=lambda m, n=name: f"{n}: {m}")
        if grads:
            torch.testing.assert_close(
                param.grad.full_tensor(), ref_param.grad, **tol, msg=lambda m, n=name: f"{n} grad: {m}"
            )


def _train(
    model: nn.Module,
    ref: nn.Module,
    divisor: Callable[[str], float],
    steps: int = 2,
    before_step: Callable[[nn.Module], None] | None = None,
) -> None:
    """``steps`` SGD steps (scale-sensitive, unlike Adam) on both models, checking every gradient."""
    rank = dist.get_rank()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(steps):
        if before_step is not None:
            before_step(model)
        x = make_input((3, DIM), rank, seed=step)
        model(x).sum().backward()
        ref(x).sum().backward()
        _reduce_grads(ref, divisor)
        _assert_parity(ref, model, grads=True)
        step_all(optim, ref_optim)
    _assert_parity(ref, model, grads=False)


# ---------------------------------------------------------------------------------------------
# Gradient divide factor
# ---------------------------------------------------------------------------------------------


def _divide_factor(multiple: int, force_sum: bool, deprecated: bool) -> None:
    world = dist.get_world_size()
    factor = float(multiple * world)
    impl = get_impl("fsdp2")
    model = seeded(lambda: MLP(DIM))
    ref = copy.deepcopy(model)
    _shard_mlp(impl, model)
    for module in (model, model.in_proj):
        if force_sum:
            module.set_force_sum_reduction_for_comms(True)
        if deprecated:
            module.set_reduce_scatter_divide_factor(factor)  # its warning is checked by the caller
        else:
            module.set_gradient_divide_factor(factor)
    _train(model, ref, lambda name: factor)


@pytest.mark.parametrize("deprecated", [False, True], ids=["set_gradient_divide_factor", "deprecated_alias"])
@pytest.mark.parametrize("force_sum", [False, True], ids=["default", "force_sum"])
@pytest.mark.parametrize("multiple", [1, 2], ids=["f=W", "f=2W"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_gradient_divide_factor(world_size: int, multiple: int, force_sum: bool, deprecated: bool) -> None:
    # Warnings are recorded here, in the main thread: catch_warnings is process-global, so
    # per-rank pytest.warns blocks in concurrent threads would steal each other's warnings.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_threaded(world_size, _divide_factor, multiple, force_sum, deprecated)
    deprecations = [
        w
        for w in caught
        if issubclass(w.category, FutureWarning) and "set_gradient_divide_factor" in str(w.message)
    ]
    assert len(deprecations) == (2 * world_size if deprecated else 0)  # two modules per rank


def _divide_factor_not_recursive() -> None:
    world = dist.get_world_size()
    impl = get_impl("fsdp2")
    model = seeded(lambda: MLP(DIM))
    ref = copy.deepcopy(model)
    _shard_mlp(impl, model)
    model.set_gradient_divide_factor(3.0 * world)  # the root's own group (out_proj) only
    _train(model, ref, lambda name: 3.0 * world if name.startswith("out_proj") else world)


@pytest.mark.parametrize("world_size", [2])
def test_gradient_divide_factor_is_not_recursive(world_size: int) -> None:
    run_threaded(world_size, _divide_factor_not_recursive)


def _force_sum(impl_name: str) -> None:
    world = dist.get_world_size()
    impl = get_impl(impl_name)
    model = seeded(lambda: MLP(DIM))
    ref = copy.deepcopy(model)
    _shard_mlp(impl, model)
    model.set_force_sum_reduction_for_comms(True)
    model.in_proj.set_force_sum_reduction_for_comms(True)
    _train(model, ref, lambda name: world, steps=3)


@pytest.mark.parametrize("world_size", [2, 4])
def test_force_sum_reduction_same_numbers(impl: Impl, world_size: int) -> None:
    run_threaded(world_size, _force_sum, impl.name)


# ---------------------------------------------------------------------------------------------
# All-reduce hook
# ---------------------------------------------------------------------------------------------


def _all_reduce_hook(impl_name: str, hsdp: bool) -> list[int]:
    world = dist.get_world_size()
    impl = get_impl(impl_name)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    model = seeded(lambda: MLP(DIM))
    ref = copy.deepcopy(model)
    _shard_mlp(impl, model, mesh=mesh)
    calls = [0]

    def double(output: torch.Tensor) -> None:
        calls[0] += 1
        assert output.dtype == torch.float32
        output.mul_(2)

    model.set_all_reduce_hook(double)
    model.in_proj.set_all_reduce_hook(double)
    _train(model, ref, lambda name: world / 2, steps=2)
    return calls


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp", "hsdp"])
def test_all_reduce_hook_sees_reduced_gradients(impl: Impl, hsdp: bool) -> None:
    results = run_threaded(4, _all_reduce_hook, impl.name, hsdp)
    assert results == [[4]] * 4  # two groups, two backwards


def _all_reduce_hook_bad_stream() -> None:
    model = seeded(lambda: MLP(DIM))
    ref = copy.deepcopy(model)
    _shard_mlp(get_impl("fsdp2"), model)
    with pytest.raises(
        TypeError, match=r"stream must be a torch.Stream \(e.g. a torch.cuda.Stream\), got str"
    ):
        model.set_all_reduce_hook(lambda t: t.mul_(2), stream="side")  # type: ignore[arg-type]
    _train(model, ref, lambda name: float(dist.get_world_size()), steps=1)  # refused: no hook runs
    # Any torch.Stream is accepted, as in torch; on the CPU the hook runs in place.
    for module in (model, model.in_proj):
        module.set_all_reduce_hook(lambda t: t.mul_(2), stream=torch.cpu.Stream())
    _train(model, ref, lambda name: float(dist.get_world_size()) / 2, steps=1)


def test_all_reduce_hook_stream_must_be_a_stream() -> None:
    run_threaded(2, _all_reduce_hook_bad_stream)


# ---------------------------------------------------------------------------------------------
# register_fsdp_forward_method
# ---------------------------------------------------------------------------------------------


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(DIM, DIM)
        self.out_proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.in_proj(x)))

    def generate(self, x: torch.Tensor, steps: int = 3) -> torch.Tensor:
        # Calls the pieces directly: the root's forward hooks never run for this method.
        outs = []
        for _ in range(steps):
            x = x + self.out_proj(torch.tanh(self.in_proj(x)))
            outs.append(x)
        return torch.stack(outs)


def _forward_method(impl_name: str) -> None:
    rank = dist.get_rank()
    impl = get_impl(impl_name)
    register = _register_fn(impl_name)
    model = seeded(Generator)
    ref = copy.deepcopy(model)
    impl.fully_shard(model.in_proj)
    impl.fully_shard(model)
    register(model, "generate")
    assert "generate" in model.__dict__  # an instance attribute
    world = dist.get_world_size()
    for step in range(2):
        x = make_input((2, DIM), rank, seed=step)
        out = model.generate(x, steps=3)
        want = ref.generate(x, steps=3)
        torch.testing.assert_close(out, want, **EXACT)
        out.sum().backward()
        want.sum().backward()
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor), f"{name} left unsharded after backward"
        _reduce_grads(ref, lambda name: world)
        _assert_parity(ref, model, grads=True)
        for m in (model, ref):
            with torch.no_grad():
                for p in m.parameters():
                    p.sub_(0.1 * p.grad)
            m.zero_grad()
    # The normal forward still works alongside.
    x = make_input((2, DIM), rank, seed=9)
    torch.testing.assert_close(model(x), ref(x), **TIGHT)


def _register_fn(impl_name: str) -> Callable[[nn.Module, str], None]:
    if impl_name == "fsdp2":
        return _fsdp2().register_fsdp_forward_method
    from torch.distributed.fsdp import register_fsdp_forward_method

    return register_fsdp_forward_method


@pytest.mark.parametrize("world_size", [2])
def test_register_fsdp_forward_method(impl: Impl, world_size: int) -> None:
    run_threaded(world_size, _forward_method, impl.name)


def test_register_fsdp_forward_method_noop_and_missing_name() -> None:
    fsdp2 = _fsdp2()
    plain = Generator()
    fsdp2.register_fsdp_forward_method(plain, "generate")  # not an FSDPModule: silently nothing
    assert "generate" not in plain.__dict__
    fsdp2.register_fsdp_forward_method(plain, "no_such_method")  # nothing to check on a plain module

    def body() -> None:
        model = seeded(Generator)
        fsdp2.fully_shard(model)
        with pytest.raises(ValueError, match="no_such_method"):
            fsdp2.register_fsdp_forward_method(model, "no_such_method")

    run_threaded(2, body)


# ---------------------------------------------------------------------------------------------
# share_comm_ctx
# ---------------------------------------------------------------------------------------------


def _shared_comm_ctx() -> None:
    fsdp2 = _fsdp2()
    impl = get_impl("fsdp2")
    world = dist.get_world_size()
    stage0, stage1 = seeded(lambda: MLP(DIM)), seeded(lambda: MLP(DIM))
    ref0, ref1 = copy.deepcopy(stage0), copy.deepcopy(stage1)
    _shard_mlp(impl, stage0)
    _shard_mlp(impl, stage1)
    fsdp2.share_comm_ctx([stage0, stage1])
    assert stage0._get_fsdp_state().comm_ctx is stage1._get_fsdp_state().comm_ctx
    params = list(stage0.parameters()) + list(stage1.parameters())
    ref_params = list(ref0.parameters()) + list(ref1.parameters())
    optim, ref_optim = torch.optim.SGD(params, lr=0.1), torch.optim.SGD(ref_params, lr=0.1)
    rank = dist.get_rank()
    for step in range(3):
        x = make_input((3, DIM), rank, seed=step)
        # Two roots, one after the other (pipeline stages on one rank).
        stage1(stage0(x)).sum().backward()
        ref1(ref0(x)).sum().backward()
        _reduce_grads(ref0, lambda name: world)
        _reduce_grads(ref1, lambda name: world)
        _assert_parity(ref0, stage0, grads=True)
        _assert_parity(ref1, stage1, grads=True)
        step_all(optim, ref_optim)
    shared = stage0._get_fsdp_state().comm_ctx
    for stage in (stage0, stage1):
        for module in stage.modules():
            if isinstance(module, fsdp2.FSDPModule):
                assert module._get_fsdp_state().comm_ctx is shared, type(module).__name__
    _assert_parity(ref0, stage0, grads=False)
    _assert_parity(ref1, stage1, grads=False)


@pytest.mark.parametrize("world_size", [2])
def test_share_comm_ctx_two_roots(world_size: int) -> None:
    run_threaded(world_size, _shared_comm_ctx)


def test_share_comm_ctx_rejects_non_fsdp_module() -> None:
    fsdp2 = _fsdp2()
    fsdp2.share_comm_ctx([])  # empty: nothing to do

    def body() -> None:
        model = seeded(lambda: MLP(DIM))
        fsdp2.fully_shard(model)
        with pytest.raises(ValueError, match="FSDPModule"):
            fsdp2.share_comm_ctx([model, nn.Linear(2, 2)])

    run_threaded(2, body)


# ---------------------------------------------------------------------------------------------
# set_post_optim_event
# ---------------------------------------------------------------------------------------------


def _post_optim_event() -> None:
    impl = get_impl("fsdp2")
    world = dist.get_world_size()
    model = seeded(lambda: MLP(DIM))
    ref = copy.deepcopy(model)
    _shard_mlp(impl, model)
    # A CPU event cannot be recorded; FSDP on CPU must accept it and not use it.
    _train(
        model,
        ref,
        lambda name: world,
        steps=3,
        before_step=lambda m: m.set_post_optim_event(torch.Event("cpu")),
    )


@pytest.mark.parametrize("world_size", [2])
def test_set_post_optim_event_is_a_noop_on_cpu(world_size: int) -> None:
    run_threaded(world_size, _post_optim_event)


# ---------------------------------------------------------------------------------------------
# Clear errors
# ---------------------------------------------------------------------------------------------


def _replicate_exclusive() -> None:
    from torch.distributed._composable import replicate

    fsdp2 = _fsdp2()
    replicated = seeded(lambda: MLP(DIM))
    replicate(replicated)
    with pytest.raises(ValueError, match=r"replicate"):
        fsdp2.fully_shard(replicated)
    for name, param in replicated.named_parameters():
        assert not isinstance(param, DTensor), f"{name} sharded by a failed fully_shard"

    sharded = seeded(lambda: MLP(DIM))
    fsdp2.fully_shard(sharded)
    with pytest.raises(RuntimeError, match=r"already managed by `fully_shard`"):
        replicate(sharded)


def test_replicate_and_fully_shard_are_exclusive() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # replicate's own deprecation notice
        run_threaded(2, _replicate_exclusive)


def _prefetch_other_root() -> None:
    impl = get_impl("fsdp2")
    first, second = seeded(lambda: MLP(DIM)), seeded(lambda: MLP(DIM))
    _shard_mlp(impl, first)
    _shard_mlp(impl, second)
    first.in_proj.set_modules_to_forward_prefetch([second.in_proj])  # accepted when set
    with pytest.raises(ValueError, match=r"(?is)prefetch.*root"):
        first(make_input((2, DIM), dist.get_rank()))


def test_forward_prefetch_of_another_roots_module_raises_at_first_forward() -> None:
    run_threaded(2, _prefetch_other_root)


def _optimizer_after_no_grad_forward() -> None:
    rank = dist.get_rank()
    world = dist.get_world_size()
    impl = get_impl("fsdp2")
    model = seeded(lambda: MLP(DIM))
    ref = copy.deepcopy(model)
    _shard_mlp(impl, model)
    with torch.no_grad():
        out = model(make_input((2, DIM), rank))
    torch.testing.assert_close(out, ref(make_input((2, DIM), rank)), **EXACT)
    # A no-grad forward has no backward to reshard in: the root reshards right away, so an
    # optimizer built now holds the sharded parameters (the ones training updates).
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{name}: {type(param)} after a no_grad forward"
    _train(model, ref, lambda name: world, steps=2)


@pytest.mark.parametrize("world_size", [2])
def test_optimizer_built_after_no_grad_forward_holds_sharded_params(world_size: int) -> None:
    run_threaded(world_size, _optimizer_after_no_grad_forward)


def _params_on_other_device() -> None:
    fsdp2 = _fsdp2()
    model = nn.Linear(4, 4).to("cuda")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with pytest.raises(ValueError, match=r"(?i)cuda.*cpu|cpu.*cuda"):
        fsdp2.fully_shard(model, mesh=mesh)
    assert not isinstance(model.weight, DTensor)  # a failed fully_shard changes nothing


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs parameters on an accelerator")
def test_params_on_another_device_than_the_mesh_raises() -> None:
    # CPU-only machines cannot build a mesh/parameter device mismatch that matters (CPU parameters
    # are simply moved to the mesh's device), so this check runs only where CUDA exists.
    run_threaded(2, _params_on_other_device)
