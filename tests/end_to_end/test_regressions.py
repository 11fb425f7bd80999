"""Bugs users hit when trying fsdp2, each pinned by a test that failed before its fix.

- events of another rank's thread never land in this thread's ``record_events()`` (also for a
  backward that autograd runs on a worker thread, as on CUDA);
- ``reshard_after_forward=False`` eval loops gather once, like torch, instead of every forward;
- zero-element parameters (``nn.Linear(4, 0)``, ``nn.Linear(0, 3)``) train like the reference;
- a forward after a backward that raised, without ``reset_iter_state()``, raises a clear error instead
  of training on with parameters the optimizer no longer updates;
- a chunked loss over ``fully_shard([norm, head])``, ``head`` called alone per chunk, trains like
  torch's ``fully_shard`` instead of failing at the first backward;
- parameters whose memory overlaps (views of one tensor) are refused at ``fully_shard`` instead of
  being silently split into independent copies;
- a sharded module shared by two roots is reported as such (it was said to have run on its own);
- pickling a sharded model (``torch.save(model)``) says what to save instead;
- a trainable submodule added after ``fully_shard`` raises at the next forward instead of training
  rank by rank with no gradient averaging;
- an in-place op on a view output (an LM head's ``Linear`` on 3-D activations) keeps the pre-backward
  hook (it sits on the view's base), so no warning for it, nor for a full backward hook's views
  (CommDebugMode); a view of a leaf still warns, naming the module, at the user's line;
- a patch of ``torch.distributed``'s collective functions (profilers, torch's tests) sees fsdp2's calls.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tests._harness import assert_sharded_parity, count_collectives, run_threaded
from tests._impls import Impl, get_impl, shard_blocks_then_root
from tests._training import EXACT, average_grads, fill_deterministic_, seeded, train_in_lockstep
from tests.models import MLP, make_input
from tests.shared.grad_sync import BoomError, Stack

# ---- events stay with the thread whose step produced them -------------------------------------


class _Blocks(nn.Module):
    def __init__(self, dim: int = 8, n_blocks: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLP(dim) for _ in range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


_ready = threading.Event()
_done = threading.Event()


def _forward_trace_while_peer_runs_backward(impl_name: str) -> list[Any]:
    """Rank 0 records a forward and keeps recording while rank 1 runs its whole backward."""
    impl = get_impl(impl_name)
    rank = dist.get_rank()
    model = seeded(_Blocks)
    # No all-gather in backward (False) and no reduce-scatter (no sync): rank 1's backward runs alone.
    shard_blocks_then_root(impl, model, model.layers, reshard_after_forward=False)
    model.set_requires_gradient_sync(False)
    x = make_input((2, 8), rank)
    if rank == 0:
        with impl.record_events() as events:
            out = model(x)
            _ready.set()
            assert _done.wait(60), "rank 1 never finished its backward"
        trace = list(events)
        out.sum().backward()
        return trace
    out = model(x)
    assert _ready.wait(60), "rank 0 never finished its forward"
    try:
        out.sum().backward()  # outside any recorder: its events belong to nobody
    finally:
        _done.set()
    return []


def test_events_of_another_rank_thread_never_leak(impl: Impl) -> None:
    _ready.clear()
    _done.clear()
    trace = run_threaded(2, _forward_trace_while_peer_runs_backward, impl.name)[0]
    assert trace == [  # the root has no parameters of its own, hence no group and no events
        ("unshard", "layers.0", "FORWARD"),
        ("unshard", "layers.1", "FORWARD"),
    ]


class _RecordInBackward(torch.autograd.Function):
    """Identity whose backward records an event, as a group's post-backward does."""

    @staticmethod
    def forward(ctx: Any, scope: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.scope = scope
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        from fsdp2 import TrainingState
        from fsdp2.trace import _events

        _events.record("post_backward", "worker", TrainingState.POST_BACKWARD, ctx.scope)
        return None, grad


def test_backward_on_a_worker_thread_reports_to_the_forward_thread() -> None:
    """A backward autograd runs on another thread (CUDA) lands with the thread that ran forward."""
    from fsdp2.trace import _events

    scope = _events.EventScope()
    x = torch.ones(2, requires_grad=True)
    with _events.record_events() as events:
        scope.capture()  # what the root does when an iteration's forward starts
        y = _RecordInBackward.apply(scope, x)
        worker = threading.Thread(target=lambda: y.sum().backward())
        worker.start()
        worker.join()
        # A thread with no recorder and no captured scope records nothing anywhere.
        other = threading.Thread(target=lambda: _RecordInBackward.apply(None, x).sum().backward())
        other.start()
        other.join()
    assert [e.as_tuple() for e in events] == [("post_backward", "worker", "POST_BACKWARD")]
    # Once the context is closed, the captured recorder takes no more events.
    _RecordInBackward.apply(scope, x).sum().backward()
    assert len(events) == 1


# ---- eval loops with reshard_after_forward=False ----------------------------------------------


def _eval_loop_gathers(impl_name: str, how: str) -> tuple[int, list[torch.Tensor]]:
    impl = get_impl(impl_name)
    rank = dist.get_rank()
    ref = seeded(_Blocks)
    model = copy.deepcopy(ref)
    raf = False if how == "argument" else None
    shard_blocks_then_root(impl, model, model.layers, reshard_after_forward=raf)
    if how == "setter":
        model.set_reshard_after_forward(False)
    outputs = []
    with count_collectives() as counts, torch.no_grad():
        for step in range(3):
            x = make_input((2, 8), rank, seed=step)
            out = model(x)
            torch.testing.assert_close(out, ref(x), **EXACT)
            outputs.append(out)
    # Training afterwards still matches the reference (the kept parameters are current).
    x = make_input((2, 8), rank, seed=9)
    model(x).sum().backward()
    ref(x).sum().backward()
    average_grads(ref)
    assert_sharded_parity(ref, model, grads=True)
    return counts["all_gather"], outputs


@pytest.mark.parametrize("how", ["argument", "setter"])
def test_eval_loop_with_reshard_after_forward_false_gathers_once(how: str) -> None:
    fsdp2_gathers = run_threaded(2, _eval_loop_gathers, "fsdp2", how)[0][0]
    torch_gathers = run_threaded(2, _eval_loop_gathers, "torch", how)[0][0]
    assert fsdp2_gathers == torch_gathers == 2  # one per block (the root has none), for three forwards


def _eval_loop_default(impl_name: str) -> None:
    model = seeded(_Blocks)
    shard_blocks_then_root(get_impl(impl_name), model, model.layers)
    with count_collectives() as counts, torch.no_grad():
        for step in range(3):
            model(make_input((2, 8), dist.get_rank(), seed=step))
    # The default reshards after every no-grad forward (so parameters() stays sharded).
    assert counts["all_gather"] == 6  # two blocks, three forwards
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_eval_loop_with_default_reshards() -> None:
    run_threaded(2, _eval_loop_default, "fsdp2")


# ---- zero-element parameters ------------------------------------------------------------------


class _ZeroWidth(nn.Module):
    """A model with parameters of zero elements on either dim, in a gradient path."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(8, 8)
        self.no_out = nn.Linear(8, 0)  # weight (0, 8), bias (0,)
        self.no_in = nn.Linear(0, 3)  # weight (3, 0), bias (3,)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.dense(x))
        empty = self.no_out(h)  # (B, 0)
        return self.head(h) * self.no_in(empty)  # no_in's output is its bias


@pytest.mark.parametrize("layout", ["one_group", "own_groups"])
def test_zero_element_parameters_train(layout: str) -> None:
    def body() -> None:
        impl = get_impl("fsdp2")
        ref = seeded(_ZeroWidth)
        model = copy.deepcopy(ref)
        if layout == "own_groups":  # a group whose every parameter is empty, and a mixed one
            impl.fully_shard(model.no_out)
            impl.fully_shard(model.no_in)
        impl.fully_shard(model)
        losses = train_in_lockstep(
            model, ref, lambda rank, step: make_input((4, 8), rank, seed=step), 3, assert_sharded_parity
        )
        assert len(losses) == 3  # gradients (present, with the reference's values) checked on step 0

    run_threaded(2, body)


# ---- a forward after a backward that raised ---------------------------------------------------


def _forward_after_failed_backward() -> None:
    impl = get_impl("fsdp2")
    rank = dist.get_rank()
    model = seeded(Stack)
    for block in model.blocks:
        impl.fully_shard(block)
    impl.fully_shard(model)
    x = make_input((4, 6), rank)
    model(x).sum().backward()
    model.blocks[1].raiser.fail = "backward"
    with pytest.raises(BoomError):
        model(x).sum().backward()
    model.blocks[1].raiser.fail = None
    # The user's loop swallowed the error and goes on: the next forward must refuse.
    with pytest.raises(RuntimeError, match=r"previous backward never finished.*reset_iter_state\(\)"):
        model(x)
    with pytest.raises(RuntimeError, match=r"reset_iter_state\(\)"):
        model(x)  # still refused: nothing was changed by the failed attempt
    model.reset_iter_state()
    loss = model(x).sum()
    loss.backward()
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert all(p.grad is not None for p in model.parameters())


def test_forward_after_unfinished_backward_raises() -> None:
    run_threaded(2, _forward_after_failed_backward)


# ---- an optimizer built before fully_shard ------------------------------------------------------


def _optimizer_before_fully_shard(impl_name: str) -> bool:
    """Returns whether a step changed any parameter; fsdp2 must raise before the step instead."""
    impl = get_impl(impl_name)
    model = seeded(lambda: MLP(8))
    ref = copy.deepcopy(model)
    early = torch.optim.SGD(model.parameters(), lr=0.1)  # holds the parameters fully_shard replaces
    shard_blocks_then_root(impl, model, [model.in_proj])
    before = [p.full_tensor().clone() for p in model.parameters()]
    model(make_input((3, 8), dist.get_rank())).sum().backward()
    if impl_name == "fsdp2":
        state_before = copy.deepcopy(early.state_dict())
        with pytest.raises(
            RuntimeError, match=r"SGD.step\(\): 4 of its parameters .* replaced by fully_shard"
        ):
            early.step()
        assert early.state_dict() == state_before  # refused before any change
        # A deep copy of a replaced parameter is a tensor of its own: an optimizer may train it.
        twin = copy.deepcopy(early.param_groups[0]["params"][0])
        twin.grad = torch.ones_like(twin)
        torch.optim.SGD([twin], lr=1.0).step()
        torch.testing.assert_close(twin, early.param_groups[0]["params"][0].detach() - 1, **EXACT)
        # Built afterwards, from model.parameters(), the optimizer trains like the reference.
        model.zero_grad()
        train_in_lockstep(
            model, ref, lambda rank, step: make_input((3, 8), rank, seed=step), 2, assert_sharded_parity
        )
        return True
    early.step()
    return any(not torch.equal(p.full_tensor(), b) for p, b in zip(model.parameters(), before, strict=True))


def test_optimizer_built_before_fully_shard_raises_at_its_step() -> None:
    assert run_threaded(2, _optimizer_before_fully_shard, "fsdp2") == [True, True]
    # torch's fully_shard lets the step run: it trains nothing, silently.
    assert run_threaded(2, _optimizer_before_fully_shard, "torch") == [False, False]


# ---- chunked loss: fully_shard([norm, head]) with head called alone per chunk ------------------


class _ChunkedLossModel(nn.Module):
    """The model's forward ends at ``norm``; the loss calls ``head`` on each chunk (torchtitan's pattern)."""

    def __init__(self, dim: int = 8, vocab: int = 11) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(MLP(dim) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

        fill_deterministic_(self, scale=0.5)  # the same values in every run (threads share torch's RNG)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


def _chunk_loss(head: nn.Module, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(h)
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


def _chunked_loss_step(
    model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, per_chunk: bool
) -> None:
    chunks = 3
    h = model(tokens)
    if not per_chunk:  # one backward through every chunk
        loss = sum(
            _chunk_loss(model.head, hc, tc)
            for hc, tc in zip(h.chunk(chunks, 1), targets.chunk(chunks, 1), strict=True)
        )
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        return
    # One backward per chunk into a detached copy of the hidden states, then one through the body.
    detached = h.detach().requires_grad_()
    for hc, tc in zip(detached.chunk(chunks, 1), targets.chunk(chunks, 1), strict=True):
        _chunk_loss(model.head, hc, tc).backward()
    h.backward(detached.grad)


def _train_chunked_loss(impl_name: str, per_chunk: bool) -> tuple[list[torch.Tensor], Any]:
    impl = get_impl(impl_name)
    rank = dist.get_rank()
    model = _ChunkedLossModel()
    for layer in model.layers:
        impl.fully_shard(layer)
    impl.fully_shard([model.norm, model.head])
    impl.fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    grads: list[torch.Tensor] = []
    with count_collectives() as counts:
        for _ in range(2):
            tokens, targets = (
                torch.randint(0, 11, (2, 6), generator=gen),
                torch.randint(0, 11, (2, 6), generator=gen),
            )
            _chunked_loss_step(model, tokens, targets, per_chunk)
            grads += [p.grad.full_tensor() for p in model.parameters()]
            optim.step()
            optim.zero_grad()
    grads += [p.full_tensor() for p in model.parameters()]
    return grads, dict(counts)


@pytest.mark.parametrize("per_chunk", [False, True], ids=["one-backward", "backward-per-chunk"])
def test_chunked_loss_with_grouped_norm_and_head_matches_torch(per_chunk: bool) -> None:
    # Before the fix: "group norm, head cannot go from FORWARD to POST_BACKWARD" at the first backward.
    ours, our_counts = run_threaded(2, _train_chunked_loss, "fsdp2", per_chunk)[0]
    theirs, their_counts = run_threaded(2, _train_chunked_loss, "torch", per_chunk)[0]
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, **EXACT)
    if not per_chunk:  # and fsdp2's first backward agrees on which submodules ran (one all-reduce)
        assert our_counts == {**their_counts, "all_reduce": their_counts.get("all_reduce", 0) + 1}
        return
    # Each chunk's backward ends with fsdp2's end-of-backward callback, which reshards the root (kept
    # unsharded after forward) that torch leaves gathered: one more all-gather per step (see
    # docs/differences.md), the same reduce-scatters.
    assert our_counts["reduce_scatter"] == their_counts["reduce_scatter"]
    assert our_counts["all_gather"] == their_counts["all_gather"] + 2


# ---- parameters that alias one another ------------------------------------------------------------


def _aliased_parameters() -> None:
    fsdp2 = get_impl("fsdp2")
    base = torch.arange(16.0).view(4, 4)
    module = nn.Module()
    module.a = nn.Parameter(base)
    module.b = nn.Parameter(base[1:3])  # rows 1-2 of a: the same elements
    with pytest.raises(ValueError, match=r"Module.a and Module.b are views of the same memory"):
        fsdp2.fully_shard(module)
    assert type(module.a) is nn.Parameter  # refused before any change
    # Disjoint views of one buffer alias nothing: allowed, each gets its own shard.
    flat = torch.arange(8.0)
    disjoint = nn.Module()
    disjoint.a, disjoint.b = nn.Parameter(flat[:4]), nn.Parameter(flat[4:])
    fsdp2.fully_shard(disjoint)
    torch.testing.assert_close(disjoint.b.full_tensor(), torch.arange(4.0, 8.0), **EXACT)


def test_aliased_parameters_are_refused() -> None:
    # torch's fully_shard accepts them and silently gives each its own copy.
    run_threaded(2, _aliased_parameters)


# ---- a sharded module under two roots ---------------------------------------------------------------


def _module_under_two_roots() -> None:
    fsdp2 = get_impl("fsdp2")
    shared = MLP(8)
    fsdp2.fully_shard(shared)
    first, second = nn.Sequential(shared, MLP(8)), nn.Sequential(shared, MLP(8))
    fsdp2.fully_shard(first)
    fsdp2.fully_shard(second)
    first(make_input((2, 8), dist.get_rank())).sum().backward()
    with pytest.raises(RuntimeError, match=r"'0' of FSDPSequential already belongs to another root"):
        second(make_input((2, 8), dist.get_rank()))


def test_a_module_under_two_roots_is_named_as_such() -> None:
    # Before: "already ran forward on its own before its root", which it had not.
    run_threaded(2, _module_under_two_roots)


# ---- pickling a sharded model ---------------------------------------------------------------------


def _pickle_sharded() -> None:
    import io
    import pickle

    model = nn.Sequential(MLP(8), MLP(8))
    shard_blocks_then_root(get_impl("fsdp2"), model, list(model))
    for save in (lambda: pickle.dumps(model), lambda: torch.save(model, io.BytesIO())):
        with pytest.raises(TypeError, match=r"cannot be pickled .* Save its state_dict\(\)"):
            save()
    copy.deepcopy(model)  # the supported copy still works


def test_pickling_a_sharded_model_says_what_to_save_instead() -> None:
    # torch's fully_shard: PicklingError "attribute lookup FSDPSequential ... failed".
    run_threaded(2, _pickle_sharded)


# ---- a submodule added after fully_shard ----------------------------------------------------------


class _Growing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLP(8) for _ in range(2))
        self.extra: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.extra(x) if self.extra is not None else x


def _added_after_sharding(impl_name: str) -> float:
    rank = dist.get_rank()
    model = fill_deterministic_(_Growing())
    shard_blocks_then_root(get_impl(impl_name), model, list(model.layers))
    model(make_input((2, 8), rank)).sum().backward()
    model.extra = nn.Linear(8, 8)
    with torch.no_grad():  # the same new weights on every rank
        model.extra.weight.copy_(torch.eye(8))
        model.extra.bias.zero_()
    if impl_name == "fsdp2":
        with pytest.raises(
            RuntimeError, match=r"The submodule FSDP_Growing.extra was added after fully_shard"
        ):
            model(make_input((2, 8), rank))
        model.extra.requires_grad_(False)  # not trained: nothing to average, so it may stay
        model(make_input((2, 8), rank)).sum().backward()
        return 0.0
    optim = torch.optim.SGD(model.extra.parameters(), lr=0.1)
    model(make_input((2, 8), rank)).sum().backward()
    optim.step()
    spread = model.extra.weight.detach().clone()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    return (spread - model.extra.weight).abs().max().item()  # ranks' copies differ


def test_a_trainable_submodule_added_after_fully_shard_raises() -> None:
    # torch's fully_shard trains it rank by rank: the copies drift apart silently.
    assert run_threaded(2, _added_after_sharding, "torch")[0] > 0
    run_threaded(2, _added_after_sharding, "fsdp2")


# ---- view outputs: in-place ops keep the pre-backward hook; the warning only where they would not ----


class _Head(nn.Module):
    """An LM head: a Linear with bias on 3-D activations returns a view (addmm, then view)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class _InPlaceOnView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = MLP(8), _Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(self.body(x))
        out += 1.0  # in place on the head's view output, before backward
        return out


class _ReturnsWeightView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight[0]  # a view of a leaf: autograd has no node to keep the hook on


def _in_place_on_view_outputs() -> list[str]:
    import contextlib
    import warnings

    fsdp2 = get_impl("fsdp2")
    rank = dist.get_rank()
    base = seeded(_InPlaceOnView)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    hooked = seeded(lambda: MLP(8))
    hooked.register_full_backward_hook(lambda module, grad_in, grad_out: None)  # as CommDebugMode does
    for sharded in (model.head, model.body, model, hooked):
        fsdp2.fully_shard(sharded)  # the head reshards after forward: backward must gather it again
    x = make_input((2, 3, 8), rank)
    # warnings.catch_warnings is process-wide: rank 0 records (both ranks' warnings, if any)
    recording = warnings.catch_warnings(record=True) if rank == 0 else contextlib.nullcontext([])
    with recording as caught:
        warnings.simplefilter("always")
        model(x).sum().backward()
        hooked(make_input((2, 8), rank)).sum().backward()
    ref(x).sum().backward()
    average_grads(ref)
    assert_sharded_parity(ref, model, grads=True)
    return [str(w.message) for w in caught or [] if "returned a view" in str(w.message)]


class _ReturnsInputView(nn.Module):
    """Returns a view of an input next to its own output: that view's base is computed outside."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, *, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.tanh(self.lin(x)), x[:, :4], y[:, 2:]


class _InputViews(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre, self.inner, self.post = nn.Linear(8, 8), _ReturnsInputView(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        out, first, last = self.inner(h, y=h * 2)
        return self.post(out).sum() + first.sum() + last.sum()


def _views_of_inputs() -> int:
    fsdp2 = get_impl("fsdp2")
    base = seeded(_InputViews)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    fsdp2.fully_shard(model.inner)  # reshards after forward: one all-gather in backward
    fsdp2.fully_shard(model)
    x = make_input((3, 8), dist.get_rank())
    with count_collectives() as counts:
        model(x).backward()
    ref(x).backward()
    average_grads(ref)
    assert_sharded_parity(ref, model, grads=True)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    return counts["all_gather"]


def test_a_view_of_an_input_keeps_the_hook_on_its_own_node() -> None:
    # The input's node runs after the module's post-backward: a pre-backward there would gather again.
    assert run_threaded(2, _views_of_inputs) == [3, 3]  # forward: root, inner; backward: inner


def _leaf_view_warning() -> list[Any]:
    import warnings

    leaf_view = get_impl("fsdp2").fully_shard(_ReturnsWeightView())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        leaf_view(make_input((2, 8), 0)).sum().backward()
    return [w for w in caught if "returned a view" in str(w.message)]


class _LocalView(torch.autograd.Function):
    """Returns a view of a tensor without a node, as tensor parallelism's ``DTensor.to_local()`` does."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        local = tensor.detach()  # a DTensor's local tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _CustomFunctionView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LocalView.apply(self.lin(x))


def _custom_function_view() -> list[str]:
    import warnings

    base = seeded(lambda: nn.Sequential(_CustomFunctionView(), _CustomFunctionView()))
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    for sharded in (model[0], model[1], model):
        get_impl("fsdp2").fully_shard(sharded)
    x = make_input((3, 8), dist.get_rank())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(x)
        with pytest.raises(RuntimeError, match="view and is being modified inplace"):
            out += 1.0  # autograd refuses it: the hook on the view's own node cannot be dropped
        out.sum().backward()
    ref(x).sum().backward()
    average_grads(ref)
    assert_sharded_parity(ref, model, grads=True)
    return [str(w.message) for w in caught if "returned a view" in str(w.message)]


def test_a_custom_functions_view_output_does_not_warn() -> None:
    # A tensor-parallel output layer's to_local() output warned at every forward, though autograd
    # refuses the in-place op the warning is about.
    assert run_threaded(1, _custom_function_view) == [[]]


def test_in_place_op_on_a_view_output_keeps_the_pre_backward_hook() -> None:
    # torch warns for every such head and an in-place op skips its all-gather; fsdp2 hooks the view's base.
    assert run_threaded(2, _in_place_on_view_outputs) == [[], []]  # an LM head, a full backward hook


def test_a_view_of_a_leaf_warns_at_the_users_line() -> None:
    (warned,) = run_threaded(1, _leaf_view_warning)
    assert len(warned) == 1
    message = str(warned[0].message)
    assert "'<root>' (_ReturnsWeightView)" in message, message
    assert "harmless" in message, message
    assert warned[0].filename == __file__  # the user's line, not fsdp2's or torch's


# ---- collectives looked up at call time -------------------------------------------------------------


def _train_once() -> None:
    model = nn.Sequential(MLP(8), MLP(8))
    shard_blocks_then_root(get_impl("fsdp2"), model, list(model))
    model(make_input((2, 8), dist.get_rank())).sum().backward()


def test_patched_torch_collectives_see_fsdp2_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    # Profilers and torch's own FSDP tests patch torch.distributed's functions; fsdp2 bound them at
    # import, so the patches never saw its collectives.
    calls: list[str] = []
    for name in ("all_gather_single", "reduce_scatter_single"):
        original = getattr(dist, name, None) or getattr(
            dist, name.replace("_single", "_into_tensor" if "gather" in name else "_tensor")
        )
        target = name if hasattr(dist, name) else original.__name__

        def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(dist, target, counted)
    run_threaded(2, _train_once)
    # per rank: the two blocks gather in forward and again in backward, and reduce once (the root
    # Sequential has no parameters of its own)
    assert calls.count("all_gather_single") == 2 * 4
    assert calls.count("reduce_scatter_single") == 2 * 2
