"""``plan``: the fastest wrapping whose peak fits a budget (or the one with the fewest collectives).

Owns: ``plan`` (validation, the choice of search), the search by time (``search_by_time``), the
calibration of the step-time model on this job (network fits and two timed real wrappings, or
before a job one timed unsharded step), and what ``Plan.explain`` says of it. Does not own: the
trials, ``Plan`` and the search by collectives (``_plan``), the model (``_cost``).

The search: a setting is a grouping (``k`` consecutive candidates per group, or root only), a bucket
cap (none, the cap the measured network implies if it packs two candidates, or one that packs 2 or 4
of the largest), and whether frozen parameters stay gathered; within it, the first ``m`` groups
reshard after forward. More resharding lowers the peak and adds all-gathers, so for each setting the
fewest resharding groups that fit (found by bisection on the simulated peak) is its fastest fitting
variant. Settings are visited by their predicted time with no resharding, a bound no variant beats,
and the search stops once that bound is no better than the runner-up found. Inside a job, when the
best two are predicted within ``TIE`` (3%) of each other, both are timed for real (the model cannot
resolve them) and the faster is taken. Where nothing fits, the groups are offloaded to CPU, largest
first, one more at a time, until the peak fits.

Inside a job the ranks must fail together: one that raised alone would leave the others waiting in
the next collective. So every step a rank could fail in alone (the checks, measuring the candidates
with one simulated rehearsal of ``train_step`` before any real step, building a timed wrapping, each
timed step, the search) ends in an exchange of how it went (``_together``), and where any rank
raised, every rank raises the first failing rank's error. The ranks' budgets may differ: the plan,
applied on every rank, fits the smallest.
"""

from __future__ import annotations

import dataclasses
import gc
import pickle
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ..runtime import MIB
from ._cost import NOMINAL_FITS, CostModel, GroupBytes, Setting, calibrate, measure_network
from ._memory import simulated_world
from ._plan import (
    OptimizerFactory,
    Plan,
    Search,
    apply_setting,
    by_collectives,
    candidate_names,
    device_type,
    fewest_resharding,
    group_sizes,
)

NOMINAL_PER_GROUP_S = 2e-4  # fsdp2's hooks and copies per group and step, before a job (CPU, measured)
TIMED_STEPS = 3  # per calibration run, after one untimed step
TIE = 0.03  # inside a job, the best two are timed for real when predicted this close
T = TypeVar("T")


def plan(
    build_model: Callable[[], nn.Module],
    train_step: Callable[[Any], Any],
    *,
    world_size: int,
    budget_bytes: int,
    objective: str = "time",
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

    With ``objective="time"`` (the default) the search covers the grouping of the candidates,
    ``reshard_after_forward`` per group, bucket caps, keeping frozen parameters gathered and, only
    where nothing else fits, CPU offload of the largest groups; among the settings whose estimated
    peak fits it returns the one with the lowest predicted step time. The prediction comes from a
    model measured on this job (see [Note: The step-time model] in ``fsdp2/plan/_cost.py``): called
    on every rank inside a running job of ``world_size`` ranks, it times the process group's
    collectives and two real wrappings of the model (a few steps each), and every rank gets the same
    plan; before a job, it times one unsharded step here and uses nominal network figures
    (``Plan.explain()`` says which). ``objective="collectives"`` returns the wrapping with the
    fewest collectives per step that fits (grouping and resharding only), and runs nothing for real.

    Inside a job (``objective="time"``), a failure on any rank (a bad argument, ``train_step``
    raising in a simulated or a timed step, nothing fitting) is raised on every rank, the same
    error; where the ranks give different budgets the plan fits the smallest. A timed step that fails
    on one rank between the step's collectives still leaves the others waiting in that collective.

    Args:
        build_model: returns a fresh, unsharded model.
        train_step: one training step, called with ``(model, optimizer)``.
        world_size: the job's number of ranks.
        budget_bytes: the memory one rank may use (e.g. the GPU's memory minus a margin for the
            caching allocator and the CUDA context).
        objective: ``"time"`` or ``"collectives"``.
        optimizer: ``optimizer(params)`` builds the optimizer (default ``torch.optim.AdamW``).
        candidates: the modules that may get their own ``fully_shard`` call, in execution order: a
            list of names, or of module classes (every instance, in module order). Default: the
            children of the model's ``nn.ModuleList`` containers (transformer blocks).
        **fully_shard_kwargs: passed to every ``fully_shard`` call (``mp_policy``).

    Returns:
        The fitting :class:`Plan` with the lowest predicted step time (or the fewest collectives).

    Raises:
        PlanError: nothing fits; its ``best`` attribute is the lowest-peak plan. Inside a job, on
            every rank where it holds for one (as any other error of one rank).
        ValueError: a bad budget or objective, ``mesh``/``reshard_after_forward``/``offload_policy``
            given (the plan chooses them), or a running job whose size is not ``world_size``.
    """
    in_job = objective != "collectives" and dist.is_initialized() and dist.get_world_size() > 1

    def prepare() -> tuple[Search, list[str]]:
        _check_arguments(budget_bytes, objective, fully_shard_kwargs, world_size)
        make_optimizer = optimizer or (lambda params: torch.optim.AdamW(params))
        names = candidate_names(build_model, world_size, candidates)
        search = Search(build_model, train_step, world_size, make_optimizer, fully_shard_kwargs, budget_bytes)
        return search, names

    if not in_job:
        search, names = prepare()
        return search_by_time(search, names) if objective == "time" else by_collectives(search, names)
    # Inside a job a rank that fails here would leave the others waiting in the search's first
    # collective: every rank checks, then all raise the first failing rank's error.
    (search, names), budgets = _together(prepare, lambda prepared: prepared[0].budget_bytes)
    notes = []
    if len(set(budgets)) > 1:  # the plan is applied on every rank: it must fit the smallest
        search.budget_bytes = min(budgets)
        notes.append(
            "budget: the smallest the ranks gave ("
            + ", ".join(f"rank {rank}: {b / MIB:.2f} MiB" for rank, b in enumerate(budgets))
            + ")"
        )
    return search_by_time(search, names, notes)


def _check_arguments(
    budget_bytes: object, objective: str, fully_shard_kwargs: dict[str, Any], world_size: int
) -> None:
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes <= 0:
        raise ValueError(f"plan: budget_bytes must be a positive int, got {budget_bytes!r}.")
    if objective not in ("time", "collectives"):
        raise ValueError(f"plan: objective is 'time' or 'collectives', got {objective!r}.")
    chosen = sorted({"mesh", "reshard_after_forward", "offload_policy"} & set(fully_shard_kwargs))
    if chosen:
        raise ValueError(
            f"plan chooses the mesh (1-D over world_size ranks), reshard_after_forward and CPU offload "
            f"itself; do not pass {', '.join(chosen)}, and give the mesh to Plan.apply instead."
        )
    if objective == "time" and dist.is_initialized() and dist.get_world_size() != world_size:
        raise ValueError(
            f"plan: this job has {dist.get_world_size()} ranks but world_size={world_size}; the time "
            "objective measures the job it runs in. Plan for another size before a job, or pass "
            "objective='collectives'."
        )


def search_by_time(search: Search, names: list[str], notes: Sequence[str] = ()) -> Plan:
    in_job = dist.is_initialized() and dist.get_world_size() > 1

    def sizes_and_a_rehearsal() -> dict[str, GroupBytes]:
        sizes = _candidate_bytes(search, names)
        if in_job:  # train_step runs once on every rank, simulated, before any real step
            search.trial_setting(Setting(tuple((n,) for n in names), (True,) * len(names)))
        return sizes

    if in_job:
        sizes, everyone = _together(sizes_and_a_rehearsal, lambda found: sorted(found.items()))
        _same_model_everywhere(everyone)  # before any real step: different models would hang in it
    else:
        sizes = sizes_and_a_rehearsal()
    model, found, device = _cost_model(search, names, sizes)
    if in_job:  # the ranks agree on the outcome before timing a near tie (real steps again)
        fitting, everyone = _together(
            lambda: _search(search, names, sizes, model, device),
            lambda fitting: [plan.setting for _, plan in fitting[:2]],
        )
        _same_choice_everywhere(everyone)
    else:
        fitting = _search(search, names, sizes, model, device)
    reasons = [*notes, *found, *_runner_up(fitting)]
    if in_job:
        fitting, tie = _settle_a_tie(search, fitting)
        reasons += tie
    best_time, best = fitting[0]
    return dataclasses.replace(
        best, tried=search.tried(), predicted_step_s=best_time, objective="time", reasons=reasons
    )


def _search(
    search: Search, names: list[str], sizes: dict[str, GroupBytes], model: CostModel, device: str
) -> list[tuple[float, Plan]]:
    """The fitting plans visited, fastest predicted first (raises ``PlanError`` where none fits)."""
    frozen = any(g.frozen for g in sizes.values())
    settings: list[tuple[float, Setting]] = []
    # caps: none, the one the network implies, and ones that pack 2 or 4 of the largest candidates
    largest = max(g.total for g in sizes.values())
    smallest = min(sizes[name].total for name in names)
    packing = {round(b * largest / MIB, 3) for b in (2, 4)}
    measured = round(model.all_gather.cap() / MIB, 1)
    if measured * MIB >= 2 * smallest:  # a cap below two candidates packs nothing
        packing.add(measured)
    caps: list[float | None] = [None, *sorted(packing)]
    for k in [0, *group_sizes(len(names))]:
        groups = tuple(tuple(names[i : i + k]) for i in range(0, len(names), k)) if k else ()
        for cap in caps if len(groups) > 1 else [None]:  # one group and the root: nothing to pack
            for keep in (False, True) if frozen else (False,):
                setting = Setting(groups, (False,) * len(groups), cap, keep)
                settings.append((_predict(model, setting, sizes), setting))
    settings.sort(key=lambda item: item[0])
    fitting: list[tuple[float, Plan]] = []
    lowest: dict[tuple[tuple[str, ...], ...], bool] = {}  # grouping -> its lowest-peak variant fits
    for bound, setting in settings:
        times = sorted(t for t, _ in fitting)
        if len(times) >= 2 and bound >= times[1]:
            break  # no variant of this setting (or a later one) beats the best or the runner-up
        if setting.groups not in lowest:  # buckets and kept frozen parameters only add memory
            plain = Setting(setting.groups, (True,) * len(setting.groups))
            lowest[setting.groups] = search.trial_setting(plain).fits
        if not lowest[setting.groups]:
            continue
        found = _fewest_resharding_of(search, setting)
        if found is not None:
            fitting.append((_predict(model, found.setting, sizes), found))
    if not fitting:
        if device == "cpu":  # the parameters are in host memory already: offload frees nothing
            search.fail()
        offloaded = _offload_until_it_fits(search, names, sizes)
        fitting.append((_predict(model, offloaded.setting, sizes), offloaded))
    fitting.sort(key=lambda item: (item[0], item[1].peak_bytes))
    return fitting


def _settle_a_tie(
    search: Search, fitting: list[tuple[float, Plan]]
) -> tuple[list[tuple[float, Plan]], list[str]]:
    """Inside a job, time the best two for real when their predictions are within ``TIE``."""
    others = [(t, p) for t, p in fitting[1:] if p.setting != fitting[0][1].setting]
    if not others or others[0][0] > fitting[0][0] * (1 + TIE):
        return fitting, []
    world = dist.get_world_size()
    (_, first), (_, second) = fitting[0], others[0]
    measured = [_time_wrapped(search, plan.setting, world)[0] for plan in (first, second)]
    line = (
        f"near tie (predicted within {TIE:.0%}): timed {measured[0] * 1e3:.2f} ms for "
        f"{first.setting.describe()} and {measured[1] * 1e3:.2f} ms for {second.setting.describe()}"
    )
    if measured[1] < measured[0]:
        return [others[0], *[item for item in fitting if item[1] is not second]], [line + ": took the latter"]
    return fitting, [line + ": kept the former"]


def _fewest_resharding_of(search: Search, setting: Setting) -> Plan | None:
    if not setting.groups:  # root only: nothing to reshard
        found = search.trial_setting(setting)
        return found if found.fits else None

    def trial(groups: list[list[str]], rafs: list[bool]) -> Plan:
        return search.trial_setting(dataclasses.replace(setting, reshard_after_forward=tuple(rafs)))

    return fewest_resharding([list(g) for g in setting.groups], trial)


def _offload_until_it_fits(search: Search, names: list[str], sizes: dict[str, GroupBytes]) -> Plan:
    groups = tuple((name,) for name in names)
    order = sorted(range(len(names)), key=lambda i: (-sizes[names[i]].total, i))
    offload = [False] * len(names)
    for index in order:
        offload[index] = True
        found = search.trial_setting(Setting(groups, (True,) * len(groups), None, False, tuple(offload)))
        if found.fits:
            return found
    search.fail()
    raise AssertionError("unreachable")  # fail() raises


def _runner_up(fitting: Sequence[tuple[float, Plan]]) -> list[str]:
    best_time, best = fitting[0]
    lines = [
        f"chosen: {best.setting.describe()}: predicted {best_time * 1e3:.2f} ms, peak "
        f"{best.peak_bytes / MIB:.2f} MiB"
    ]
    others = [(t, p) for t, p in fitting[1:] if p.setting != best.setting]
    if others:
        t, p = others[0]
        lines.append(
            f"runner-up: {p.setting.describe()}: predicted {t * 1e3:.2f} ms ({t / best_time - 1:+.1%}), "
            f"peak {p.peak_bytes / MIB:.2f} MiB"
        )
    return lines


def _together(fn: Callable[[], T], share: Callable[[T], Any] = lambda _: None) -> tuple[T, list[Any]]:
    """Run ``fn`` on this rank, then agree with every rank of the job on how it went.

    Where any rank raised, every rank raises the error of the first that did (a copy of it, with a
    note naming the ranks), so no rank goes on to a collective the others will never issue. Returns
    this rank's result and what ``share`` made of each rank's result, in rank order.
    """
    own: Exception | None = None
    try:
        value = fn()
        mine: tuple[bytes | None, Any] = (None, share(value))
    except Exception as exc:  # any failure: the other ranks must hear of it before they wait
        own = exc
        mine = (_portable(exc), None)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    failed = [rank for rank, (error, _) in enumerate(everyone) if error is not None]
    if failed:
        first = failed[0]
        mine_first = dist.get_rank() == first and own is not None
        error: Exception = own if mine_first and own is not None else pickle.loads(everyone[first][0])
        ranks = f"rank {first}" if len(failed) == 1 else f"ranks {failed} (the error is rank {first}'s)"
        if sys.version_info >= (3, 11):  # notes are new in 3.11
            error.add_note(f"fsdp2.plan: raised on {ranks} of the job; every rank raises it.")
        if error is own:
            raise error
        raise error from own
    return value, [shared for _, shared in everyone]


def _portable(exc: Exception) -> bytes:
    """``exc`` pickled for the other ranks (a ``RuntimeError`` saying the same where it does not pickle)."""
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
        return data
    except Exception:  # an exception type that does not survive pickling: keep its name and message
        return pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))


def _same_model_everywhere(everyone: list[Any]) -> None:
    """Raise on every rank if its ranks built different models (names and bytes of the candidates)."""
    differ = [rank for rank, seen in enumerate(everyone) if seen != everyone[0]]
    if differ:
        raise ValueError(
            f"fsdp2.plan: ranks {differ} built another model than rank 0 (other candidate modules or "
            "parameter sizes); build_model must build the same model on every rank, and plan must be "
            "called on every rank of the job."
        )


def _same_choice_everywhere(everyone: list[list[Setting]]) -> None:
    """Raise on every rank if the ranks' searches put other wrappings first (all rank from agreed figures)."""
    differ = [rank for rank, settings in enumerate(everyone) if settings != everyone[0]]
    if differ:  # every rank sees the same list: all raise together
        theirs, ours = everyone[differ[0]], everyone[0]
        raise RuntimeError(
            f"fsdp2.plan: ranks {differ} chose other wrappings than rank 0 "
            f"({', '.join(s.describe() for s in theirs)} against {', '.join(s.describe() for s in ours)}); "
            "build_model and train_step must be the same on every rank."
        )


def _predict(model: CostModel, setting: Setting, sizes: dict[str, GroupBytes]) -> float:
    return model.predict(setting, *_shape(setting, sizes))


def _shape(setting: Setting, sizes: dict[str, GroupBytes]) -> tuple[list[GroupBytes], GroupBytes]:
    """The bytes of each group of ``setting`` and of the root (its own and every candidate left to it)."""
    groups = [_sum(f"group {i}", [sizes[n] for n in names]) for i, names in enumerate(setting.groups)]
    grouped = {n for names in setting.groups for n in names}
    return groups, _sum("", [part for name, part in sizes.items() if name not in grouped])


def _sum(name: str, parts: Sequence[GroupBytes]) -> GroupBytes:
    return GroupBytes(name, sum(p.total for p in parts), sum(p.trainable for p in parts))


def _candidate_bytes(search: Search, names: list[str]) -> dict[str, GroupBytes]:
    """Gathered bytes per candidate (``""``: the root's own), from one simulated build."""
    dtype = getattr(search.shard_kwargs.get("mp_policy"), "param_dtype", None)
    with simulated_world(search.world_size):
        model = search.build_model()
        out: dict[str, GroupBytes] = {}
        taken: set[int] = set()
        for name in names:
            params = list(model.get_submodule(name).parameters())
            taken |= {id(p) for p in params}
            out[name] = _bytes_of(name, params, dtype)
        out[""] = _bytes_of("", [p for p in model.parameters() if id(p) not in taken], dtype)
    return out


def _bytes_of(name: str, params: Sequence[nn.Parameter], dtype: torch.dtype | None) -> GroupBytes:
    def size(p: nn.Parameter) -> int:
        cast = dtype is not None and p.is_floating_point()
        return p.numel() * (dtype.itemsize if cast and dtype is not None else p.element_size())

    return GroupBytes(name, sum(size(p) for p in params), sum(size(p) for p in params if p.requires_grad))


def _cost_model(
    search: Search, names: list[str], sizes: dict[str, GroupBytes]
) -> tuple[CostModel, list[str], str]:
    """The step-time model of this job, lines saying where its figures came from, the device type."""
    if not dist.is_initialized():
        seconds, device = _time_unsharded(search)
        fit = NOMINAL_FITS.get(device, NOMINAL_FITS["cpu"])
        cost = CostModel(fit, fit, seconds, NOMINAL_PER_GROUP_S, device == "cuda", False)
        return (
            cost,
            [
                f"compute: {seconds * 1e3:.2f} ms per step, timed unsharded in this process (no job yet)",
                f"network: nominal for {device} (latency {fit.latency_s * 1e6:.0f} us, "
                f"{fit.bytes_per_second / 1e9:.1f} GB/s); plan inside the job to measure it",
            ],
            device,
        )
    world = dist.get_world_size()
    first = [(name,) for name in names]
    pairs = [tuple(names[i : i + 2]) for i in range(0, len(names), 2)]
    runs = [Setting(tuple(first), (True,) * len(first)), Setting(tuple(pairs), (True,) * len(pairs))]
    if len(pairs) == len(first):  # one candidate: compare with root only
        runs[1] = Setting((), ())
    timed, device = [], "cpu"
    for setting in runs:
        seconds, device = _time_wrapped(search, setting, world)
        timed.append((seconds, setting))
    ag, rs = measure_network(dist.group.WORLD, torch.device(device))  # type: ignore[arg-type]
    zero = CostModel(ag, rs, 0.0, 0.0, device == "cuda", True)
    cost = calibrate(timed, [_shape(setting, sizes) for _, setting in timed], zero)
    return (
        cost,
        [
            f"network (measured on the job's {world} ranks): all-gather {ag.latency_s * 1e6:.0f} us + "
            f"{ag.bytes_per_second / 1e9:.2f} GB/s, reduce-scatter {rs.latency_s * 1e6:.0f} us + "
            f"{rs.bytes_per_second / 1e9:.2f} GB/s",
            f"compute: {cost.compute_s * 1e3:.2f} ms per step, per group {cost.per_group_s * 1e3:.3f} ms "
            f"(from timed steps: {', '.join(f'{s.describe()} {t * 1e3:.2f} ms' for t, s in timed)})",
        ],
        device,
    )


def _time_wrapped(search: Search, setting: Setting, world: int) -> tuple[float, str]:
    """Median seconds of a real step under ``setting`` (each the slowest rank's) on this job, and the device.

    The ranks agree after building and after every step, so one that fails where the others do not
    wait on it (before its first collective or after its last) fails them all.
    """

    def prepared() -> tuple[nn.Module, torch.optim.Optimizer, str]:
        model = search.build_model()
        device = device_type(model)
        apply_setting(model, setting, {"mesh": init_device_mesh(device, (world,)), **search.shard_kwargs})
        return model, search.make_optimizer(model.parameters()), device

    (model, optimizer, device), _ = _together(prepared)
    seconds = _agreed_steps(search, model, optimizer, device)
    del model, optimizer
    gc.collect()
    return seconds, device


def _agreed_steps(search: Search, model: nn.Module, optimizer: torch.optim.Optimizer, device: str) -> float:
    """The median of ``TIMED_STEPS`` steps after an untimed one, each the slowest rank's."""
    times: list[float] = []
    for _ in range(TIMED_STEPS + 1):
        _, everyone = _together(lambda: _timed_step(search, model, optimizer, device), lambda took: took)
        times.append(max(everyone))
    return statistics.median(times[1:])


def _time_unsharded(search: Search) -> tuple[float, str]:
    """Median seconds of a step of the plain model in this process (no job yet), and its device."""
    model = search.build_model()
    device = device_type(model)
    return _time_steps(search, model, device), device


def _time_steps(search: Search, model: nn.Module, device: str) -> float:
    optimizer = search.make_optimizer(model.parameters())
    times = [_timed_step(search, model, optimizer, device) for _ in range(TIMED_STEPS + 1)]
    return statistics.median(times[1:])  # the first step builds optimizer states: untimed


def _timed_step(search: Search, model: nn.Module, optimizer: torch.optim.Optimizer, device: str) -> float:
    if device != "cpu":
        torch.accelerator.synchronize()
    start = time.perf_counter()
    search.train_step((model, optimizer))
    if device != "cpu":
        torch.accelerator.synchronize()
    return time.perf_counter() - start
