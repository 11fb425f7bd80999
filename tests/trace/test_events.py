"""Unshard / reshard / post-backward event order, for fsdp2 and torch alike.

Each case builds a model on every rank, records the calling rank's events per phase
(forward, backward) over a few iterations with optimizer steps in between, and compares every
rank's phases with the sequences written out here, event for event; torch 2.13's ``fully_shard``
runs every case too, so they are torch's sequences. The sequences do not depend on the
world size, so most cases run on 2 ranks; ``reshard_after_forward=2`` needs 4.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._harness import run_threaded
from tests._impls import Event, Impl, shard_blocks_then_root
from tests._training import seeded
from tests.models import DoubleLinear, ModelArgs, Transformer, make_input, make_tokens

F, PB, POST = "FORWARD", "PRE_BACKWARD", "POST_BACKWARD"
UNSHARD_ONLY = ("unshard",)
UNSHARD_AND_POST_BACKWARD = ("unshard", "post_backward")
ALL_KINDS = ("unshard", "reshard", "post_backward")


def U(fqn: str, state: str) -> Event:
    return ("unshard", fqn, state)


def R(fqn: str, state: str) -> Event:
    return ("reshard", fqn, state)


def P(fqn: str) -> Event:
    return ("post_backward", fqn, POST)


def L(i: int) -> str:
    return f"layers.{i}"


def blocks_backward(n_blocks: int, *, with_reshard: bool) -> list[Event]:
    """Blocks' backward with default prefetch: each block's hook unshards the block below it
    before its own post-backward, so every unshard shows up one step early (the default backward
    prefetch: docs/design.md, "Prefetch")."""
    events = [U(L(n_blocks - 1), PB)]
    for i in reversed(range(n_blocks)):
        if i > 0:
            events.append(U(L(i - 1), PB))
        if with_reshard:
            events.append(R(L(i), POST))
        events.append(P(L(i)))
    return events


Phases = list[tuple[str, list[Event]]]


def assert_phases(results: Sequence[Phases], expected: Phases) -> None:
    for rank, phases in enumerate(results):
        assert [name for name, _ in phases] == [name for name, _ in expected], f"rank {rank}"
        for (name, got), (_, want) in zip(phases, expected, strict=True):
            assert got == want, f"rank {rank}, phase {name!r}"


def _build_transformer(
    impl: Impl, n_layers: int, raf: bool | int | None, ac: str | None
) -> tuple[nn.Module, Any]:
    args = ModelArgs(n_layers=n_layers, checkpoint_activations=(ac == "utils"))
    model = seeded(lambda: Transformer(args))
    shard_blocks_then_root(
        impl, model, model.layers, reshard_after_forward=raf, composable_checkpoint=(ac == "composable")
    )
    return model, make_tokens(args, dist.get_rank())


def _train_and_record(
    impl: Impl,
    model: nn.Module,
    iters: int,
    step: Callable[[], dict[str, list[Event]] | None],
) -> Phases:
    """Run ``step`` ``iters`` times under one recorder; ``step`` returns its phases' events."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    phases: Phases = []
    for it in range(iters):
        result = step()
        assert result is not None
        phases.extend((f"iter{it}/{name}", events) for name, events in result.items())
        optim.step()
        optim.zero_grad(set_to_none=(it % 2 == 0))
    return phases


def _record_forward_backward(
    impl: Impl, model: nn.Module, inputs: Any, iters: int, kinds_fwd: Sequence[str], kinds_bwd: Sequence[str]
) -> Phases:
    """``iters`` iterations of one forward and one backward of ``model(inputs).sum()``, recording
    the ``kinds_fwd`` events of the forward and the ``kinds_bwd`` events of the backward."""
    with impl.record_events() as events:

        def step() -> dict[str, list[Event]]:
            loss = model(inputs).sum()
            fwd = events.take(kinds_fwd)
            loss.backward()
            return {"forward": fwd, "backward": events.take(kinds_bwd)}

        return _train_and_record(impl, model, iters, step)


def _expand(iters: int, per_iter: dict[str, list[Event]]) -> Phases:
    return [(f"iter{it}/{name}", events) for it in range(iters) for name, events in per_iter.items()]


# ---------------------------------------------------------------------------------------------
# A: one forward, one backward (3 blocks + root)
# ---------------------------------------------------------------------------------------------

A_FORWARD = [U("", F), U(L(0), F), U(L(1), F), U(L(2), F)]
A_BACKWARD_NONE = [*blocks_backward(3, with_reshard=False), P("")]
A_BACKWARD = {
    None: A_BACKWARD_NONE,
    True: [U("", PB), *A_BACKWARD_NONE],  # 2.13: an explicit True on the root is honoured
    2: [U("", PB), *A_BACKWARD_NONE],
    False: [P(L(2)), P(L(1)), P(L(0)), P("")],
}

RAF_CASES = [
    pytest.param(2, None, id="ws2-None"),
    pytest.param(2, True, id="ws2-True"),
    pytest.param(2, False, id="ws2-False"),
    pytest.param(4, 2, id="ws4-2"),
]
AC_CASES = [
    pytest.param(None, id="no_ac"),
    pytest.param("utils", id="utils_ac"),
    pytest.param("composable", id="composable_ac"),
]


def _sequence_a(
    impl: Impl, raf: bool | int | None, ac: str | None, kinds_fwd: Sequence[str], kinds_bwd: Sequence[str]
) -> Phases:
    model, tokens = _build_transformer(impl, 3, raf, ac)
    return _record_forward_backward(impl, model, tokens, 3, kinds_fwd, kinds_bwd)


# The sequences do not depend on the world size: every variant runs on 2 ranks, plus the int case,
# which needs 4.
def _a_cases() -> list[Any]:
    cases = []
    for raf_case in RAF_CASES:
        world_size, raf = raf_case.values
        for ac_case in AC_CASES:
            (ac,) = ac_case.values
            if world_size == 2 or raf == 2:
                cases.append(pytest.param(world_size, raf, ac, id=f"{raf_case.id}-{ac_case.id}"))
    return cases


A_CASES = _a_cases()


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize(("world_size", "raf", "ac"), A_CASES)
def test_a_forward_backward(impl: Impl, world_size: int, raf: bool | int | None, ac: str | None) -> None:
    results = run_threaded(world_size, _sequence_a, impl, raf, ac, UNSHARD_ONLY, UNSHARD_AND_POST_BACKWARD)
    assert_phases(results, _expand(3, {"forward": A_FORWARD, "backward": A_BACKWARD[raf]}))


A_WITH_RESHARD_FORWARD = [
    U("", F),
    U(L(0), F),
    R(L(0), F),
    U(L(1), F),
    R(L(1), F),
    U(L(2), F),
    R(L(2), F),
    R("", F),
]
A_WITH_RESHARD_BACKWARD = [U("", PB), *blocks_backward(3, with_reshard=True), R("", POST), P("")]


@pytest.mark.parametrize(
    ("world_size", "raf"), [pytest.param(2, True, id="ws2-True"), pytest.param(4, 2, id="ws4-2")]
)
def test_a_with_reshard_events(impl: Impl, world_size: int, raf: bool | int) -> None:
    results = run_threaded(world_size, _sequence_a, impl, raf, None, ALL_KINDS, ALL_KINDS)
    assert_phases(
        results, _expand(3, {"forward": A_WITH_RESHARD_FORWARD, "backward": A_WITH_RESHARD_BACKWARD})
    )


# ---------------------------------------------------------------------------------------------
# B: two forwards, then one backward through both
# ---------------------------------------------------------------------------------------------

_BLOCKS_FWD = [U(L(0), F), U(L(1), F), U(L(2), F)]
B_FORWARD = {
    None: [U("", F), *_BLOCKS_FWD, *_BLOCKS_FWD],
    True: [U("", F), *_BLOCKS_FWD, U("", F), *_BLOCKS_FWD],
    2: [U("", F), *_BLOCKS_FWD, U("", F), *_BLOCKS_FWD],
    False: [U("", F), *_BLOCKS_FWD],
}
_B_CHAIN = blocks_backward(3, with_reshard=False)
B_BACKWARD = {
    None: [*_B_CHAIN, *_B_CHAIN, P("")],
    True: [U("", PB), *_B_CHAIN, *_B_CHAIN, P("")],
    2: [U("", PB), *_B_CHAIN, *_B_CHAIN, P("")],
    # The first post-backward of each block reshards it, so the second use unshards again.
    False: [P(L(2)), P(L(1)), P(L(0)), *_B_CHAIN, P("")],
}


def _sequence_b(impl: Impl, raf: bool | int | None, ac: str | None) -> Phases:
    model, tokens = _build_transformer(impl, 3, raf, ac)
    with impl.record_events() as events:

        def step() -> dict[str, list[Event]]:
            loss1 = model(tokens).sum()
            loss2 = model(tokens).sum()
            fwd = events.take(UNSHARD_ONLY)
            (loss1 + loss2).backward()
            return {"forward": fwd, "backward": events.take(UNSHARD_AND_POST_BACKWARD)}

        return _train_and_record(impl, model, 2, step)


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("ac", AC_CASES)
@pytest.mark.parametrize(
    ("world_size", "raf"), [p for p in RAF_CASES if p.id.startswith("ws2") or p.id == "ws4-2"]
)
def test_b_multi_forward(impl: Impl, world_size: int, raf: bool | int | None, ac: str | None) -> None:
    results = run_threaded(world_size, _sequence_b, impl, raf, ac)
    assert_phases(results, _expand(2, {"forward": B_FORWARD[raf], "backward": B_BACKWARD[raf]}))


# ---------------------------------------------------------------------------------------------
# C: a path unused in the first backward (Sequential(Linear, DoubleLinear))
# ---------------------------------------------------------------------------------------------

C_PHASES = {
    "forward": [U("0", F), U("1.lin1", F), U("1.lin2", F)],
    # Default prefetch from lin2 targets lin1 (the previous post-forward entry), which this
    # backward never reaches: the all-gather stays pending. lin1's post-backward in the final
    # callback is a no-op.
    "backward_loss2": [U("1.lin2", PB), U("1.lin1", PB), P("1.lin2"), U("0", PB), P("0"), P("1.lin1")],
    # lin1 consumes its pending all-gather (no new unshard), then prefetches 0 again.
    "backward_loss1": [U("0", PB), P("1.lin1"), P("0"), P("1.lin2")],
}


def _sequence_c(impl: Impl) -> Phases:
    dim = 8
    model = seeded(lambda: nn.Sequential(nn.Linear(dim, dim), DoubleLinear(dim)))
    for module in (model[0], model[1].lin1, model[1].lin2, model):
        impl.fully_shard(module, reshard_after_forward=True)
    x = make_input((4, dim), dist.get_rank())
    with impl.record_events() as events:

        def step() -> dict[str, list[Event]]:
            loss1, loss2 = model(x)
            fwd = events.take(UNSHARD_AND_POST_BACKWARD)
            model.set_is_last_backward(False)
            loss2.sum().backward(retain_graph=True)
            bwd2 = events.take(UNSHARD_AND_POST_BACKWARD)
            model.set_is_last_backward(True)
            loss1.sum().backward()
            return {
                "forward": fwd,
                "backward_loss2": bwd2,
                "backward_loss1": events.take(UNSHARD_AND_POST_BACKWARD),
            }

        return _train_and_record(impl, model, 2, step)


def test_c_unused_in_backward(impl: Impl) -> None:
    results = run_threaded(2, _sequence_c, impl)
    assert_phases(results, _expand(2, C_PHASES))


# ---------------------------------------------------------------------------------------------
# D / E: explicit forward / backward prefetch (4 blocks, True, utils checkpointing)
# ---------------------------------------------------------------------------------------------

D_FORWARD = {
    1: [
        U("", F),
        U(L(0), F),
        U(L(1), F),
        R(L(0), F),
        U(L(2), F),
        R(L(1), F),
        U(L(3), F),
        R(L(2), F),
        R(L(3), F),
        R("", F),
    ],
    2: [
        U("", F),
        U(L(0), F),
        U(L(1), F),
        U(L(2), F),
        R(L(0), F),
        U(L(3), F),
        R(L(1), F),
        R(L(2), F),
        R(L(3), F),
        R("", F),
    ],
}
DEFAULT_BACKWARD_4 = [U("", PB), *blocks_backward(4, with_reshard=True), R("", POST), P("")]

E_FORWARD = [
    U("", F),
    U(L(0), F),
    R(L(0), F),
    U(L(1), F),
    R(L(1), F),
    U(L(2), F),
    R(L(2), F),
    U(L(3), F),
    R(L(3), F),
    R("", F),
]
E_BACKWARD = {
    1: DEFAULT_BACKWARD_4,
    # The root still default-prefetches layers.3; layers.3 prefetches 2 and 1; layers.2 finds 1
    # pending and prefetches 0.
    2: [
        U("", PB),
        U(L(3), PB),
        U(L(2), PB),
        U(L(1), PB),
        R(L(3), POST),
        P(L(3)),
        U(L(0), PB),
        R(L(2), POST),
        P(L(2)),
        R(L(1), POST),
        P(L(1)),
        R(L(0), POST),
        P(L(0)),
        R("", POST),
        P(""),
    ],
}


def _sequence_prefetch(impl: Impl, direction: str, n: int) -> Phases:
    model, tokens = _build_transformer(impl, 4, True, "utils")
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        if direction == "forward":
            targets = layers[i + 1 : i + 1 + n]
            if len(targets) == n:
                layer.set_modules_to_forward_prefetch(targets)
        elif i >= n:
            layer.set_modules_to_backward_prefetch([layers[i - j] for j in range(1, n + 1)])
    return _record_forward_backward(impl, model, tokens, 2, ALL_KINDS, ALL_KINDS)


@pytest.mark.parametrize("n", [1, 2])
def test_d_explicit_forward_prefetch(impl: Impl, n: int) -> None:
    results = run_threaded(2, _sequence_prefetch, impl, "forward", n)
    assert_phases(results, _expand(2, {"forward": D_FORWARD[n], "backward": DEFAULT_BACKWARD_4}))


@pytest.mark.parametrize("n", [1, 2])
def test_e_explicit_backward_prefetch(impl: Impl, n: int) -> None:
    results = run_threaded(2, _sequence_prefetch, impl, "backward", n)
    assert_phases(results, _expand(2, {"forward": E_FORWARD, "backward": E_BACKWARD[n]}))


# ---------------------------------------------------------------------------------------------
# F: grouped modules (5 blocks, checkpointing, no weight tying)
# ---------------------------------------------------------------------------------------------

EMB, L12, L34, HEAD = (
    "tok_embeddings, pos_embeddings",
    "layers.1, layers.2",
    "layers.3, layers.4",
    "norm, output",
)
F_PHASES = {
    "forward": [U(EMB, F), U(L(0), F), U(L12, F), U(L34, F), U(HEAD, F)],
    # (norm, output) keeps its parameters after forward, so backward starts without its unshard;
    # the embeddings' inputs are token ids, so their post-backward comes from the final callback.
    "backward": [U(L34, PB), P(HEAD), U(L12, PB), P(L34), U(L(0), PB), P(L12), U(EMB, PB), P(L(0)), P(EMB)],
}


def _sequence_f(impl: Impl) -> Phases:
    args = ModelArgs(n_layers=5, checkpoint_activations=True, weight_tying=False)
    model = seeded(lambda: Transformer(args))
    impl.fully_shard(model.layers[0])
    impl.fully_shard([model.layers[1], model.layers[2]])
    impl.fully_shard([model.layers[3], model.layers[4]])
    impl.fully_shard([model.tok_embeddings, model.pos_embeddings])
    impl.fully_shard([model.norm, model.output], reshard_after_forward=False)
    impl.fully_shard(model)
    tokens = make_tokens(args, dist.get_rank())
    return _record_forward_backward(impl, model, tokens, 3, UNSHARD_ONLY, UNSHARD_AND_POST_BACKWARD)


def test_f_grouped_modules(impl: Impl) -> None:
    results = run_threaded(2, _sequence_f, impl)
    assert_phases(results, _expand(3, F_PHASES))


# ---------------------------------------------------------------------------------------------
# G: grouped modules with a member that never runs
# ---------------------------------------------------------------------------------------------


class WithUnusedLinear(nn.Module):
    """A module whose ``unused_lin`` is never called in forward."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.unused_lin = nn.Linear(1, 1)
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


G0, G1 = "0.unused_lin, 0.lin", "1.unused_lin, 1.lin"
G_PHASES = {
    # The incomplete groups are force-completed at the root's post-forward, in reverse pre-order.
    "forward": [U("", F), U(G0, F), U(G1, F), R(G1, F), R(G0, F)],
    # Their pre-backward hooks sit on the root output and fire after the root's own hook. Group 1
    # post-backwards through autograd; the root and group 0 in the final callback (pre-order).
    "backward": [U(G1, PB), U(G0, PB), P(G1), P(""), P(G0)],
}


def _sequence_g(impl: Impl) -> Phases:
    dim = 16
    model = seeded(lambda: nn.Sequential(WithUnusedLinear(dim), WithUnusedLinear(dim), nn.Linear(dim, dim)))
    impl.fully_shard([model[0].unused_lin, model[0].lin], reshard_after_forward=True)
    impl.fully_shard([model[1].unused_lin, model[1].lin], reshard_after_forward=True)
    impl.fully_shard(model)
    x = make_input((2, dim), dist.get_rank())
    return _record_forward_backward(impl, model, x, 3, ALL_KINDS, UNSHARD_AND_POST_BACKWARD)


def test_g_never_run_member(impl: Impl) -> None:
    results = run_threaded(2, _sequence_g, impl)
    assert_phases(results, _expand(3, G_PHASES))
