"""The one optimizer pre-step hook and the one post-step hook fsdp2 installs, and what runs in them.

Owns: the two process-wide hooks (``torch.optim``'s global step pre- and post-hooks, registered once,
at the first participant) and the ordered lists of participants each one calls: the replaced-parameter
check, the step guard and automatic local-shard steps (this subpackage), and, while they are active,
the memory tracker (``plan``) and debug mode's step counter (``debug``). Each participant keeps its
own state and decides quickly when it has nothing to do. Does not own: what a participant checks or changes.
Cost: one call into fsdp2 before and one after each optimizer step, then each participant's check.
Invariants: participants run in the order they joined; a participant's exception stops the step
before anything changes (a pre-step participant) exactly as a torch hook's would.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..base import eager

Participant = Callable[[torch.optim.Optimizer, Any, Any], None]  # (optimizer, args, kwargs), as torch's

_lock = threading.Lock()
# Replaced as a whole under the lock, read without it: a step iterates the tuple it found.
_before: tuple[Participant, ...] = ()
_after: tuple[Participant, ...] = ()
_handles: list[Any] = []


def take_part(before: Participant | None = None, after: Participant | None = None) -> Callable[[], None]:
    """Run ``before`` ahead of every optimizer step and ``after`` behind it; returns the way out."""
    global _before, _after
    with _lock:
        if not _handles:
            _handles.append(register_optimizer_step_pre_hook(_run_before))
            _handles.append(register_optimizer_step_post_hook(_run_after))
        if before is not None:
            _before = (*_before, before)
        if after is not None:
            _after = (*_after, after)

    def leave() -> None:
        global _before, _after
        with _lock:
            _before = tuple(p for p in _before if p is not before)
            _after = tuple(p for p in _after if p is not after)

    return leave


def participants() -> tuple[tuple[Participant, ...], tuple[Participant, ...]]:
    """What runs before and after a step now (for tests and debugging)."""
    return _before, _after


@eager  # reads and patches optimizers' lists: never traced
def _run_before(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for participant in _before:
        participant(optimizer, args, kwargs)


@eager
def _run_after(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for participant in _after:
        participant(optimizer, args, kwargs)
