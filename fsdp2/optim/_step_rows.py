"""What a step over rows (Muon's, Adafactor's) gets of one parameter: ``StepRows``.

Owns: ``StepRows`` (this rank's rows of a parameter and of its gradient, the ranks its matrix rows
are spread over, and how a new state tensor over those rows is kept) and ``shard_rows`` (those of a
parameter ``fully_shard`` sharded, for the rows of its local shard). Does not own: the updates
(``_muon``, ``_adafactor``) or the replica slices' rows (``_cross_replica`` builds theirs).

The same update serves a rank's rows of a shard (plain FSDP or HSDP: rows over the shard group) and
a rank's rows of a replica slice (the optimizer sharded across replicas: rows over all ``R x S``
ranks, ``param.RowGroup`` numbering them in row order): only where the rows are and how the state
is wrapped differ.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..param import RowGroup, local_of
from ._owner_exchange import sharded_like

__all__ = ["StepRows", "shard_rows"]

Wrap = Callable[[torch.Tensor, "tuple[int, ...] | None"], DTensor]


@dataclass(frozen=True)
class StepRows:
    """One parameter's rows this rank steps.

    - ``param``: the parameter (the key of its optimizer state; its global shape);
    - ``local`` / ``grad``: this rank's rows of it (a view: the update lands in the parameter) and of
      its gradient;
    - ``ring``: the ranks the rows of its matrices are spread over, numbered in row order (``None``:
      this rank holds whole matrices, e.g. experts of a stack sharded on dim 0);
    - ``wrap``: a state tensor over these rows as the optimizer keeps it (``wrap(local, shape)``, the
      global shape when not the parameter's).
    """

    param: DTensor
    local: torch.Tensor
    grad: torch.Tensor
    ring: RowGroup | None
    wrap: Wrap


def shard_rows(param: torch.Tensor, group: dist.ProcessGroup | None) -> StepRows:
    """The rows of ``param``'s local shard (rows spread over ``group``, ``None``: none spread)."""
    assert isinstance(param, DTensor)
    assert isinstance(param.grad, DTensor)
    ring = None if group is None else _ring_of(group, dist.get_rank(group))
    wrap = functools.partial(sharded_like, param)
    return StepRows(param, local_of(param), local_of(param.grad), ring, wrap)


@functools.lru_cache(maxsize=64)
def _ring_of(group: dist.ProcessGroup, rank: int) -> RowGroup:
    """A shard group's ranks in rank order: one per group and rank, not W ranks per parameter per step.

    ``rank``: this rank's in ``group`` (part of the key: threads standing in for ranks may share one).
    """
    world = dist.get_world_size(group)
    return RowGroup(group, world, 1, tuple(range(world)), rank)
