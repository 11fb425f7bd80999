"""Training parity of sharded models against an unsharded reference, threads as ranks.

The reference is a copy of the same model, unsharded, run on the same per-rank inputs; its
gradients are averaged over ranks with an all-reduce before the optimizer step, which is what
FSDP's reduce-scatter computes shard by shard. Losses must agree every step (bit for bit while
the parameters are still the initial ones), gradients after the first backward, and parameters
after the last step. A differential test also compares against torch's own ``fully_shard``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import assert_sharded_parity, run_threaded
from tests._impls import Impl, shard_blocks_then_root, torch_impl
from tests._training import EXACT, TIGHT, average_grads, forward_backward, seeded, step_all
from tests.models import MLP, ModelArgs, Transformer, make_input, make_tokens

Inputs = Callable[[int, int], torch.Tensor]  # (rank, call index) -> input


@dataclass(frozen=True)
class Model:
    """How to build, shard and feed one model; ``build`` runs after ``torch.manual_seed``."""

    build: Callable[[], nn.Module]
    shard: Callable[[Impl, nn.Module, Any], None]  # (impl, model, reshard_after_forward)
    inputs: Inputs


@dataclass(frozen=True)
class Recipe:
    """The training loop: ``steps`` optimizer steps, each over ``microbatches`` backwards,
    each backward over the sum of ``forwards`` forward losses."""

    steps: int = 3  # the first step (bit for bit), a second with optimizer state, a third on top
    microbatches: int = 1
    forwards: int = 1
    set_to_none: bool = True
    optimizer: Callable[..., torch.optim.Optimizer] = field(default=partial(torch.optim.AdamW, lr=1e-2))


def _shard_mlp(impl: Impl, model: nn.Module, raf: Any) -> None:
    shard_blocks_then_root(impl, model, [model.in_proj, model.out_proj], reshard_after_forward=raf)


def _shard_transformer(impl: Impl, model: nn.Module, raf: Any) -> None:
    shard_blocks_then_root(impl, model, model.layers, reshard_after_forward=raf)


def _shard_each_child(impl: Impl, model: nn.Module, raf: Any) -> None:
    children = [m for m in model.children() if any(True for _ in m.parameters())]
    shard_blocks_then_root(impl, model, children, reshard_after_forward=raf)


MLP_DIM = 13  # uneven: out_proj.weight is (13, 52)
TRANSFORMER_ARGS = ModelArgs(n_layers=2)

MLP_MODEL = Model(
    build=lambda: MLP(MLP_DIM),
    shard=_shard_mlp,
    inputs=lambda rank, i: make_input((3, MLP_DIM), rank, seed=i),
)
TRANSFORMER_MODEL = Model(
    build=lambda: Transformer(TRANSFORMER_ARGS),
    shard=_shard_transformer,
    inputs=lambda rank, i: make_tokens(TRANSFORMER_ARGS, 100 * i + rank),
)
AC_ARGS = ModelArgs(n_layers=2, checkpoint_activations=True)
UNEVEN_MODEL = Model(
    # Every dim 0 is small: (5, 3) over 4 ranks is 2,2,1,0 rows; (3, 5) is 1,1,1,0; (1, 3) is 1,0,0,0.
    build=lambda: nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 1)),
    shard=_shard_each_child,
    inputs=lambda rank, i: make_input((4, 3), rank, seed=i),
)


def _make_pair(impl: Impl, spec: Model, raf: Any) -> tuple[nn.Module, nn.Module]:
    model = seeded(spec.build)
    ref = copy.deepcopy(model)
    spec.shard(impl, model, raf)
    return ref, model


def train_against_reference(
    impl: Impl,
    spec: Model,
    raf: Any,
    recipe: Recipe,
    configure: Callable[[nn.Module], None] | None = None,
) -> list[float]:
    """Train the sharded model and its reference side by side; returns this rank's losses."""
    rank = dist.get_rank()
    ref, model = _make_pair(impl, spec, raf)
    if configure is not None:
        configure(model)
    ref_optim, optim = recipe.optimizer(ref.parameters()), recipe.optimizer(model.parameters())
    losses = []
    for step in range(recipe.steps):
        for micro in range(recipe.microbatches):
            xs = [spec.inputs(rank, 1000 * step + 10 * micro + f) for f in range(recipe.forwards)]
            ref_loss = sum(ref(x).sum() for x in xs)
            ref_loss.backward()
            loss = sum(model(x).sum() for x in xs)
            loss.backward()
            # Until the first optimizer step both models hold identical parameters.
            torch.testing.assert_close(loss, ref_loss, **(EXACT if step == 0 else TIGHT))
            losses.append(loss.item())
        average_grads(ref)
        if step == 0:
            assert_sharded_parity(ref, model, grads=True)
        step_all(ref_optim, optim, set_to_none=recipe.set_to_none)
    assert_sharded_parity(ref, model)
    return losses


def _assert_ranks_differ(losses: list[list[float]]) -> None:
    # Guards the test itself: per-rank inputs must differ, or averaging would prove nothing.
    assert len({tuple(r) for r in losses}) == len(losses)


# ---------------------------------------------------------------------------------------------
# The main matrix: model x reshard_after_forward (at world 2; the int at 4)
# ---------------------------------------------------------------------------------------------

# Every value at world 2 (uneven shards there too: vocab 37, 9 positions, out_proj's 13 rows); the int
# value needs 4. Shards of no rows (dim 0 smaller than the world) are test_uneven_shapes's, at 4.
MATRIX = [pytest.param(ws, raf, id=f"ws{ws}-{raf}") for ws, raf in [(2, None), (2, True), (2, False), (4, 2)]]


@pytest.mark.parametrize(
    "spec", [pytest.param(MLP_MODEL, id="mlp"), pytest.param(TRANSFORMER_MODEL, id="transformer")]
)
@pytest.mark.parametrize(("world_size", "raf"), MATRIX)
def test_parity(impl: Impl, spec: Model, world_size: int, raf: Any) -> None:
    losses = run_threaded(world_size, train_against_reference, impl, spec, raf, Recipe())
    _assert_ranks_differ(losses)


@pytest.mark.parametrize("world_size", [2, 4])
def test_uneven_shapes(impl: Impl, world_size: int) -> None:
    run_threaded(world_size, train_against_reference, impl, UNEVEN_MODEL, True, Recipe())


# ---------------------------------------------------------------------------------------------
# Variations of the training loop
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2])
def test_grad_accumulation_without_set_to_none(impl: Impl, world_size: int) -> None:
    """Two backwards per step accumulate into the sharded grads; zero_grad keeps them allocated."""
    recipe = Recipe(steps=3, microbatches=2, set_to_none=False)
    run_threaded(world_size, train_against_reference, impl, MLP_MODEL, True, recipe)


@pytest.mark.parametrize("raf", [None, True, False])
def test_multiple_forwards_one_backward(impl: Impl, raf: Any) -> None:
    recipe = Recipe(steps=3, forwards=2)
    run_threaded(2, train_against_reference, impl, TRANSFORMER_MODEL, raf, recipe)


def _shard_transformer_composable_ac(impl: Impl, model: nn.Module, raf: Any) -> None:
    shard_blocks_then_root(impl, model, model.layers, reshard_after_forward=raf, composable_checkpoint=True)


AC_MODELS = [
    pytest.param(
        Model(lambda: Transformer(AC_ARGS), _shard_transformer, TRANSFORMER_MODEL.inputs), id="utils"
    ),
    pytest.param(
        Model(TRANSFORMER_MODEL.build, _shard_transformer_composable_ac, TRANSFORMER_MODEL.inputs),
        id="composable",
    ),
]


@pytest.mark.parametrize("raf", [True, False])
@pytest.mark.parametrize("spec", AC_MODELS)
def test_activation_checkpointing(impl: Impl, spec: Model, raf: Any) -> None:
    run_threaded(2, train_against_reference, impl, spec, raf, Recipe(steps=3))


def _misprefetch_in_proj_to_out_proj(model: nn.Module) -> None:
    # Backward runs out_proj before in_proj, so out_proj is no longer needed when in_proj's
    # hook prefetches it: the all-gather is wasted but must not change any number.
    model.in_proj.set_modules_to_backward_prefetch([model.out_proj])


@pytest.mark.parametrize("world_size", [2])
def test_backward_misprefetch(impl: Impl, world_size: int) -> None:
    recipe = Recipe(steps=3, optimizer=partial(torch.optim.Adam, lr=1e-2))
    run_threaded(
        world_size, train_against_reference, impl, MLP_MODEL, None, recipe, _misprefetch_in_proj_to_out_proj
    )


# ---------------------------------------------------------------------------------------------
# Differential: the implementation under test against torch's fully_shard
# ---------------------------------------------------------------------------------------------


def _differential(impl: Impl, raf: Any, steps: int) -> None:
    rank = dist.get_rank()
    ours = seeded(TRANSFORMER_MODEL.build)
    theirs = copy.deepcopy(ours)
    _shard_transformer(impl, ours, raf)
    _shard_transformer(torch_impl(), theirs, raf)
    our_optim = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    their_optim = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    for step in range(steps):
        x = TRANSFORMER_MODEL.inputs(rank, step)
        our_loss, their_loss = forward_backward(x, ours, theirs)
        # Same collectives over the same buffer layout: identical numbers are expected.
        torch.testing.assert_close(our_loss, their_loss, **EXACT)
        step_all(our_optim, their_optim)
    for (name, ours_p), (their_name, theirs_p) in zip(
        ours.named_parameters(), theirs.named_parameters(), strict=True
    ):
        assert name == their_name
        torch.testing.assert_close(
            ours_p.full_tensor(), theirs_p.full_tensor(), **EXACT, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize(
    ("world_size", "raf"),
    [
        pytest.param(2, None, id="ws2-None"),
        pytest.param(4, True, id="ws4-True"),
        pytest.param(4, 2, id="ws4-2"),
    ],
)
def test_differential_against_reference_impl(impl: Impl, world_size: int, raf: Any) -> None:
    run_threaded(world_size, _differential, impl, raf, 4)
