"""Plans of how to wrap a model, their simulated trials, and the search by fewest collectives.

Owns: ``Plan`` (the choice, its estimate, ``explain`` and ``apply``), ``PlanError``, the default
candidates (the blocks of the model's ``nn.ModuleList`` containers), the simulated trial of one
setting (``Search``) and the search by collectives. Does not own: ``plan`` itself and the search by
time (``_planner``), the estimate (``_memory``), the step-time model (``_cost``), sharding
(``fully_shard``).

The search by collectives (``objective="collectives"``): blocks b0..b(n-1) in module order are
grouped ``k`` consecutive blocks per ``fully_shard`` call (``k`` from n down to 1, and "root only"
first); within a grouping the first ``m`` groups reshard after forward and the others keep their
parameters until backward (they are needed first there). Collectives per step = all-gathers (one
per group, one more per resharding group) + reduce-scatters (one per group), so fewer groups and
fewer resharding groups cost fewer collectives; for each ``k`` the smallest ``m`` that fits is found
by bisection (more resharding never raises the peak), and the cheapest fitting choice wins (ties:
the lower peak).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ..base import CPUOffloadPolicy
from ..frontend import fully_shard
from ..runtime import keep_frozen_gathered
from ._cost import Setting
from ._memory import MemoryReport, MemoryTracker, run_tracked, simulated_world

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which modules to ``fully_shard`` together and how, with the estimate that chose it.

    ``groups[i]`` lists the module names (as in ``named_modules``) of one ``fully_shard`` call,
    ``reshard_after_forward[i]`` its setting; the root is sharded last with the default.
    ``bucket_cap_mb``: given to ``set_bucket_cap_mb`` for both collectives (``None``: not called);
    ``keep_frozen``: ``keep_frozen_gathered`` is called on the root; ``offload[i]``: group ``i`` gets
    ``CPUOffloadPolicy``. ``predicted_step_s``: the step-time model's prediction (``objective="time"``).
    """

    world_size: int
    budget_bytes: int
    groups: list[list[str]]
    reshard_after_forward: list[bool]
    report: MemoryReport
    tried: list[tuple[str, int, int]]  # (description, peak bytes, collectives per step)
    bucket_cap_mb: float | None = None
    keep_frozen: bool = False
    offload: list[bool] = dataclasses.field(default_factory=list)
    predicted_step_s: float | None = None
    objective: str = "collectives"
    reasons: list[str] = dataclasses.field(default_factory=list)  # what ``explain`` says

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

    @property
    def setting(self) -> Setting:
        """The wrapping as the step-time model sees it."""
        return Setting(
            tuple(tuple(g) for g in self.groups),
            tuple(self.reshard_after_forward),
            self.bucket_cap_mb,
            self.keep_frozen,
            tuple(self.offload),
        )

    def apply(self, model: nn.Module, **fully_shard_kwargs: Any) -> nn.Module:
        """``fully_shard`` ``model`` as planned (groups bottom-up, then the root); returns ``model``.

        ``fully_shard_kwargs`` (``mesh``, ``mp_policy``, ...) go to every call; give the same ones
        ``plan`` was given. Then the bucket cap and the frozen parameters' residency are set on the
        root, as planned.
        """
        fully_shard_kwargs.pop("reshard_after_forward", None)
        apply_setting(model, self.setting, fully_shard_kwargs)
        return model

    def explain(self) -> str:
        """Why this wrapping: the objective, the measured constants, and what the runner-up costs."""
        return "\n".join([str(self), *self.reasons])

    def __str__(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit"
        peak, budget = self.peak_bytes / 2**20, self.budget_bytes / 2**20
        step_s = self.predicted_step_s
        predicted = "" if step_s is None else f", predicted {step_s * 1e3:.1f} ms per step"
        lines = [
            f"plan for {self.world_size} ranks: peak {peak:.2f} MiB per rank {verdict} the budget of "
            f"{budget:.2f} MiB; {self.collectives_per_step} collectives per step{predicted}",
        ]
        offload = self.offload or [False] * len(self.groups)
        for names, raf, off in zip(self.groups, self.reshard_after_forward, offload, strict=True):
            shown = names[0] if len(names) == 1 else f"[{names[0]} .. {names[-1]}] ({len(names)} modules)"
            extra = ", offload_policy=CPUOffloadPolicy()" if off else ""
            lines.append(f"  fully_shard({shown}, reshard_after_forward={raf}{extra})")
        lines.append("  fully_shard(<root>)")
        if self.bucket_cap_mb is not None:
            lines.append(f"  <root>.set_bucket_cap_mb({self.bucket_cap_mb:g})")
        if self.keep_frozen:
            lines.append("  fsdp2.keep_frozen_gathered(<root>)")
        return "\n".join(lines)


def apply_setting(model: nn.Module, setting: Setting, kwargs: dict[str, Any]) -> None:
    """``fully_shard`` each group of named modules (bottom-up), the root, then the root's settings."""
    offload = setting.offload or (False,) * len(setting.groups)
    for names, raf, off in zip(setting.groups, setting.reshard_after_forward, offload, strict=True):
        modules = [model.get_submodule(name) for name in names]
        extra: dict[str, Any] = {"offload_policy": CPUOffloadPolicy()} if off else {}
        target: Any = modules if len(modules) > 1 else modules[0]
        fully_shard(target, reshard_after_forward=raf, **kwargs, **extra)
    fully_shard(model, **kwargs)
    if setting.bucket_cap_mb is not None:
        model.set_bucket_cap_mb(setting.bucket_cap_mb)  # type: ignore[operator]
    if setting.keep_frozen:
        keep_frozen_gathered(model)


class PlanError(RuntimeError):
    """No wrapping fits the budget; ``best`` is the plan with the lowest peak."""

    def __init__(self, message: str, best: Plan) -> None:
        super().__init__(message)
        self.best = best

    def __reduce__(self) -> tuple[Any, ...]:  # inside a job, every rank raises the same one
        return (type(self), (str(self), self.best), self.__dict__)


def by_collectives(search: Search, names: list[str]) -> Plan:
    """The fitting wrapping with the fewest collectives per step (see the module's docstring)."""
    best: Plan | None = None
    root_only = search.trial([], [])
    if root_only.fits:
        best = root_only
    for k in group_sizes(len(names)):
        groups = [names[i : i + k] for i in range(0, len(names), k)]
        if best is not None and best.collectives_per_step <= 2 * len(groups):
            continue  # each group gathers and reduces at least once: cannot beat the best
        fit = fewest_resharding(groups, search.trial)
        if fit is not None and (best is None or _cost(fit) < _cost(best)):
            best = fit
    if best is None:
        search.fail()
    assert best is not None
    return dataclasses.replace(best, tried=search.tried())


def _cost(p: Plan) -> tuple[int, int]:
    return p.collectives_per_step, p.peak_bytes


def group_sizes(n: int) -> list[int]:
    """Group sizes to try: n, then halving down to 1 (and every size up to 4)."""
    sizes = {n, *range(1, min(n, 4) + 1)}
    k = n
    while k > 1:
        k = (k + 1) // 2
        sizes.add(k)
    return sorted(sizes, reverse=True)


def fewest_resharding(
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


class Search:
    """Runs trials: build, shard as proposed, two steps, in a simulated world; keeps every trial."""

    def __init__(
        self,
        build_model: Callable[[], nn.Module],
        train_step: Callable[[Any], Any],
        world_size: int,
        make_optimizer: OptimizerFactory,
        shard_kwargs: dict[str, Any],
        budget_bytes: int,
    ) -> None:
        self.build_model = build_model
        self.train_step = train_step
        self.world_size = world_size
        self.make_optimizer = make_optimizer
        self.shard_kwargs = shard_kwargs
        self.budget_bytes = budget_bytes
        self.trials: list[Plan] = []
        self.seen: dict[Setting, Plan] = {}

    def trial(self, groups: list[list[str]], rafs: list[bool]) -> Plan:
        """The plan of ``groups`` with ``rafs``, its peak estimated (the other settings off)."""
        return self.trial_setting(Setting(tuple(tuple(g) for g in groups), tuple(rafs)))

    def trial_setting(self, setting: Setting) -> Plan:
        """The plan of ``setting`` with its estimated peak (each setting is simulated once)."""
        seen = self.seen.get(setting)
        if seen is not None:
            return seen
        report = self.estimate(setting)
        result = Plan(
            self.world_size,
            self.budget_bytes,
            [list(g) for g in setting.groups],
            list(setting.reshard_after_forward),
            report,
            [],
            setting.bucket_cap_mb,
            setting.keep_frozen,
            list(setting.offload),
        )
        self.trials.append(result)
        self.seen[setting] = result
        return result

    def estimate(self, setting: Setting) -> MemoryReport:
        def build() -> tuple[nn.Module, torch.optim.Optimizer]:
            model = self.build_model()
            # The job's mesh exists before the model and lives in host memory (its rank map is on
            # the CPU whatever the device), and Plan.apply is given it: not the wrapping's memory.
            with tracker.outside_the_model():
                mesh = init_device_mesh(device_type(model), (self.world_size,))
            apply_setting(model, setting, {"mesh": mesh, **self.shard_kwargs})
            return model, self.make_optimizer(model.parameters())

        tracker = MemoryTracker(simulate=True)
        with simulated_world(self.world_size):
            run_tracked(tracker, build, self.train_step, 2)
        return tracker.report(self.world_size, 0)

    def tried(self) -> list[tuple[str, int, int]]:
        return [(t.setting.describe(), t.peak_bytes, t.collectives_per_step) for t in self.trials]

    def fail(self) -> None:
        """Raise ``PlanError`` with the lowest-peak trial."""
        lowest = min(self.trials, key=lambda t: t.peak_bytes)
        lowest = dataclasses.replace(lowest, tried=self.tried())
        over = lowest.peak_bytes - self.budget_bytes
        close = f" ({over:,} bytes over)" if f"{over / 2**20:.2f}" in ("0.00", "-0.00") else ""
        raise PlanError(
            f"no wrapping of this model fits {self.budget_bytes / 2**20:.2f} MiB per rank at "
            f"{self.world_size} ranks; the lowest estimated peak is {lowest.peak_bytes / 2**20:.2f} MiB"
            f"{close} ({lowest.setting.describe()}). Use more ranks, bf16 parameters (MixedPrecisionPolicy), "
            "activation checkpointing or a smaller batch.",
            lowest,
        )


def device_type(model: nn.Module) -> str:
    tensor = next(model.parameters(), None)
    return "cpu" if tensor is None or tensor.device.type == "meta" else tensor.device.type


def candidate_names(
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
