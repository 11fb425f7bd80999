"""Debug mode names a rank that keeps the others waiting, while training runs.

Owns: ``StragglerWatch``, one per guarded root: the seconds each rank spent blocked in the divergence
guard's agreement before each FSDP collective (every rank meets there, so a late rank makes the others
wait there, not inside the collective), and, every ``straggler_check_steps()`` optimizer steps, one
exchange of those waits per process group, read as ``straggler_report`` reads a recording; a rank whose
lateness cost the others at least ``straggler_fraction()`` of the step is named in a warning on every
rank. Does not own: the agreement (``_guard``), the attribution ([Note: Attributing a wait] in
``trace/_straggler.py``) or the settings (``trace/_debug.py``).
Invariants: only durations on each rank's own clock are exchanged; the first step (lazy init, the
board's set-up, warm-up) is never judged.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch.distributed as dist

from ..trace import attribute, straggler_check_steps, straggler_fraction

_Wait = tuple[str, str, float]  # (collective, module, seconds blocked)
_MAX_WAITS = 1 << 16  # per process group between two checks


class StragglerWatch:
    """The waits of one rank at one root's agreements since the last check, per process group."""

    __slots__ = ("_since", "_steps", "_waits")

    def __init__(self) -> None:
        self._waits: dict[str, tuple[dist.ProcessGroup, list[_Wait]]] = {}  # by group name
        self._steps = -1  # optimizer steps since the last check; -1: the first step is still running
        self._since = time.monotonic()

    def waited(self, group: dist.ProcessGroup, collective: str, module: str, seconds: float) -> None:
        """Note that this rank was blocked ``seconds`` before ``module``'s ``collective`` on ``group``."""
        if straggler_check_steps() <= 0:
            return
        entry = self._waits.get(group.group_name)
        if entry is None:
            entry = self._waits[group.group_name] = (group, [])
        elif len(entry[1]) >= _MAX_WAITS:  # no optimizer step for long (evaluation): start again
            entry[1].clear()  # every rank reaches the same count at the same agreement
        entry[1].append((collective, module, seconds))

    def stepped(self) -> None:
        """Called at every optimizer step over the root's parameters, on every rank: may check."""
        every = straggler_check_steps()
        if every <= 0:
            return
        self._steps += 1
        if self._steps == 0:  # the first step ends warm-up: count from here
            self._restart()
        if self._steps < every:
            return
        seconds_per_step = (time.monotonic() - self._since) / self._steps
        waits, steps = self._waits, self._steps
        self._restart()
        for name in sorted(waits):  # every rank has the same groups: the same exchanges in order
            group, mine = waits[name]
            _check(group, mine, seconds_per_step, steps)

    def _restart(self) -> None:
        self._waits = {}
        self._steps = 0
        self._since = time.monotonic()


def _check(group: dist.ProcessGroup, mine: list[_Wait], seconds_per_step: float, steps: int) -> None:
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (seconds_per_step, mine), group=group)
    step_s = max(entry[0] for entry in everyone)
    report = attribute([entry[1] for entry in everyone])
    if not report.rows:
        return
    top = report.rows[0]
    lag_per_step = top.lag_s / steps
    if lag_per_step < straggler_fraction() * step_s:
        return
    rank = dist.get_process_group_ranks(group)[top.rank]
    module = top.module_fqn or "<root>"
    warnings.warn(
        f"fsdp2 debug: rank {rank} kept the other ranks of process group {group.group_name!r} waiting "
        f"{lag_per_step:.3f} s per step ({lag_per_step / step_s:.0%} of a {step_s:.3f} s step, over the "
        f"last {steps} steps), mostly at the {top.collective} of module {module!r} ({top.count} times): "
        "that rank's work before that collective (its data loading, compute only it does, a slower or "
        "throttled device) holds every rank back. fsdp2.straggler_report() over a record_events() "
        "recording gives the whole table; FSDP2_DEBUG_STRAGGLER sets the fraction that warns.",
        RuntimeWarning,
        stacklevel=2,
    )
