"""The expert-parallel forward: an experts module's tokens to their experts' ranks and back.

Owns: ``ExpertsParallel`` (the class mixed into an experts module's class: its forward exchanges the
tokens and runs the module's own forward on the local experts), ``Placement`` (which experts this
rank holds, over which mesh, and the module's calling convention) and ``expert_parallel_class``.
Does not own: which modules are experts and their conventions (``_find``), the meshes (``_mesh``),
the rows' routes (``_tokens``), sharding (``fully_shard``).

[Note: The two conventions]
``"counts"`` (torchtitan's ``GroupedExperts``): ``forward(x, num_tokens_per_expert)`` takes rows
sorted by global expert and the count of each. ``"routed"`` (transformers 5's experts modules):
``forward(hidden_states, top_k_index, top_k_weights)`` takes every token with its top-k experts and
weights, and returns the weighted sum of their outputs. Either way the module's own forward then runs
on this rank's ``L`` experts with local expert ids (``num_experts`` reads ``L`` meanwhile) and plain
local weight tensors, on the rows every ``ep`` rank sent here; the routed convention gets one row per
(token, expert) pair with its weight, so its output rows are the weighted outputs, summed back into
their tokens in expert order (as the unsharded loop over experts adds them).
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ._mesh import ExpertMesh
from ._tokens import Route, expert_major, send_rows, tie, trade_counts

__all__ = ["ExpertsParallel", "Placement", "expert_parallel_class", "place", "placement_of"]


@dataclass(frozen=True)
class Placement:
    """One experts module's expert parallelism: ``local`` of its ``num_experts`` on each ``ep`` rank."""

    mesh: ExpertMesh
    num_experts: int
    convention: str  # "counts" or "routed", see [Note: The two conventions]

    @property
    def local(self) -> int:
        return self.num_experts // self.mesh.ep

    @property
    def first(self) -> int:
        """This rank's first expert."""
        return self.mesh.ep_rank * self.local


_PLACEMENTS: weakref.WeakKeyDictionary[nn.Module, Placement] = weakref.WeakKeyDictionary()


def placement_of(module: nn.Module) -> Placement | None:
    """The expert parallelism ``shard_experts`` gave ``module``, if any."""
    return _PLACEMENTS.get(module)


class ExpertsParallel:
    """Mixed into an experts module's class: see [Note: The two conventions]."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        placement = _PLACEMENTS[self]  # type: ignore[index]  # reason: the mixin is only on nn.Modules
        values = _bind(self, args, kwargs)
        if placement.convention == "counts":
            return self._by_counts(placement, *values)
        return self._routed(placement, *values)

    def _local_forward(self, placement: Placement, *args: torch.Tensor) -> torch.Tensor:
        """The module's own forward on this rank's experts, tied to what it was given (see ``tie``).

        With no rows here, also to the local weights: their gradient is then zeros, as the unsharded
        model's rows of experts no token reached are, rather than missing on this rank only.
        """
        with _local_view(self, placement.local) as weights:  # type: ignore[arg-type]
            out: torch.Tensor = super().forward(*args)  # type: ignore[misc]
        if not torch.is_grad_enabled():
            return out
        given = [a for a in args if a.requires_grad]
        if args[0].shape[0] == 0:
            given += [w for w in weights if w.requires_grad]
        return tie(out, *given) if given else out

    def _by_counts(self, placement: Placement, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        mine = counts.to(device="cpu", dtype=torch.int64)
        total = int(mine.sum())
        if total != x.shape[0]:
            raise ValueError(
                f"expert parallelism: the experts got {x.shape[0]} rows but num_tokens_per_expert sums to "
                f"{total}; pass the rows sorted by expert with their counts (no padding)."
            )
        rows, theirs, route = _dispatch(placement, mine, x)
        order, per_expert = expert_major(theirs, x.device)
        out = self._local_forward(
            placement,
            rows[0].index_select(0, order),
            per_expert.to(dtype=counts.dtype, device=counts.device),
        )
        return send_rows(route.reversed(), out.index_select(0, _inverse(order)))[0]

    def _routed(
        self, placement: Placement, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        tokens = hidden.reshape(-1, hidden.shape[-1])
        flat = index.reshape(tokens.shape[0], -1)
        k = flat.shape[1]
        flat = flat.reshape(-1)
        order = torch.argsort(flat, stable=True)
        experts = flat.index_select(0, order)
        kept = int((experts < placement.num_experts).sum())  # a sentinel id (>= E) is no expert's
        order, experts = order[:kept], experts[:kept]
        mine = torch.bincount(experts, minlength=placement.num_experts)
        token_of = order // k
        moved, theirs, route = _dispatch(
            placement, mine, tokens.index_select(0, token_of), weights.reshape(-1).index_select(0, order)
        )
        perm, per_expert = expert_major(theirs, hidden.device)
        ids = torch.repeat_interleave(torch.arange(placement.local), per_expert).to(hidden.device)
        out = self._local_forward(
            placement, moved[0].index_select(0, perm), ids[:, None], moved[1].index_select(0, perm)[:, None]
        )
        back = send_rows(route.reversed(), out.index_select(0, _inverse(perm)))[0]
        summed = torch.zeros_like(tokens).index_add(0, token_of, back.to(tokens.dtype))
        return summed.view(hidden.shape)


def _dispatch(
    placement: Placement, mine: torch.Tensor, *rows: torch.Tensor
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, Route]:
    """``rows`` (sorted by global expert, ``mine`` per expert) to the ranks of their experts."""
    group = placement.mesh.ep_group
    theirs = trade_counts(mine, placement.local, group, rows[0].device)
    route = Route.between(mine, theirs, placement.local, group)
    return send_rows(route, *rows), theirs, route


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def _bind(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The forward's tensors in the convention's order, however the caller passed them."""
    if not kwargs:
        return args
    signature = inspect.signature(super(ExpertsParallel, module).forward)
    return tuple(signature.bind(*args, **kwargs).arguments.values())


@contextlib.contextmanager
def _local_view(module: nn.Module, local: int) -> Iterator[list[torch.Tensor]]:
    """``module``'s DTensor weights as their local tensors, and ``num_experts`` as ``local``, meanwhile.

    Yields the local tensors.
    """
    saved = dict(module._parameters)  # noqa: SLF001 - the registered objects, swapped back on exit
    had = "num_experts" in vars(module)
    experts = getattr(module, "num_experts", None)
    try:
        views: list[torch.Tensor] = []
        for name, param in saved.items():
            if isinstance(param, DTensor):
                views.append(param.to_local())
                module._parameters[name] = views[-1]  # noqa: SLF001
        if had:
            setattr(module, "num_experts", local)  # noqa: B010 - any module's attribute
        yield views
    finally:
        module._parameters.update(saved)  # noqa: SLF001 - restoring
        if had:
            setattr(module, "num_experts", experts)  # noqa: B010


_CLASSES: dict[type, type] = {}


def expert_parallel_class(cls: type) -> type:
    """``cls`` with :class:`ExpertsParallel` mixed in (one class per original)."""
    found = _CLASSES.get(cls)
    if found is None:
        found = _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertsParallel, cls), {})
    return found


def place(module: nn.Module, placement: Placement) -> Callable[[], None]:
    """Make ``module`` expert parallel: its stacks' local experts as DTensors ``Shard(0)`` on ``ep``.

    Returns the undo: the original parameters and class back (for a ``fully_shard`` that refuses).
    """
    original = (type(module), dict(module.named_parameters(recurse=False)))

    def undo() -> None:
        for name, param in original[1].items():
            setattr(module, name, param)
        _PLACEMENTS.pop(module, None)
        module.__class__ = original[0]

    mesh = placement.mesh.ep_mesh
    lo, hi = placement.first, placement.first + placement.local
    for name, param in list(module.named_parameters(recurse=False)):
        local = param.detach()[lo:hi].clone()
        stacked = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride()
        )
        setattr(module, name, nn.Parameter(stacked, requires_grad=param.requires_grad))
    _PLACEMENTS[module] = placement
    module.__class__ = expert_parallel_class(type(module))
    return undo
