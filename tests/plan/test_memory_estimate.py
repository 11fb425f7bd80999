"""fsdp2.estimate_memory against measured peaks of real thread-rank runs, and fsdp2.plan.

The measurement (``fsdp2.testing.measure_memory``) runs every rank for real and counts the live
storages each rank's ops create; the estimate runs one simulated rank on fake tensors. They must
agree within 10% (they agree to the byte where the step is deterministic in shape).
"""

from __future__ import annotations

import math
import resource
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2.comm import same_order_tail
from fsdp2.testing import measure_memory, run_ranks
from tests.models import ModelArgs, Transformer, make_input, make_tokens

BF16 = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class Blocks(nn.Module):
    """An MLP of ``n`` residual blocks with uneven widths (shards are padded)."""

    def __init__(self, n: int = 4, dim: int = 50, hidden: int = 203) -> None:
        super().__init__()
        self.inp = nn.Linear(12, dim)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)) for _ in range(n)
        )
        self.out = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.out(h)


def _job(model_name: str, world: int, mp: fsdp2.MixedPrecisionPolicy) -> tuple[Any, Any]:
    """build_model / train_step as a user's training script would write them."""
    args = ModelArgs(n_layers=3, vocab_size=101, dim=48, n_heads=4, max_seq_len=17)

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        mesh = init_device_mesh("cpu", (world,))
        model: nn.Module = Transformer(args) if model_name == "transformer" else Blocks()
        for layer in model.layers:  # type: ignore[union-attr]
            fsdp2.fully_shard(layer, mesh=mesh, mp_policy=mp)
        fsdp2.fully_shard(model, mesh=mesh, mp_policy=mp)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(built: tuple[nn.Module, torch.optim.Optimizer]) -> None:
        model, optim = built
        rank = torch.distributed.get_rank()
        if model_name == "transformer":
            tokens = make_tokens(args, rank, batch=4)
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())
        else:
            loss = model(make_input((32, 12), rank)).float().pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()

    return build, step


# World 4: the shards are padded (widths 50 and 203, vocab 101, 17 positions) and the blocks model's
# output layer (3 rows) leaves a rank an empty shard; world 8 adds more of both, nothing else.
@pytest.mark.parametrize("world", [4])
@pytest.mark.parametrize("model_name", ["blocks", "transformer"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_estimate_within_10_percent_of_measured(world: int, model_name: str, precision: str) -> None:
    build, step = _job(model_name, world, BF16 if precision == "bf16" else fsdp2.MixedPrecisionPolicy())
    estimate = fsdp2.estimate_memory(build, step, world_size=world)
    measured = measure_memory(world, build, step)
    assert estimate.simulated
    assert not measured[0].simulated
    assert abs(estimate.peak_bytes - measured[0].peak_bytes) <= 0.10 * measured[0].peak_bytes
    for phase in ("forward", "backward", "optimizer"):
        got, want = estimate.phases[phase].peak_bytes, measured[0].phases[phase].peak_bytes
        assert abs(got - want) <= 0.10 * want, (phase, got, want)
    # here every phase to the byte: the 1-element copies each group's reductions keep for the next
    # backward (whether a rank saw an idle submodule) are counted too, though never read simulated
    assert {k: p.peak_bytes for k, p in estimate.phases.items()} == {
        k: p.peak_bytes for k, p in measured[0].phases.items()
    }
    # the same collectives, per step
    assert estimate.collectives == measured[0].collectives
    assert estimate.collectives["all_gather"] > 0
    assert estimate.collectives["reduce_scatter"] > 0
    # every rank of a real run: rank 0 holds the largest (padded) shards
    assert max(r.peak_bytes for r in measured) <= measured[0].peak_bytes * 1.10


def test_breakdown_matches_the_analytic_sizes() -> None:
    """Parameters, gradients and AdamW states at their peaks are exactly the padded shard bytes.

    (Gradients: plus the usage elements their reduce-scatter outputs carry.)
    """
    world = 4
    build, step = _job("blocks", world, fsdp2.MixedPrecisionPolicy())
    report = fsdp2.estimate_memory(build, step, world_size=world)
    ref = Blocks()
    shard_bytes = sum(math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) * 4 for p in ref.parameters())
    n_params = len(list(ref.parameters()))
    for phase in ("forward", "backward", "optimizer"):
        assert report.phases[phase].breakdown["parameters"] == shard_bytes
    # AdamW: exp_avg and exp_avg_sq like the shards, plus one float32 step count per parameter
    assert report.phases["forward"].breakdown["optimizer_states"] == 2 * shard_bytes + 4 * n_params

    # The sharded gradients are views of each group's reduce-scatter output, whose storage ends with one
    # usage element per parameter (see fsdp2/group/_usage.py) and, in a group whose parameters are
    # registered on submodules (here all 5: the blocks' Linears, the root's inp and out), one element
    # saying whether one of them was idle on the rank (fsdp2/group/_skip.py)
    # plus the zeros before that row that keep torch's summation order on gloo (comm.same_order_tail)
    def padded_numel(module: nn.Module) -> int:
        return sum(math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) for p in module.parameters())

    groups = [(padded_numel(layer), len(list(layer.parameters()))) for layer in ref.layers]
    root_numel = padded_numel(ref.inp) + padded_numel(ref.out)
    groups.append((root_numel, len(list(ref.inp.parameters())) + len(list(ref.out.parameters()))))
    tails = sum(same_order_tail(world, width, count + 1, 4) for width, count in groups)
    assert tails >= n_params + len(groups)
    assert report.phases["optimizer"].breakdown["gradients"] == shard_bytes + 4 * tails
    assert report.phases["forward"].breakdown["gradients"] == 0  # zero_grad(set_to_none) after step 1
    assert report.phases["init"].breakdown["parameters"] >= sum(p.numel() * 4 for p in ref.parameters())
    assert report.peak_bytes == max(p.peak_bytes for p in report.phases.values())
    assert sum(report.breakdown.values()) == report.peak_bytes
    table = str(report)
    assert "estimated" in table
    assert "optimizer states" in table
    assert "backward" in table


def test_estimate_allocates_nothing() -> None:
    """A model needing ~1.5 GiB per rank at 2 ranks is estimated without the process growing."""
    dim, n = 4096, 12

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        mesh = init_device_mesh("cpu", (2,))
        model = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(n)])
        for layer in model:
            fsdp2.fully_shard(layer, mesh=mesh)
        fsdp2.fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters())

    def step(built: tuple[nn.Module, torch.optim.Optimizer]) -> None:
        model, optim = built
        model(torch.randn(64, dim)).sum().backward()
        optim.step()

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report = fsdp2.estimate_memory(build, step, world_size=2, steps=1)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    params = n * (dim * dim + dim) * 4
    assert (
        report.phases["optimizer"].breakdown["optimizer_states"] == params + 4 * 2 * n
    )  # 2 states / 2 ranks
    assert report.peak_bytes > params  # unsharded model at init
    assert grown_kib < 200 * 1024, f"estimate grew the process by {grown_kib} KiB"


def test_meta_init_and_checkpointing_are_estimated() -> None:
    """Meta-device init + to_empty, and activation checkpointing, run in the simulated world."""
    world = 2
    args = ModelArgs(n_layers=2, dim=32, max_seq_len=8, checkpoint_activations=True)

    def build() -> nn.Module:
        with torch.device("meta"):
            model = Transformer(args)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers:
            fsdp2.fully_shard(layer, mesh=mesh)
        fsdp2.fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        return model

    def step(model: nn.Module) -> None:
        assert fsdp2.is_simulated() == (torch.distributed.get_backend() != "threaded")
        model(make_tokens(args, 0, batch=2)).sum().backward()

    estimate = fsdp2.estimate_memory(build, step, world_size=world)
    measured = measure_memory(world, build, step)
    assert abs(estimate.peak_bytes - measured[0].peak_bytes) <= 0.10 * measured[0].peak_bytes
    assert "optimizer" not in estimate.phases  # no optimizer in this step


def test_reading_a_value_is_a_clear_error() -> None:
    def build() -> nn.Module:
        model = nn.Linear(4, 4)
        fsdp2.fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        return model

    def step(model: nn.Module) -> None:
        print(model(torch.randn(2, 4)).sum().item())

    with pytest.raises(fsdp2.SimulatedValueError, match=r"loss.item\(\).*is_simulated"):
        fsdp2.estimate_memory(build, step, world_size=2)
    assert not torch.distributed.is_initialized()  # the simulated world is torn down after an error
    assert not fsdp2.is_simulated()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"world_size": 0}, ValueError, "world_size must be an int >= 1"),
        ({"world_size": 2, "rank": 2}, ValueError, r"rank must be in \[0, world_size=2\)"),
        ({"world_size": 2, "steps": 0}, ValueError, "steps must be an int >= 1"),
        ({"world_size": True}, ValueError, "world_size"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        fsdp2.estimate_memory(lambda: nn.Linear(2, 2), lambda m: None, **kwargs)
    with pytest.raises(TypeError, match="two callables"):
        fsdp2.estimate_memory("model", lambda m: None, world_size=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must return the model"):
        fsdp2.estimate_memory(lambda: 3, lambda m: None, world_size=2)


def _linear_step(model: nn.Module) -> None:
    model(torch.ones(3, 64)).sum().backward()


def _sharded_linear() -> nn.Module:
    model = nn.Linear(64, 64)
    fsdp2.fully_shard(model, mesh=init_device_mesh("cpu", (4,)))
    return model


def test_inside_a_running_job_the_job_is_untouched() -> None:
    """Every rank of a job may estimate (or plan): its own simulated world, the job's group kept."""
    alone = fsdp2.estimate_memory(_sharded_linear, _linear_step, world_size=4).peak_bytes

    def rank_fn(rank: int, world: int) -> tuple[str, int, int, float]:
        peak = fsdp2.estimate_memory(_sharded_linear, _linear_step, world_size=4).peak_bytes
        total = torch.ones(1)
        torch.distributed.all_reduce(total)  # the job's default group still works
        return torch.distributed.get_backend(), torch.distributed.get_world_size(), peak, float(total)

    assert run_ranks(2, rank_fn) == [("threaded", 2, alone, 2.0)] * 2


# -- plan ------------------------------------------------------------------------------------------


def _plan_step(built: tuple[nn.Module, torch.optim.Optimizer]) -> None:
    model, optim = built
    model(make_input((64, 12), 0)).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()


@pytest.mark.slow
def test_plan_fewest_collectives_that_fit_and_measured_peak_agrees() -> None:
    world = 4
    by = {"objective": "collectives"}
    roomy = fsdp2.plan(lambda: Blocks(n=6), _plan_step, world_size=world, budget_bytes=2**30, **by)
    assert roomy.groups == []
    assert roomy.collectives_per_step == 2

    with pytest.raises(fsdp2.PlanError) as info:
        fsdp2.plan(lambda: Blocks(n=6), _plan_step, world_size=world, budget_bytes=1, **by)
    lowest = info.value.best
    assert lowest.peak_bytes < roomy.peak_bytes
    assert lowest.collectives_per_step > roomy.collectives_per_step
    tight_budget = (lowest.peak_bytes + roomy.peak_bytes) // 2
    tight = fsdp2.plan(lambda: Blocks(n=6), _plan_step, world_size=world, budget_bytes=tight_budget, **by)
    assert tight.fits
    assert tight.peak_bytes <= tight_budget
    assert tight.collectives_per_step > 2
    assert tight.groups
    # every cheaper trial that was tried did not fit
    assert all(peak > tight_budget for _, peak, count in tight.tried if count < tight.collectives_per_step)
    assert f"{tight.collectives_per_step} collectives per step" in str(tight)

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = Blocks(n=6)
        tight.apply(model, mesh=init_device_mesh("cpu", (world,)))
        return model, torch.optim.AdamW(model.parameters())

    measured = measure_memory(world, build, _plan_step)
    assert measured[0].peak_bytes <= tight_budget * 1.10
    assert abs(measured[0].peak_bytes - tight.peak_bytes) <= 0.10 * measured[0].peak_bytes


def test_planned_model_trains_like_the_unsharded_one() -> None:
    world = 2
    chosen = fsdp2.plan(
        lambda: Blocks(n=4), _plan_step, world_size=world, budget_bytes=2**30, candidates=[nn.Sequential]
    )
    forced = fsdp2.Plan(
        world, 2**30, [["layers.0", "layers.1"], ["layers.2"]], [True, False], chosen.report, []
    )

    def rank_fn(rank: int, size: int) -> list[float]:
        mesh = init_device_mesh("cpu", (size,))
        return fsdp2.testing.assert_matches_unsharded(
            lambda: Blocks(n=4),
            lambda model: forced.apply(model, mesh=mesh),
            lambda r, s: make_input((8, 12), r, seed=s),
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        )

    losses = run_ranks(world, rank_fn)
    assert len(losses[0]) == 3


def test_plan_errors() -> None:
    with pytest.raises(fsdp2.PlanError, match="no wrapping of this model fits") as info:
        fsdp2.plan(lambda: Blocks(n=2), _plan_step, world_size=2, budget_bytes=1024)
    assert info.value.best.peak_bytes > 1024
    assert not info.value.best.fits
    with pytest.raises(ValueError, match="budget_bytes must be a positive int"):
        fsdp2.plan(lambda: Blocks(n=2), _plan_step, world_size=2, budget_bytes=0)
    with pytest.raises(ValueError, match="chooses the mesh"):
        fsdp2.plan(lambda: Blocks(n=2), _plan_step, world_size=2, budget_bytes=2**30, mesh=None)
    with pytest.raises(ValueError, match=r"\['nope'\] are not submodules"):
        fsdp2.plan(lambda: Blocks(n=2), _plan_step, world_size=2, budget_bytes=2**30, candidates=["nope"])


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("variant", ["cpu-offload", "bucketed", "reshard-after-forward-false"])
def test_estimate_matches_measured_with_engine_options(variant: str) -> None:
    world = 4

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        mesh = init_device_mesh("cpu", (world,))
        model = Blocks(n=5)
        kwargs: dict[str, Any] = {"mesh": mesh}
        if variant == "cpu-offload":
            kwargs["offload_policy"] = fsdp2.CPUOffloadPolicy(pin_memory=False)
        if variant == "reshard-after-forward-false":
            kwargs["reshard_after_forward"] = False
        for layer in model.layers:
            fsdp2.fully_shard(layer, **kwargs)
        fsdp2.fully_shard(model, **kwargs)
        if variant == "bucketed":
            model.set_bucket_cap_mb(all_gather=25, reduce_scatter=25)  # type: ignore[operator]
        return model, torch.optim.AdamW(model.parameters())

    estimate = fsdp2.estimate_memory(build, _plan_step, world_size=world, steps=3)
    measured = measure_memory(world, build, _plan_step, steps=3)[0]
    assert abs(estimate.peak_bytes - measured.peak_bytes) <= 0.10 * measured.peak_bytes
    assert estimate.collectives == measured.collectives


def test_a_model_left_on_meta_is_a_clear_error() -> None:
    def build() -> nn.Module:
        with torch.device("meta"):
            model = nn.Linear(4, 4)
        fsdp2.fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        return model

    with pytest.raises(ValueError, match=r"meta device \(weight, bias\).*to_empty"):
        fsdp2.estimate_memory(build, lambda m: None, world_size=2)
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
def test_estimate_matches_measured_with_tensor_parallelism() -> None:
    """A (dp=2, tp=2) mesh: torch's parallelize_module inside each block, fully_shard over dp."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        model = Blocks(n=3, dim=32, hidden=128)
        for layer in model.layers:
            parallelize_module(layer, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            fsdp2.fully_shard(layer, mesh=mesh["dp"])
        fsdp2.fully_shard(model, mesh=mesh["dp"])
        return model, torch.optim.AdamW(model.parameters())

    estimate = fsdp2.estimate_memory(build, _plan_step, world_size=4)
    measured = measure_memory(4, build, _plan_step)[0]
    assert abs(estimate.peak_bytes - measured.peak_bytes) <= 0.10 * measured.peak_bytes
    assert estimate.collectives == measured.collectives
    assert estimate.collectives["all_reduce"] > 0  # the row-wise layers' all-reduce, counted too
