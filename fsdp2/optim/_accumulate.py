"""Gradient accumulation within a memory budget: ``fsdp2.accumulate(model, budget_bytes=...)``.

Owns: ``accumulate`` (the context manager), the choice of the groups whose gradients are kept
unreduced across micro-batches, and ``Accumulation`` (what was chosen and what it cost). It works
through the engine's queries for the rooms above it (``runtime/_queries.py``, ``group/_queries.py``):
the same no-sync mechanism as ``set_requires_gradient_sync(False)``, switched per group, and one
reduction of what was kept when the context exits.
Does not own: the reductions themselves (the groups), the optimizer.

[Note: Which groups to keep]
Inside the context a group either reduces in every micro-batch's backward (one reduce-scatter per
micro-batch, its sharded gradient accumulating the results) or keeps its unsharded gradient, summed
locally, and reduces once at the end. A kept group costs its unsharded gradient bytes for the whole
accumulation and saves ``micro_batches - 1`` reductions, whatever its size. Saving the most
collectives within the budget is then keeping as many groups as fit: the smallest first (ties in
the order ``fully_shard`` was applied). The choice depends only on the shapes and the policy, so
every rank makes the same one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..comm import ForwardingComm
from ..group import group_name, kept_grad_bytes, set_gradient_sync
from ..runtime import groups_under, mark_partial_grads, states_under, wrap_comms

__all__ = ["Accumulation", "accumulate"]

_GRADIENT_COLLECTIVES = frozenset({"reduce_scatter", "all_reduce", "all_to_all"})


@dataclass
class Accumulation:
    """What ``accumulate`` chose and did (filled in as it runs; final once the context exits).

    Attributes:
        budget_bytes: the budget it was given (``None``: keep every group).
        kept_bytes: bytes per rank of the unsharded gradients kept across micro-batches.
        collectives: gradient-reduction collectives this rank issued inside the context and at its
            exit (reduce-scatters, HSDP all-reduces, all-to-alls of ordered reductions).
    """

    budget_bytes: int | None
    kept_bytes: int = 0
    collectives: int = 0
    _kept: list[Any] = field(default_factory=list, repr=False)
    _reduced: list[Any] = field(default_factory=list, repr=False)

    @property
    def kept(self) -> list[str]:
        """Modules whose gradients were kept unreduced until the end (``""``: the root)."""
        return [group_name(g) for g in self._kept]

    @property
    def reduced_each_micro_batch(self) -> list[str]:
        """Modules whose gradients were reduce-scattered in every micro-batch."""
        return [group_name(g) for g in self._reduced]


def _choose(groups: list[Any], budget: int | None) -> tuple[list[Any], list[Any], int]:
    """``(kept, reduced, kept_bytes)``; see [Note: Which groups to keep]."""
    sizes = [kept_grad_bytes(g) for g in groups]
    trainable = [i for i, size in enumerate(sizes) if size > 0]
    if budget is None:
        chosen = set(trainable)
    else:
        chosen = set()
        used = 0
        for i in sorted(trainable, key=lambda i: (sizes[i], i)):
            if used + sizes[i] > budget:
                break
            chosen.add(i)
            used += sizes[i]
    kept = [groups[i] for i in sorted(chosen)]
    reduced = [groups[i] for i in trainable if i not in chosen]
    return kept, reduced, sum(sizes[i] for i in chosen)


@contextlib.contextmanager
def accumulate(model: nn.Module, *, budget_bytes: int | None = None) -> Iterator[Accumulation]:
    """Accumulate gradients over the micro-batches run inside the block, within a memory budget.

    Inside, each backward keeps the gradients of some groups unreduced (unsharded, summed locally)
    and reduce-scatters the others into their sharded gradients; leaving the block reduces what was
    kept, once. After it, ``p.grad`` of every sharded parameter is the sum over every micro-batch,
    averaged over the ranks, as if each backward had synced (within floating-point rounding).

    Args:
        model: a ``fully_shard`` model (every group in its tree takes part).
        budget_bytes: bytes per rank the kept unsharded gradients may take (in ``reduce_dtype`` where
            the mixed precision policy sets one). ``None`` keeps every group (no reduction until the
            end, like ``set_requires_gradient_sync(False)``); ``0`` keeps none (a reduction per
            micro-batch). In between, the groups that save the most collectives: the smallest that
            fit (see docs/accumulation.md).

    Yields:
        An :class:`Accumulation`: ``kept``, ``reduced_each_micro_batch``, ``kept_bytes`` and, after
        the block, ``collectives``.

    Raises:
        TypeError / ValueError: ``budget_bytes`` is not ``None`` or a non-negative int.
        ValueError: ``model`` has no ``fully_shard`` module in its tree.

    If the block raises, the settings are restored and nothing more is reduced; whatever the budget,
    ``optimizer.step()`` over the model's parameters then refuses to run until ``zero_grad()`` drops
    the gradients: they hold only the micro-batches before the exception (reduced or kept).
    """
    value: object = budget_bytes
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise TypeError(f"accumulate: budget_bytes must be an int number of bytes or None, got {value!r}.")
    if isinstance(value, int) and value < 0:
        raise ValueError(f"accumulate: budget_bytes must be >= 0 (0 keeps no group), got {value}.")
    groups = groups_under(model)
    if not groups:
        raise ValueError(
            f"accumulate: {type(model).__name__} has no fully_shard module in its tree; pass the sharded "
            "model (call fully_shard first)."
        )
    kept, reduced, kept_bytes = _choose(groups, budget_bytes)
    report = Accumulation(budget_bytes, kept_bytes, 0, kept, reduced)
    previous = [set_gradient_sync(g, g not in kept) for g in groups]
    restore = wrap_comms(states_under(model), lambda kind, comm, _: _Counter(comm, kind, report))
    try:
        yield report
    except BaseException:
        why = _partial_message(report)
        for group in groups:
            mark_partial_grads(group, why)
        raise
    else:
        for group in kept:
            group.reduce_held_grads()
    finally:
        restore()
        for group, sync in zip(groups, previous, strict=True):
            set_gradient_sync(group, sync)


def _partial_message(report: Accumulation) -> str:
    reduced = report.reduced_each_micro_batch
    done = f"{len(reduced)} group(s) reduced each micro-batch" if reduced else "no group reduced yet"
    return (
        f"the fsdp2.accumulate block (budget_bytes={report.budget_bytes}) raised, so the gradients hold "
        f"only the micro-batches before the exception ({done}, {len(report.kept)} kept unreduced): "
        "this step would apply a partial accumulation. Call optimizer.zero_grad() (or model.zero_grad()) "
        "and run the step's micro-batches again."
    )


class _Counter(ForwardingComm):
    """Forwards to ``wrapped`` and counts gradient-reduction calls into ``report.collectives``."""

    def __init__(self, wrapped: Any, kind: str, report: Accumulation) -> None:
        super().__init__(wrapped)
        self._counts = kind in _GRADIENT_COLLECTIVES
        self._report = report

    def seen(self, *args: Any) -> None:
        if self._counts:
            self._report.collectives += 1
