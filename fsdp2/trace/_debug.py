"""Debug mode: errors instead of hangs when ranks disagree (``FSDP2_DEBUG=1`` or ``set_debug(True)``).

Owns: the debug switch and its settings; the model fingerprint check run by the root's lazy init (every
rank compares the names, shapes, dtypes and group layout of the parameters it manages with the others'
through one small collective per process group, and all ranks raise the same error naming the first
difference); the collective watchdog (a collective still unfinished after ``deadline`` seconds reports
the group, collective and training state it waits in); and the list of what runs at a root's lazy init
in debug mode (the divergence guard of ``_guard.py`` registers there, so the engine never imports it).
Does not own: what is compared (``FSDPState`` hands the fingerprint in), the collectives
(``FSDPParamGroup``) or the per-collective agreement (``_guard``).
Invariants: with debug off, the only cost is one attribute read per check site.
"""

from __future__ import annotations

import contextlib
import itertools
import numbers
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from enum import Enum
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

ParamFingerprint = tuple[str, tuple[int, ...], str, str]  # (name, shape, dtype, group)


class _EnvSetting(NamedTuple):
    variable: str
    default: str
    parse: Callable[[str], Any]
    allowed: str
    ok: Callable[[Any], bool]


_SECONDS = "a positive number of seconds"
_STEPS = "a whole number of optimizer steps, 0 or more (0: never)"
# The numeric settings. Each variable is read when debug mode needs it (not at import), unless
# set_debug gave a value; a value it cannot use raises a ValueError naming the variable and its range.
_ENV: dict[str, _EnvSetting] = {
    "deadline_s": _EnvSetting("FSDP2_DEBUG_DEADLINE", "60", float, _SECONDS, lambda v: v > 0),
    "timeout_s": _EnvSetting("FSDP2_DEBUG_TIMEOUT", "8", float, _SECONDS, lambda v: v > 0),
    "replicas_every": _EnvSetting("FSDP2_DEBUG_REPLICAS", "100", int, _STEPS, lambda v: v >= 0),
    "straggler_fraction": _EnvSetting(
        "FSDP2_DEBUG_STRAGGLER", "0.1", float, "a fraction of a step in (0, 1]", lambda v: 0 < v <= 1
    ),
    "straggler_steps": _EnvSetting("FSDP2_DEBUG_STRAGGLER_STEPS", "10", int, _STEPS, lambda v: v >= 0),
}


class _Settings:
    enabled = os.environ.get("FSDP2_DEBUG", "") not in ("", "0")
    # None: not given to set_debug, so its variable in _ENV (or the default there) applies
    deadline_s: float | None = None
    timeout_s: float | None = None
    replicas_every: int | None = None  # optimizer steps; 0: never
    # a rank whose lateness costs the others this fraction of a step is named, checked every N steps
    straggler_fraction: float | None = None
    straggler_steps: int | None = None  # 0: never
    report: Callable[[str], None] | None = None  # where watchdog reports go (default: stderr)
    root_init_hooks: list[Callable[[Any, list[Any]], None]] = []  # noqa: RUF012 - one list, by design


_parsed: dict[tuple[str, str], Any] = {}  # (setting, its variable's text) -> the value, once checked


def _setting(key: str) -> Any:
    """One numeric setting: set_debug's value, else its environment variable's (checked), else the default."""
    value = getattr(_Settings, key)
    if value is not None:
        return value
    env = _ENV[key]
    text = os.environ.get(env.variable, env.default)
    value = _parsed.get((key, text))
    if value is None:
        try:
            value = env.parse(text.strip())
        except ValueError:
            value = None
        if value is None or not env.ok(value):
            raise ValueError(
                f"fsdp2 debug: {env.variable}={text!r} is not {env.allowed}. Set it to such a value "
                f"(default {env.default}) or unset it."
            )
        _parsed[(key, text)] = value
    return value


def check_environment(skip: Sequence[str] = ()) -> None:
    """Raise one ``ValueError`` naming every numeric ``FSDP2_DEBUG_*`` variable debug mode cannot use.

    Called where debug mode takes effect: ``set_debug(True)`` (``skip``: the settings it was given),
    and the root's lazy init with debug on.
    """
    problems = []
    for key in _ENV:
        if key not in skip:
            try:
                _setting(key)
            except ValueError as error:
                problems.append(str(error).removeprefix("fsdp2 debug: "))
    if problems:
        raise ValueError("fsdp2 debug: " + " ".join(problems))


def set_debug(
    enabled: bool,
    *,
    deadline: float | None = None,
    report: Callable[[str], None] | None = None,
    timeout: float | None = None,
    straggler: float | None = None,
    straggler_steps: int | None = None,
) -> None:
    """Turn fsdp2's debug checks on or off (also ``FSDP2_DEBUG=1`` in the environment).

    With debug on, the root's first forward checks that every rank manages the same parameters (one
    small collective); before each FSDP collective, the ranks of its process group agree that they are
    about to issue the same one, in the same optimizer step, and raise ``DivergenceError`` on every rank
    if not (or if a rank has not arrived after ``timeout`` seconds); and a collective that has not
    finished after ``deadline`` seconds is reported with its module group, kind and training state.
    Every ``straggler_steps`` optimizer steps the ranks compare how long each waited at those
    agreements, and a rank that kept the others waiting ``straggler`` of a step or more is named in a
    ``RuntimeWarning`` on every rank (with the module whose collective it reached late); every
    ``FSDP2_DEBUG_REPLICAS`` steps (default 100) ``check_replicas`` runs. Turn it on before the root's
    first forward: the guard is installed there. See docs/debugging.md.

    A setting not passed here comes from its ``FSDP2_DEBUG_*`` variable (or its default), checked when
    debug mode is turned on: here with ``enabled=True``, or at the root's first forward under
    ``FSDP2_DEBUG=1``.

    Args:
        enabled: on or off.
        deadline: seconds before an unfinished collective is reported (default 60, or
            ``FSDP2_DEBUG_DEADLINE``).
        report: called with each report (default: written to stderr).
        timeout: seconds a rank waits at an FSDP collective for the other ranks to reach it before it
            raises (default 8, or ``FSDP2_DEBUG_TIMEOUT``); raise it if a rank is legitimately that much
            slower between two collectives (data loading, logging, checkpoint writing on one rank).
        straggler: the fraction of a step (default 0.1, or ``FSDP2_DEBUG_STRAGGLER``) the other ranks
            must wait for one rank, on average over the checked steps, before it is named.
        straggler_steps: optimizer steps between straggler checks (default 10, or
            ``FSDP2_DEBUG_STRAGGLER_STEPS``; 0: never). The first step is never judged.

    Raises:
        TypeError: a ``deadline``, ``timeout`` or ``straggler`` that is not a number (nothing is changed).
        ValueError: a ``deadline`` or ``timeout`` that is not positive, a ``straggler`` fraction
            outside (0, 1] or a negative ``straggler_steps``; or, with ``enabled=True``, the variable of
            a setting not passed here holding a value outside its range (nothing is changed).
    """
    for name, value in (("deadline", deadline), ("timeout", timeout), ("straggler", straggler)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise TypeError(f"set_debug({name}=...) takes a number, got {value!r} ({type(value).__name__}).")
    for name, value in (("deadline", deadline), ("timeout", timeout)):
        if value is not None and not value > 0:
            raise ValueError(f"set_debug({name}=...) must be a positive number of seconds, got {value!r}.")
    if straggler is not None and not 0 < straggler <= 1:
        raise ValueError(f"set_debug(straggler=...) is a fraction of a step in (0, 1], got {straggler!r}.")
    steps: object = straggler_steps
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
        raise ValueError(
            f"set_debug(straggler_steps=...) is a count of optimizer steps (0: never), got {steps!r}."
        )
    if enabled:  # the settings not given here come from the environment: they must be usable
        given = {"deadline_s": deadline, "timeout_s": timeout, "straggler_fraction": straggler}
        given["straggler_steps"] = straggler_steps
        check_environment(skip=[key for key, value in given.items() if value is not None])
    _Settings.enabled = bool(enabled)
    if deadline is not None:
        _Settings.deadline_s = float(deadline)
    if timeout is not None:
        _Settings.timeout_s = float(timeout)
    _Settings.report = report
    if straggler is not None:
        _Settings.straggler_fraction = float(straggler)
    if straggler_steps is not None:
        _Settings.straggler_steps = int(straggler_steps)


def debug_enabled() -> bool:
    return _Settings.enabled


def replica_check_every() -> int:
    """Debug mode compares the replicas every this many optimizer steps (``FSDP2_DEBUG_REPLICAS``)."""
    return int(_setting("replicas_every"))


def straggler_fraction() -> float:
    """The share of a step the others must wait for one rank to name it (``FSDP2_DEBUG_STRAGGLER``)."""
    return float(_setting("straggler_fraction"))


def straggler_check_steps() -> int:
    """Optimizer steps between debug mode's straggler checks (``FSDP2_DEBUG_STRAGGLER_STEPS``)."""
    return int(_setting("straggler_steps"))


def guard_timeout() -> float:
    """Seconds a rank waits for the others at an FSDP collective in debug mode."""
    return float(_setting("timeout_s"))


def on_root_init(hook: Callable[[Any, list[Any]], None]) -> None:
    """Run ``hook(root_module, states)`` at each root's lazy init while debug mode is on."""
    _Settings.root_init_hooks.append(hook)


def run_root_init_hooks(root_module: Any, states: list[Any]) -> None:
    for hook in _Settings.root_init_hooks:
        hook(root_module, states)


def check_same_model(
    fingerprint: Sequence[ParamFingerprint], groups: Sequence[dist.ProcessGroup], root_name: str
) -> None:
    """Raise on every rank if the ranks of ``groups`` manage different parameters.

    One ``all_gather_object`` per process group (the data-parallel groups of the root); compared in
    order, so the error names the first parameter that differs and the ranks on each side.

    Raises:
        RuntimeError: some rank's fingerprint differs.
    """
    mine = list(fingerprint)
    for group in groups:
        size = dist.get_world_size(group)
        if size == 1:
            continue
        everyone: list[list[ParamFingerprint] | None] = [None] * size
        with _watch("the model fingerprint check of the first forward"):
            dist.all_gather_object(everyone, mine, group=group)
        ranks = dist.get_process_group_ranks(group)
        first = everyone[0] or []
        for index, other in enumerate(everyone[1:], start=1):
            other = other or []
            if other != first:
                raise RuntimeError(_difference(root_name, ranks[0], first, ranks[index], other))


def _difference(
    root_name: str, rank_a: int, a: list[ParamFingerprint], rank_b: int, b: list[ParamFingerprint]
) -> str:
    for item_a, item_b in zip(a, b, strict=False):
        if item_a != item_b:
            return (
                f"fsdp2 debug: ranks manage different models under {root_name}: the first difference is "
                f"parameter {item_a[0]!r} on rank {rank_a} ({_describe(item_a)}) vs {item_b[0]!r} on rank "
                f"{rank_b} ({_describe(item_b)}). Every rank must build the same model and call fully_shard "
                "on the same modules; otherwise the collectives would not match and the job would hang."
            )
    longer, rank = (a, rank_a) if len(a) > len(b) else (b, rank_b)
    extra = longer[min(len(a), len(b))]
    return (
        f"fsdp2 debug: ranks manage different models under {root_name}: rank {rank_a} has {len(a)} sharded "
        f"parameters, rank {rank_b} has {len(b)}; the first one only rank {rank} has is {extra[0]!r} "
        f"({_describe(extra)}). Every rank must build the same model and call fully_shard on the same "
        "modules."
    )


def _describe(item: ParamFingerprint) -> str:
    return f"shape {item[1]}, {item[2]}, group {item[3] or '<root>'}"


_OFF = contextlib.nullcontext()
NOT_WATCHED = _OFF  # what a caller uses instead of watch_collective while ``DEBUG.enabled`` is off
DEBUG = _Settings  # ``DEBUG.enabled``: one attribute read for the hot path (set_debug / FSDP2_DEBUG)


def watch_collective(kind: str, group_name: str, state: Enum) -> contextlib.AbstractContextManager[None]:
    """A context reporting the collective if it outlives the debug deadline; a no-op when debug is off.

    ``state`` is the training state, named only when debug is on.
    """
    if not _Settings.enabled:
        return _OFF
    return _watch(f"the {kind} of module group {group_name or '<root>'} (training state {state.name})")


_checked_deadlines: set[float] = set()


def _check_deadline(deadline: float) -> None:
    """Warn once per deadline if the default group's timeout would end a stuck collective first."""
    if deadline in _checked_deadlines or not dist.is_initialized():
        return
    _checked_deadlines.add(deadline)
    timeout = _default_group_timeout()
    if timeout is not None and deadline >= timeout:
        warnings.warn(
            f"fsdp2 debug: the collective watchdog reports after {deadline:g} s, but the process group "
            f"times out after {timeout:g} s, so a stuck collective fails before any report. Set "
            "FSDP2_DEBUG_DEADLINE (or set_debug(True, deadline=...)) below the process group's timeout.",
            stacklevel=3,
        )


def _default_group_timeout() -> float | None:
    """Seconds before a collective of the default group times out (``None`` if it cannot be read)."""
    try:
        group = dist.group.WORLD
        assert group is not None
        device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
        backend = group._get_backend(device)  # noqa: SLF001 - no public accessor
        return float(backend.options._timeout.total_seconds())  # noqa: SLF001 - no public accessor
    except Exception:  # a backend without options (threaded, fake): nothing to compare
        return None


class _Watchdog:
    """One daemon thread per process that reports each watched collective older than its deadline, once.

    Entering and leaving a watch is a dict insertion and removal (no thread per collective); the
    thread wakes every ``_POLL_S`` seconds, so a report comes at most that late.
    """

    _POLL_S = 0.1

    def __init__(self) -> None:
        self._active: dict[int, tuple[float, float, str, int]] = {}  # token -> (start, deadline, what, rank)
        self._reported: set[int] = set()
        self._tokens = itertools.count()
        self._lock = threading.Lock()
        self._started = False

    def enter(self, what: str, rank: int, deadline: float) -> int:
        token = next(self._tokens)
        self._active[token] = (time.monotonic(), deadline, what, rank)
        if not self._started:
            with self._lock:
                if not self._started:
                    threading.Thread(target=self._run, name="fsdp2-watchdog", daemon=True).start()
                    self._started = True
        return token

    def leave(self, token: int) -> None:
        self._active.pop(token, None)
        self._reported.discard(token)

    def _run(self) -> None:
        while True:
            time.sleep(self._POLL_S)
            now = time.monotonic()
            for token, (start, deadline, what, rank) in list(self._active.items()):
                if now - start >= deadline and token not in self._reported:
                    self._reported.add(token)
                    _report(
                        f"fsdp2 debug: rank {rank} has waited {deadline:g} s in {what}. The other ranks of "
                        "its process group probably never issued the matching collective (a different model, "
                        "a skipped module, or an exception on another rank)."
                    )


def _report(message: str) -> None:
    sink = _Settings.report
    if sink is not None:
        sink(message)
    else:
        print(message, file=sys.stderr, flush=True)


_watchdog = _Watchdog()


@contextlib.contextmanager
def _watch(what: str) -> Iterator[None]:
    rank = dist.get_rank() if dist.is_initialized() else 0
    deadline = float(_setting("deadline_s"))
    _check_deadline(deadline)
    token = _watchdog.enter(what, rank, deadline)
    try:
        yield
    finally:
        _watchdog.leave(token)
