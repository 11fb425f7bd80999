"""Reductions on the dense and the expert meshes do not depend on the order of the post-backward hooks.

Model (``tests/shared/ep_layout.py``): 3 mixture-of-experts branches side by side, each a
``fully_shard`` module with two groups (its router on the dense mesh of 4 thread ranks, its stacked
experts on ``efsdp`` 2 of an ``(efsdp 2, ep 2)`` mesh), and the root's ``inp``/``head``. The orders
are forced two ways, the same on every rank:

- by autograd: the branches run in forward in another order (default, reversed, shuffled), and
  backward runs the last one first; the reduce-scatters recorded follow that order;
- by hand: backward without gradient sync, then every group's post-backward called in a shuffled
  order (dense and expert groups of different branches interleaved, a branch's experts before its
  router), as torch's pipelining drives them (``post_backward()`` on ``_fsdp_param_groups``, then
  ``_root_post_backward_final_callback()``), with and without a reduce-scatter bucket cap.

For each: gradients and parameters over 2 AdamW steps are bit-identical to the default order's and
equal to the unsharded reference's (gradients averaged over the 4 ranks' batches); every reduce-scatter
starts with its own input as the only one alive (no buffer shared or kept across meshes), so the peak of
reduce-scatter input bytes is the largest group's input, ``W_g x row bytes`` (docs/memory.md,
"Reduce-scatter buffers across meshes"), the same in every order; so is each rank's measured peak of
the whole step (``fsdp2.testing.measure_memory``).
"""

from __future__ import annotations

import itertools
import random
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fsdp2
import fsdp2.testing
from tests._harness import run_threaded
from tests.shared import ep_layout
from tests.shared.moe import RS_NAME

WORLD, EP, EXPERTS, BRANCHES, STEPS = 4, 2, 4, 3, 2
ORDERS = {"default": [0, 1, 2], "reversed": [2, 1, 0], "shuffled": [1, 2, 0]}


class LiveInputs:
    """Per rank: the reduce-scatter inputs still alive when each reduce-scatter starts (the threads
    share one patched function)."""

    def __init__(self) -> None:
        self.original = getattr(dist, RS_NAME)
        self.reset()

    def reset(self) -> None:
        self.alive: dict[int, dict[int, int]] = {}  # rank -> {call number: input bytes}
        self.at_call: dict[int, list[int]] = {}  # rank -> bytes alive as each reduce-scatter starts
        self.sizes: dict[int, list[int]] = {}  # rank -> each reduce-scatter's input bytes
        self._numbers = itertools.count()

    def __call__(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        rank = dist.get_rank()
        alive = self.alive.setdefault(rank, {})
        number, nbytes = next(self._numbers), input.numel() * input.element_size()
        alive[number] = nbytes
        weakref.finalize(input.untyped_storage(), alive.pop, number, None)
        self.at_call.setdefault(rank, []).append(sum(alive.values()))
        self.sizes.setdefault(rank, []).append(nbytes)
        # The threaded backend keeps every rank's input until the slowest rank leaves the collective:
        # it gets a copy, so what keeps ``input`` alive is fsdp2 alone.
        return self.original(output, input.clone(), *args, **kwargs)


@pytest.fixture
def live_inputs(monkeypatch: pytest.MonkeyPatch) -> LiveInputs:
    watch = LiveInputs()
    monkeypatch.setattr(dist, RS_NAME, watch)
    return watch


def _manual_backward(model: Any, loss: torch.Tensor, seed: int) -> None:
    """Backward without reducing, then every group's post-backward in a shuffled order."""
    model.set_requires_gradient_sync(False)
    model.set_is_last_backward(False)
    loss.backward()
    model.set_requires_gradient_sync(True)
    model.set_is_last_backward(True)
    state = torch_fully_shard.state(model)
    groups = [group for member in state._state_ctx.all_states for group in member._fsdp_param_groups]
    random.Random(seed).shuffle(groups)  # the same order on every rank
    for group in groups:
        group.post_backward()
    state._root_post_backward_final_callback()


def _train(order: list[int], manual_seed: int | None, cap: float | None) -> dict[str, Any]:
    mesh, dense = ep_layout.meshes(EP)
    model = ep_layout.shard(ep_layout.build(EXPERTS, BRANCHES), mesh, dense)
    ref = ep_layout.build(EXPERTS, BRANCHES)
    model.order = list(order)
    if cap is not None:
        model.set_bucket_cap_mb(reduce_scatter=cap)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    rank = dist.get_rank()
    out: dict[str, Any] = {"grads": [], "reduce_scatters": []}
    for step in range(STEPS):
        with fsdp2.testing.record_collectives(model) as log:
            loss = ep_layout.loss_of(model(ep_layout.batch(rank, step)))
            if manual_seed is None:
                loss.backward()
            else:
                _manual_backward(model, loss, manual_seed + step)
        ep_layout.reference_backward(ref, WORLD, step)
        grads = ep_layout.full_grads(model)
        for name, grad in ep_layout.full_grads(ref).items():
            torch.testing.assert_close(grads[name], grad, msg=lambda m, n=name, s=step: f"step {s} {n}: {m}")
        out["grads"].append(grads)
        calls = [c for c in log.calls if c.kind == "reduce_scatter"]
        out["reduce_scatters"].append([(c.module_fqn, c.group_size, c.input_bytes) for c in calls])
        for optimizer in (optim, ref_optim):
            optimizer.step()
            optimizer.zero_grad()
    out["params"] = ep_layout.full_params(model)
    for name, param in ep_layout.full_params(ref).items():
        torch.testing.assert_close(out["params"][name], param, msg=lambda m, n=name: f"{n}: {m}")
    return out


def _assert_identical(results: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> None:
    for mine, base in zip(results, baseline, strict=True):
        for step_grads, base_grads in zip(mine["grads"], base["grads"], strict=True):
            for name, grad in step_grads.items():
                assert torch.equal(grad, base_grads[name]), name
        for name, param in mine["params"].items():
            assert torch.equal(param, base["params"][name]), name


def _check_buffers(watch: LiveInputs, results: list[dict[str, Any]]) -> list[int]:
    """Every reduce-scatter starts alone; returns each rank's peak of reduce-scatter input bytes."""
    peaks = []
    for rank, result in enumerate(results):
        sizes, at_call = watch.sizes[rank], watch.at_call[rank]
        assert at_call == sizes, "a reduce-scatter input outlived its collective"
        assert sorted(sizes) == sorted(c[2] for calls in result["reduce_scatters"] for c in calls)
        peaks.append(max(at_call))
    return peaks


def _expected_peak() -> int:
    """The largest group's input, ``W_g x (shard elements + tail) x 4 B`` (docs/memory.md).

    Expert groups: ``w1``/``w2`` local ``[2, 6, 4]`` over efsdp 2, 24 + 24 elements per rank and the
    usage row of 2 parameters: ``2 x 50 x 4 = 400``. Routers (dense): 4 + 2 over 4 ranks, 96. The root:
    ``inp`` and ``head``, 20 elements, 4 usage and 2 zeros keeping the ring's order: ``4 x 26 x 4``.
    """
    return max(2 * (2 * 24 + 2) * 4, 4 * (4 + 2) * 4, 4 * (20 + 4 + 2) * 4)


def _measured(order: list[int]) -> list[int]:
    """Each rank's measured peak of a training step (``fsdp2.testing.measure_memory``)."""

    def build() -> tuple[ep_layout.Net, torch.optim.Optimizer]:
        mesh, dense = ep_layout.meshes(EP)
        model = ep_layout.shard(ep_layout.build(EXPERTS, BRANCHES), mesh, dense)
        model.order = list(order)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(built: tuple[ep_layout.Net, torch.optim.Optimizer]) -> None:
        model, optimizer = built
        ep_layout.loss_of(model(ep_layout.batch(dist.get_rank(), 0))).backward()
        optimizer.step()
        optimizer.zero_grad()

    return [report.step_peak_bytes for report in fsdp2.testing.measure_memory(WORLD, build, step, steps=1)]


@pytest.mark.slow  # multi-rank and costly: the whole suite runs it, the quick loop leaves it
def test_branch_order_changes_hook_order_not_peak_memory() -> None:
    """The whole step's peak, every tensor counted (activations, buffers, states), is the same too."""
    peaks = _measured(ORDERS["default"])
    assert peaks == [peaks[0]] * WORLD
    for order in ("reversed", "shuffled"):
        assert _measured(ORDERS[order]) == peaks, order


def test_branch_order_changes_hook_order_not_results(live_inputs: LiveInputs) -> None:
    baseline = run_threaded(WORLD, _train, ORDERS["default"], None, None)
    assert _check_buffers(live_inputs, baseline) == [_expected_peak()] * WORLD
    for order in ("reversed", "shuffled"):
        live_inputs.reset()
        results = run_threaded(WORLD, _train, ORDERS[order], None, None)
        assert _check_buffers(live_inputs, results) == [_expected_peak()] * WORLD
        _assert_identical(results, baseline)
        modules = [fqn for fqn, _, _ in results[0]["reduce_scatters"][0]]
        # Autograd runs the branch computed last first; each branch's router (dense), then its experts.
        assert modules == [f"blocks.{i}" for i in reversed(ORDERS[order]) for _ in range(2)] + [""]
        sizes = [size for _, size, _ in results[0]["reduce_scatters"][0]]
        assert sizes == [WORLD, WORLD // EP] * BRANCHES + [WORLD]


@pytest.mark.slow  # multi-rank and costly: the whole suite runs it, the quick loop leaves it
@pytest.mark.parametrize("cap", [None, 1.0], ids=["one-per-group", "bucket-cap"])
def test_shuffled_post_backward_calls_give_the_same_numbers(
    cap: float | None, live_inputs: LiveInputs
) -> None:
    baseline = run_threaded(WORLD, _train, ORDERS["default"], None, cap)
    _check_buffers(live_inputs, baseline)
    bucketed = 0
    for seed in (1,):  # steps shuffled with seeds 1 and 2
        live_inputs.reset()
        results = run_threaded(WORLD, _train, ORDERS["default"], seed, cap)
        peaks = _check_buffers(live_inputs, results)
        _assert_identical(results, baseline)
        orders = [[fqn for fqn, _, _ in calls] for calls in results[0]["reduce_scatters"]]
        assert orders != [[fqn for fqn, _, _ in calls] for calls in baseline[0]["reduce_scatters"]]
        if cap is None:
            assert peaks == [_expected_peak()] * WORLD
        else:  # a bucket's input is its members' rows side by side: at most the cap
            assert all(peak <= cap * 2**20 for peak in peaks)
            bucketed += sum(len(calls) < 2 * BRANCHES + 1 for calls in results[0]["reduce_scatters"])
    # Groups of one process group next to each other in the shuffled order shared a reduce-scatter.
    assert bucketed > 0 or cap is None
