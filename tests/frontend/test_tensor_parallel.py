"""fully_shard over tensor-parallel (DTensor) parameters: 2-D (dp, tp) and 3-D HSDP + TP meshes.

Every case applies TP with ``parallelize_module`` (column-wise, row-wise, sequence-parallel norms)
over ``mesh["tp"]``, then ``fully_shard`` over the data-parallel dims, and trains a few AdamW steps.
The reference is the plain unsharded model on each data-parallel rank's input, gradients averaged
over all ranks (TP ranks of one data-parallel rank see the same input). Checked: losses every step,
gradients after the first backward and parameters at the end (``full_tensor()``), the sharded
parameters' placements against torch's ``fully_shard`` given the same model, state dicts (plain and
full via DCP helpers), ``clip_grad_norm_``, FSDP on dim 1 of the TP matrices (``shard_placement_fn``) and
the errors.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import fsdp2
from tests._harness import run_threaded
from tests._impls import get_impl
from tests._training import TIGHT, mp_policy, seeded

DIM = 8
TP = 2


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Attention(nn.Module):
    def __init__(self, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Under column-wise TP each rank holds heads / tp heads: -1 lets the local width decide.
        q, k, v = (
            w(x).view(b, t, -1, DIM // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.wo(y.transpose(1, 2).reshape(b, t, -1))


class Model(nn.Module):
    def __init__(self, attention: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Attention() if attention else FeedForward(), FeedForward()])
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _tp_plan(layer: nn.Module) -> dict[str, Any]:
    if isinstance(layer, Attention):
        return {
            "wq": ColwiseParallel(),
            "wk": ColwiseParallel(),
            "wv": ColwiseParallel(),
            "wo": RowwiseParallel(),
        }
    return {"up": ColwiseParallel(), "down": RowwiseParallel()}


def _build_mesh(shape: str) -> tuple[DeviceMesh, DeviceMesh, int]:
    """The data-parallel mesh for fully_shard, the TP mesh, and this rank's data-parallel index."""
    if shape == "2d":
        mesh = init_device_mesh("cpu", (dist.get_world_size() // TP, TP), mesh_dim_names=("dp", "tp"))
        return mesh["dp"], mesh["tp"], mesh.get_local_rank("dp")
    mesh = init_device_mesh(
        "cpu", (2, dist.get_world_size() // (2 * TP), TP), mesh_dim_names=("rep", "shard", "tp")
    )
    dp_index = mesh.get_local_rank("rep") * mesh.size(1) + mesh.get_local_rank("shard")
    return mesh["rep", "shard"], mesh["tp"], dp_index


def _parallelize(impl_name: str, model: Model, shape: str, **kwargs: Any) -> int:
    impl = get_impl(impl_name)
    dp_mesh, tp_mesh, dp_index = _build_mesh(shape)
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, _tp_plan(layer))
    for layer in model.layers:
        impl.fully_shard(layer, mesh=dp_mesh, **kwargs)
    impl.fully_shard(model, mesh=dp_mesh, **kwargs)
    return dp_index


def _input(dp_index: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * dp_index + step)
    return torch.randn(2, 4, DIM, generator=gen)


def _assert_full_equal(ref: nn.Module, model: nn.Module, *, grads: bool, tol: dict[str, float]) -> None:
    for (name, ref_param), param in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert isinstance(param, DTensor), name
        pairs = [(ref_param, param)] + ([(ref_param.grad, param.grad)] if grads else [])
        for ref_t, t in pairs:
            assert isinstance(t, DTensor), f"{name}: {type(t)}"
            torch.testing.assert_close(t.full_tensor(), ref_t, **tol, msg=lambda m, n=name: f"{n}: {m}")


def _shard_matrices_on_dim1(param: nn.Parameter) -> Shard | None:
    return Shard(1) if param.ndim == 2 else None


def _train(
    impl_name: str,
    shape: str,
    attention: bool,
    bf16: bool,
    accumulate: bool = False,
    base: Any = None,
    dim1: bool = False,
) -> list[float]:
    ref = copy.deepcopy(base) if base is not None else seeded(lambda: Model(attention))
    model = copy.deepcopy(ref)
    kwargs: dict[str, Any] = {"shard_placement_fn": _shard_matrices_on_dim1} if dim1 else {}
    if bf16:
        kwargs["mp_policy"] = mp_policy(get_impl(impl_name), param_dtype=torch.bfloat16)
        ref_compute = copy.deepcopy(ref).to(torch.bfloat16)
    dp_index = _parallelize(impl_name, model, shape, **kwargs)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    tol = {"rtol": 4e-2, "atol": 4e-2} if bf16 else TIGHT  # bf16: 8 mantissa bits, three AdamW steps
    losses = []
    for step in range(3):
        x = _input(dp_index, step)
        if accumulate:  # a no-sync microbatch first: TP gradients accumulate unsharded
            model.set_requires_gradient_sync(False)
            model(x * 0.5).sum().backward()
            ref(x * 0.5).sum().backward()
            model.set_requires_gradient_sync(True)
        loss = model(x).sum()
        loss.backward()
        if bf16:  # the reference computes in bf16 too, from its fp32 master weights
            ref_compute.load_state_dict(ref.state_dict())
            ref_loss = ref_compute(x.to(torch.bfloat16)).sum()
            ref_loss.backward()
            for p, p_compute in zip(ref.parameters(), ref_compute.parameters(), strict=True):
                p.grad = p_compute.grad.float()
                p_compute.grad = None
        else:
            ref_loss = ref(x).sum()
            ref_loss.backward()
        torch.testing.assert_close(loss.float(), ref_loss.float(), **tol)
        for p in ref.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        if step == 0:
            _assert_full_equal(ref, model, grads=True, tol=tol)
        for o in (optim, ref_optim):
            o.step()
            o.zero_grad()
        losses.append(loss.item())
    _assert_full_equal(ref, model, grads=False, tol=tol)
    return losses


@pytest.mark.parametrize("impl_name", ["fsdp2", "torch"])
@pytest.mark.parametrize(
    ("shape", "world_size", "attention", "bf16"),
    [
        pytest.param("2d", 4, False, False, id="2x2-mlp"),
        pytest.param("2d", 4, True, False, id="2x2-attention"),
        pytest.param("2d", 4, True, True, id="2x2-attention-bf16"),
    ],
)
def test_tensor_parallel_trains_like_the_reference(
    impl_name: str, shape: str, world_size: int, attention: bool, bf16: bool
) -> None:
    torch.manual_seed(0)  # built here: seeding inside the rank threads races on the global RNG
    run_threaded(world_size, _train, impl_name, shape, attention, bf16, False, Model(attention))


def _train_torch_then_fsdp2(*args: Any) -> list[list[float]]:
    return [_train(impl_name, *args) for impl_name in ("torch", "fsdp2")]


@pytest.mark.slow
def test_tensor_parallel_3d_trains_like_the_reference() -> None:
    """(rep 2, shard 2, tp 2): torch's fully_shard, then fsdp2, each against the reference, in the
    same rank threads. DTensor caches its sharding propagation per thread, by op and specs, and fills
    it slowly over a 3-D mesh: fsdp2's run finds what torch's identical ops computed."""
    torch.manual_seed(0)  # built here: seeding inside the rank threads races on the global RNG
    run_threaded(8, _train_torch_then_fsdp2, "3d", True, False, False, Model(True))


@pytest.mark.parametrize("impl_name", ["fsdp2", "torch"])
def test_tensor_parallel_gradient_accumulation(impl_name: str) -> None:
    run_threaded(4, _train, impl_name, "2d", True, False, True)


@pytest.mark.slow
def test_tensor_parallel_with_fsdp_on_dim1_trains_like_the_reference_and_torch() -> None:
    """``shard_placement_fn`` -> ``Shard(1)`` for the TP matrices: FSDP splits their TP-local columns."""
    torch.manual_seed(0)
    base = Model(True)
    ours = run_threaded(4, _train, "fsdp2", "2d", True, False, False, base, True)
    theirs = run_threaded(4, _train, "torch", "2d", True, False, False, base, True)
    assert ours == theirs  # losses, bit for bit


def _placements(impl_name: str, shape: str, dim1: bool = False) -> dict[str, Any]:
    model = seeded(lambda: Model(True))
    _parallelize(impl_name, model, shape, **({"shard_placement_fn": _shard_matrices_on_dim1} if dim1 else {}))
    out = {}
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor)
        out[name] = (str(param.placements), tuple(param.device_mesh.shape), tuple(param.to_local().shape))
    return out


@pytest.mark.parametrize(("shape", "world_size"), [("2d", 4), ("3d", 8)])
def test_placements_match_torch(shape: str, world_size: int) -> None:
    ours = run_threaded(world_size, _placements, "fsdp2", shape)
    theirs = run_threaded(world_size, _placements, "torch", shape)
    assert ours == theirs
    if shape == "2d":  # column-wise weights strided, row-wise weights plain Shard(0)
        assert ours[0]["layers.0.wq.weight"][0] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
        assert ours[0]["layers.0.wo.weight"][0] == "(Shard(dim=0), Shard(dim=1))"


def test_placements_with_fsdp_on_dim1_match_torch() -> None:
    ours = run_threaded(4, _placements, "fsdp2", "2d", True)
    theirs = run_threaded(4, _placements, "torch", "2d", True)
    assert ours == theirs
    # FSDP on dim 1: plain on a column-wise weight, strided where TP splits dim 1 too (row-wise)
    assert ours[0]["layers.0.wq.weight"][0] == "(Shard(dim=1), Shard(dim=0))"
    assert ours[0]["layers.0.wo.weight"][0] == "(_StridedShard(dim=1, sf=2), Shard(dim=1))"


def _state_dicts_and_clipping(dim1: bool) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    ref = seeded(lambda: Model(True))
    model = copy.deepcopy(ref)
    dp_index = _parallelize(
        "fsdp2", model, "2d", **({"shard_placement_fn": _shard_matrices_on_dim1} if dim1 else {})
    )
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert full.keys() == ref.state_dict().keys()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    sharded = model.state_dict()
    assert all(isinstance(v, DTensor) for v in sharded.values())
    # Loading the sharded state dict back is the identity, and so is loading the full plain tensors
    # (each rank keeps its TP chunk's FSDP chunk); training still matches afterwards.
    model.load_state_dict(sharded)
    model.load_state_dict(full)
    _assert_full_equal(ref, model, grads=False, tol={"rtol": 0.0, "atol": 0.0})
    x = _input(dp_index, 0)
    model(x).sum().backward()
    ref(x).sum().backward()
    for p in ref.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    # torch's clip_grad_norm_ needs one mesh for all DTensors: clip the 2-D (tensor-parallel) ones.
    two_d = [i for i, p in enumerate(model.parameters()) if p.device_mesh.ndim == 2]
    assert len(two_d) == 8  # attention (4) and feed-forward (up weight + bias, down weight + bias)
    norm = torch.nn.utils.clip_grad_norm_([list(model.parameters())[i] for i in two_d], max_norm=0.5)
    ref_norm = torch.nn.utils.clip_grad_norm_([list(ref.parameters())[i] for i in two_d], max_norm=0.5)
    torch.testing.assert_close(norm.full_tensor() if isinstance(norm, DTensor) else norm, ref_norm, **TIGHT)
    _assert_full_equal(ref, model, grads=True, tol=TIGHT)
    # fsdp2.clip_grad_norm_ takes every parameter, 2-D and 1-D meshes mixed.
    norm = fsdp2.clip_grad_norm_(model.parameters(), max_norm=0.1)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.1)
    torch.testing.assert_close(norm, ref_norm, **TIGHT)
    _assert_full_equal(ref, model, grads=True, tol=TIGHT)


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("dim1", [False, True], ids=["fsdp-dim0", "fsdp-dim1"])
def test_state_dicts_and_clip_grad_norm_over_2d_parameters(dim1: bool) -> None:
    run_threaded(4, _state_dicts_and_clipping, dim1)


def _errors() -> None:
    fsdp2 = get_impl("fsdp2")
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    other = init_device_mesh("cpu", (8,), mesh_dim_names=("all",))

    def tp_layer() -> FeedForward:
        layer = FeedForward()
        parallelize_module(layer, mesh["tp"], _tp_plan(layer))
        return layer

    layer = tp_layer()
    weight = layer.up.weight
    with pytest.raises(ValueError, match=r"not a slice of the same root mesh"):
        fsdp2.fully_shard(layer, mesh=other)
    with pytest.raises(NotImplementedError, match=r"reshard_after_forward=2 \(an int\)"):
        fsdp2.fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=2)
    odd = nn.Sequential(nn.Linear(6, 8))  # column-wise: a TP-local weight of (4, 6), 6 columns over 4 ranks
    parallelize_module(odd, mesh["tp"], {"0": ColwiseParallel()})
    with pytest.raises(NotImplementedError, match=r"local size on dim 1 \(6\) to be divisible by .* 4"):
        fsdp2.fully_shard(odd, mesh=mesh["dp"], shard_placement_fn=_shard_matrices_on_dim1)
    assert not isinstance(odd, fsdp2.FSDPModule)
    assert not isinstance(layer, fsdp2.FSDPModule)
    assert layer.up.weight is weight
    fsdp2.fully_shard(layer, mesh=mesh["dp"])  # the failed calls can be retried with good arguments
    assert layer.up.weight.placements[1] == Shard(0)
    assert layer.norm.weight.placements == (Shard(0),)  # not tensor parallel: plain FSDP


def test_tensor_parallel_errors() -> None:
    run_threaded(8, _errors)


def _dcp_round_trip(path: str) -> None:
    import torch.distributed.checkpoint as dcp

    ref = seeded(lambda: Model(True))
    model = copy.deepcopy(ref)
    dp_index = _parallelize("fsdp2", model, "2d")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(_input(dp_index, 0)).sum().backward()
    optim.step()
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    # A fresh 2-D model (other initial values) loads it back: equal parameters and equal next losses.
    other = seeded(lambda: Model(True))
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-1.0)
    _parallelize("fsdp2", other, "2d")
    state = {"model": other.state_dict()}
    dcp.load(state, checkpoint_id=path)
    other.load_state_dict(state["model"])
    for (name, p), q in zip(model.named_parameters(), other.parameters(), strict=True):
        assert q.placements == p.placements, name
        torch.testing.assert_close(q.full_tensor(), p.full_tensor(), rtol=0, atol=0, msg=name)
    x = _input(dp_index, 1)
    torch.testing.assert_close(other(x).sum(), model(x).sum(), rtol=0, atol=0)


@pytest.mark.slow
def test_dcp_save_and_load_of_2d_parameters(tmp_path: Any) -> None:
    run_threaded(4, _dcp_round_trip, str(tmp_path / "ckpt"))
