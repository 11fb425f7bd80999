"""``torch.nn.utils.clip_grad_norm_`` over sharded DTensor gradients, threads as ranks.

The total norm over the sharded gradients must equal the norm of the unsharded reference's
averaged gradients (2-norm and inf-norm), and the clipped gradients must drive the optimizer to
the same parameters. SGD is used because, unlike Adam, it is sensitive to the gradient scale,
so clipping that went wrong shows up in the parameters.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import fsdp2
from tests._harness import broadcast_module_, run_threaded
from tests._impls import Impl, get_impl
from tests._training import seeded, step_all
from tests.models import ModelArgs, Transformer, make_tokens

# max_seq_len 8: every dim 0 splits into non-empty shards over 4 ranks. torch's inf-norm cannot
# reduce an empty local shard (``_foreach_norm`` has no identity for max), whichever FSDP made it.
TF_ARGS = ModelArgs(n_layers=2, max_seq_len=8)
UNEVEN_ARGS = ModelArgs(n_layers=2)  # 9 positions over 4 ranks: 3, 3, 3, 0 rows
TIGHT: dict[str, float] = {}


def _norm_value(norm: torch.Tensor) -> torch.Tensor:
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _clip(
    impl_name: str, norm_type: float, mesh_kind: str, args: ModelArgs = TF_ARGS, clipper: str = "torch"
) -> list[float]:
    rank = dist.get_rank()
    impl = get_impl(impl_name)
    mesh = None
    if mesh_kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = seeded(lambda: Transformer(args))
    ref = copy.deepcopy(model)
    world = dist.get_world_size()
    placement = None
    if mesh_kind == "shard1":  # Shard(1) wherever dim 1 divides evenly, Shard(0) elsewhere
        placement = lambda p: Shard(1) if p.ndim == 2 and p.size(1) % world == 0 else None  # noqa: E731
    for layer in model.layers:
        impl.fully_shard(layer, mesh=mesh, shard_placement_fn=placement)
    impl.fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    norms = []
    for step in range(2):  # clipped at the initial parameters, then at once-clipped-and-stepped ones
        tokens = make_tokens(args, 100 * step + rank)
        model(tokens).mean().backward()
        ref(tokens).mean().backward()
        for param in ref.parameters():
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
        ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], norm_type)
        max_norm = 0.25 * ref_norm.item()  # always clips
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type=norm_type)
        clip = fsdp2.clip_grad_norm_ if clipper == "fsdp2" else torch.nn.utils.clip_grad_norm_
        got = clip(model.parameters(), max_norm, norm_type=norm_type)
        if clipper == "fsdp2":
            assert type(got) is torch.Tensor  # a plain, replicated scalar
        torch.testing.assert_close(_norm_value(got), want, **TIGHT)
        for (name, param), ref_param in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(
                param.grad.full_tensor(), ref_param.grad, **TIGHT, msg=lambda m, n=name: f"{n} grad: {m}"
            )
        # After clipping, the total norm is max_norm (up to clip_grad_norm_'s epsilon).
        if clipper == "fsdp2":  # an infinite max_norm measures without clipping (empty shards allowed)
            clipped = fsdp2.clip_grad_norm_(model.parameters(), float("inf"), norm_type=norm_type)
        else:
            clipped = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], norm_type)
        torch.testing.assert_close(_norm_value(clipped), torch.tensor(max_norm), rtol=1e-4, atol=1e-6)
        step_all(optim, ref_optim)
        norms.append(want.item())
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(param.full_tensor(), ref_param, **TIGHT, msg=lambda m, n=name: f"{n}: {m}")
    return norms


NORM_TYPES = [pytest.param(2.0, id="l2"), pytest.param(float("inf"), id="inf")]


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("world_size", [2])
def test_clip_grad_norm_matches_reference(impl: Impl, world_size: int, norm_type: float) -> None:
    norms = run_threaded(world_size, _clip, impl.name, norm_type, "fsdp")
    assert all(n == norms[0] for n in norms)  # one global norm, the same on every rank


def test_clip_grad_norm_with_empty_shards(impl: Impl) -> None:
    run_threaded(4, _clip, impl.name, 2.0, "fsdp", UNEVEN_ARGS)


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("mesh_kind", ["hsdp", "shard1"])
def test_clip_grad_norm_other_layouts(impl: Impl, mesh_kind: str, norm_type: float) -> None:
    run_threaded(4, _clip, impl.name, norm_type, mesh_kind)


def _clip_with_frozen(impl_name: str) -> None:
    """Frozen parameters have no gradient: they are skipped, the norm covers the rest."""
    rank = dist.get_rank()
    impl = get_impl(impl_name)
    torch.manual_seed(0)
    model = broadcast_module_(nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3)))
    model[0].weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    impl.fully_shard(model[0])
    impl.fully_shard(model)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    ref(x).sum().backward()
    for param in ref.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    got = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    torch.testing.assert_close(_norm_value(got), want)
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters(), strict=True):
        if ref_param.grad is None:
            assert param.grad is None, name
        else:
            torch.testing.assert_close(
                param.grad.full_tensor(), ref_param.grad, msg=lambda m, n=name: f"{n}: {m}"
            )


@pytest.mark.parametrize("world_size", [2])
def test_clip_grad_norm_skips_frozen(impl: Impl, world_size: int) -> None:
    run_threaded(world_size, _clip_with_frozen, impl.name)


# ---- fsdp2.clip_grad_norm_: local shards, one all-reduce per layout ------------------------------


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize(
    ("mesh_kind", "world_size", "args"),
    [
        pytest.param("fsdp", 2, TF_ARGS, id="fsdp-2"),
        pytest.param("fsdp", 4, UNEVEN_ARGS, id="fsdp-4-empty-shards"),
        pytest.param("hsdp", 4, TF_ARGS, id="hsdp"),
        pytest.param("shard1", 4, TF_ARGS, id="shard1"),
    ],
)
def test_fsdp2_clip_grad_norm_matches_reference(
    impl: Impl, mesh_kind: str, world_size: int, args: ModelArgs, norm_type: float
) -> None:
    # fsdp2's clip reads only .grad, so it serves torch's fully_shard models as well.
    norms = run_threaded(world_size, _clip, impl.name, norm_type, mesh_kind, args, "fsdp2")
    assert all(n == norms[0] for n in norms)


def _nonfinite() -> None:
    model = seeded(lambda: nn.Linear(4, 4))
    fsdp2.fully_shard(model)
    model(torch.ones(2, 4)).sum().backward()
    model.weight.grad.to_local().fill_(float("nan"))
    with pytest.raises(RuntimeError, match=r"non-finite"):
        fsdp2.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    assert torch.isnan(fsdp2.clip_grad_norm_(model.parameters(), 1.0))


def test_fsdp2_clip_grad_norm_nonfinite() -> None:
    run_threaded(2, _nonfinite)
