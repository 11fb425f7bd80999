"""Choose how to wrap a model so one rank's peak fits a byte budget with the fewest collectives.

Owns: ``plan`` (the search), ``Plan`` (the choice, its estimate, and ``apply``), the default
candidates (the blocks of the model's ``nn.ModuleList`` containers). Does not own: the estimate
(``_memory``), sharding (``fully_shard``).

The search: blocks b0..b(n-1) in module order are grouped ``k`` consecutive blocks per
``fully_shard`` call (``k`` from n down to 1, and "root only" first); within a grouping the first
``m`` groups reshard after forward and the others keep their parameters until backward (they are
needed first there). Collectives per step = all-gathers (one per group, one more per resharding
group) + reduce-scatters (one per group), so fewer groups and fewer resharding groups cost fewer
collectives; for each ``k`` the smallest ``m`` that fits is found by bisection (more resharding
never raises the peak), and the cheapest fitting choice wins (ties: the lower peak).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ..frontend._fully_shard import fully_shard
from ._memory import MemoryReport, MemoryTracker, run_tracked, simulated_world

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which modules to ``fully_shard`` together and how, with the estimate that chose it.

    ``groups[i]`` lists the module names (as in ``named_modules``) of one ``fully_shard`` call,
    ``reshard_after_forward[i]`` its setting; the root is sharded last with the default.
    """

    world_size: int
    budget_bytes: int
    groups: list[list[str]]
    reshard_after_forward: list[bool]
    report: MemoryReport
    tried: list[tuple[str, int, int]]  # (description, peak bytes, collectives per step)

    @property
    def peak_bytes(self) -> int:
        """The estimated peak of a training step (building the model is left out: see ``report``)."""
        return self.report.step_peak_bytes

    @property
    def collectives_per_step(self) -> int:
        """All-gathers, reduce-scatters and all-reduces one rank issued per step in the estimate."""
        counts = self.report.collectives
        return round(sum(counts.get(k, 0) for k in ("all_gather", "reduce_scatter", "all_reduce")))

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.budget_bytes

    def apply(self, model: nn.Module, **fully_shard_kwargs: Any) -> nn.Module:
        """``fully_shard`` ``model`` as planned (groups bottom-up, then the root); returns ``model``.

        ``fully_shard_kwargs`` (``mesh``, ``mp_policy``, ...) go to every call; give the same ones
        ``plan`` was given.
        """
        fully_shard_kwargs.pop("reshard_after_forward", None)
        _shard(model, self.groups, self.reshard_after_forward, fully_shard_kwargs)
        return model

    def __str__(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit"
        peak, budget = self.peak_bytes / 2**20, self.budget_bytes / 2**20
        lines = [
            f"plan for {self.world_size} ranks: peak {peak:.2f} MiB per rank {verdict} the budget of "
            f"{budget:.2f} MiB; {self.collectives_per_step} collectives per step",
        ]
        for names, raf in zip(self.groups, self.reshard_after_forward, strict=True):
            shown = names[0] if len(names) == 1 else f"[{names[0]} .. {names[-1]}] ({len(names)} modules)"
            lines.append(f"  fully_shard({shown}, reshard_after_forward={raf})")
        lines.append("  fully_shard(<root>)")
        return "\n".join(lines)


def _shard(model: nn.Module, groups: list[list[str]], rafs: list[bool], kwargs: dict[str, Any]) -> None:
    """``fully_shard`` each group of named modules (bottom-up), then the root."""
    for names, raf in zip(groups, rafs, strict=True):
        modules = [model.get_submodule(name) for name in names]
        fully_shard(modules if len(modules) > 1 else modules[0], reshard_after_forward=raf, **kwargs)
    fully_shard(model, **kwargs)


class PlanError(RuntimeError):
    """No wrapping fits the budget; ``best`` is the plan with the lowest peak."""

    def __init__(self, message: str, best: Plan) -> None:
        super().__init__(message)
        self.best = best


def plan(
    build_model: Callable[[], nn.Module],
    train_step: Callable[[Any], Any],
    *,
    world_size: int,
    budget_bytes: int,
    optimizer: OptimizerFactory | None = None,
    candidates: Sequence[str] | Sequence[type[nn.Module]] | None = None,
    **fully_shard_kwargs: Any,
) -> Plan:
    """Propose how to ``fully_shard`` a model so one rank's peak memory fits ``budget_bytes``.

    ``build_model()`` returns the model *unsharded* (no ``fully_shard`` calls); every trial builds
    it in a simulated world of ``world_size`` ranks (see :func:`fsdp2.estimate_memory`: fake
    tensors, nothing allocated), shards it on a 1-D mesh over all ranks with ``fully_shard_kwargs``
    (e.g. ``mp_policy``), creates ``optimizer(model.parameters())`` (default AdamW) and runs
    ``train_step((model, optimizer))`` twice.

    Args:
        build_model: returns a fresh, unsharded model.
        train_step: one training step, called with ``(model, optimizer)``.
        world_size: the job's number of ranks.
        budget_bytes: the memory one rank may use (e.g. the GPU's memory minus a margin for the
            caching allocator and the CUDA context).
        optimizer: ``optimizer(params)`` builds the optimizer (default ``torch.optim.AdamW``).
        candidates: the modules that may get their own ``fully_shard`` call, in execution order: a
            list of names, or of module classes (every instance, in module order). Default: the
            children of the model's ``nn.ModuleList`` containers (transformer blocks).
        **fully_shard_kwargs: passed to every ``fully_shard`` call (``mp_policy``, ``offload_policy``).

    Returns:
        The :class:`Plan` with the fewest collectives per step whose peak fits.

    Raises:
        PlanError: nothing fits; its ``best`` attribute is the lowest-peak plan.
    """
    budget: object = budget_bytes
    if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
        raise ValueError(f"plan: budget_bytes must be a positive int, got {budget_bytes!r}.")
    if "mesh" in fully_shard_kwargs or "reshard_after_forward" in fully_shard_kwargs:
        raise ValueError(
            "plan chooses the mesh (1-D over world_size ranks) and reshard_after_forward itself; "
            "pass neither, and give the mesh to Plan.apply instead."
        )
    make_optimizer = optimizer or (lambda params: torch.optim.AdamW(params))
    names = _candidate_names(build_model, world_size, candidates)
    search = _Search(build_model, train_step, world_size, make_optimizer, fully_shard_kwargs)
    trials: list[Plan] = []

    def trial(groups: list[list[str]], rafs: list[bool]) -> Plan:
        result = Plan(world_size, budget_bytes, groups, rafs, search.estimate(groups, rafs), [])
        trials.append(result)
        return result

    best: Plan | None = None
    root_only = trial([], [])
    if root_only.fits:
        best = root_only
    for k in _group_sizes(len(names)):
        groups = [names[i : i + k] for i in range(0, len(names), k)]
        if best is not None and best.collectives_per_step <= 2 * len(groups):
            continue  # each group gathers and reduces at least once: cannot beat the best
        fit = _fewest_resharding(groups, trial)
        if fit is not None and (best is None or _cost(fit) < _cost(best)):
            best = fit
    tried = [(_describe(t), t.peak_bytes, t.collectives_per_step) for t in trials]
    if best is None:
        lowest = min(trials, key=lambda t: t.peak_bytes)
        lowest = dataclasses.replace(lowest, tried=tried)
        raise PlanError(
            f"no wrapping of this model fits {budget_bytes / 2**20:.2f} MiB per rank at {world_size} ranks; "
            f"the lowest estimated peak is {lowest.peak_bytes / 2**20:.2f} MiB ({_describe(lowest)}). Use "
            "more ranks, bf16 parameters (MixedPrecisionPolicy), CPU offload, activation checkpointing or a "
            "smaller batch.",
            lowest,
        )
    return dataclasses.replace(best, tried=tried)


def _cost(p: Plan) -> tuple[int, int]:
    return p.collectives_per_step, p.peak_bytes


def _describe(p: Plan) -> str:
    if not p.groups:
        return "root only"
    size = max(len(g) for g in p.groups)
    groups = f"{len(p.groups)} group{'s' if len(p.groups) > 1 else ''}"
    return f"{groups} of up to {size}, {sum(p.reshard_after_forward)} resharding after forward"


def _group_sizes(n: int) -> list[int]:
    """Group sizes to try: n, then halving down to 1 (and every size up to 4)."""
    sizes = {n, *range(1, min(n, 4) + 1)}
    k = n
    while k > 1:
        k = (k + 1) // 2
        sizes.add(k)
    return sorted(sizes, reverse=True)


def _fewest_resharding(
    groups: list[list[str]], trial: Callable[[list[list[str]], list[bool]], Plan]
) -> Plan | None:
    """The fitting plan with the fewest resharding groups (the earliest groups reshard first)."""
    n = len(groups)
    lo, hi = 0, n
    best = trial(groups, [True] * n)
    if not best.fits:
        return None
    while lo < hi:  # invariant: m = hi fits
        m = (lo + hi) // 2
        candidate = trial(groups, [i < m for i in range(n)])
        if candidate.fits:
            hi, best = m, candidate
        else:
            lo = m + 1
    return best


class _Search:
    """Runs one trial: build, shard as proposed, two steps, in a simulated world."""

    def __init__(
        self,
        build_model: Callable[[], nn.Module],
        train_step: Callable[[Any], Any],
        world_size: int,
        make_optimizer: OptimizerFactory,
        shard_kwargs: dict[str, Any],
    ) -> None:
        self.build_model = build_model
        self.train_step = train_step
        self.world_size = world_size
        self.make_optimizer = make_optimizer
        self.shard_kwargs = shard_kwargs

    def estimate(self, groups: list[list[str]], rafs: list[bool]) -> MemoryReport:
        def build() -> tuple[nn.Module, torch.optim.Optimizer]:
            model = self.build_model()
            mesh = init_device_mesh(_device_type(model), (self.world_size,))
            _shard(model, groups, rafs, {"mesh": mesh, **self.shard_kwargs})
            return model, self.make_optimizer(model.parameters())

        tracker = MemoryTracker(simulate=True)
        with simulated_world(self.world_size):
            run_tracked(tracker, build, self.train_step, 2)
        return tracker.report(self.world_size, 0)


def _device_type(model: nn.Module) -> str:
    tensor = next(model.parameters(), None)
    return "cpu" if tensor is None or tensor.device.type == "meta" else tensor.device.type


def _candidate_names(
    build_model: Callable[[], nn.Module],
    world_size: int,
    candidates: Sequence[str] | Sequence[type[nn.Module]] | None,
) -> list[str]:
    with simulated_world(world_size):
        model = build_model()
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"plan: build_model must return the unsharded nn.Module, got {type(model).__name__}."
            )
        named = dict(model.named_modules())
        if candidates is None:
            names = [
                f"{parent}.{child}" if parent else child
                for parent, module in named.items()
                if isinstance(module, nn.ModuleList)
                for child, _ in module.named_children()
            ]
            names = names or [name for name, _ in model.named_children()]
        elif all(isinstance(c, str) for c in candidates):
            missing = [c for c in candidates if c not in named or c == ""]
            if missing:
                raise ValueError(
                    f"plan: candidates {missing} are not submodules of the model (names as in named_modules)."
                )
            names = list(candidates)  # type: ignore[arg-type]
        elif all(isinstance(c, type) and issubclass(c, nn.Module) for c in candidates):
            classes = tuple(c for c in candidates if isinstance(c, type))
            names = [name for name, m in named.items() if name and isinstance(m, classes)]
        else:
            raise TypeError(
                "plan: candidates must be module names or nn.Module classes, not a mix; "
                f"got {list(candidates)!r}."
            )
    names = [n for n in names if not any(n.startswith(other + ".") for other in names)]
    if not names:
        raise ValueError(
            "plan: found no candidate modules to shard; pass candidates=[...] (names or classes)."
        )
    return names
