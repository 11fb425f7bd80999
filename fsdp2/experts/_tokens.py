"""The token exchange: rows to the ranks of their experts and back, with autograd, on the exchange floor.

Owns: ``trade_counts`` (each rank's token counts per expert of each peer, one exchange of known
size), ``send_rows`` (rows grouped by destination to their ranks: one exchange forward, the reverse one
for the gradients in backward) and ``Route`` (the rows each peer sends and receives, and the
permutation between the received order and the local experts' order). Does not own: the exchange
itself (``comm.exchange``), which tokens go to which expert (the router's, the caller's).

[Note: Tokens to their experts]
Each rank holds the ``L = E / ep`` consecutive experts ``[r L, (r + 1) L)`` of its ``ep`` group. A rank's
rows sorted by global expert are already grouped by destination. Counts travel first (``L`` integers
to each peer, sizes known to both sides, so nothing checks them), then the rows and whatever rides with
them (routing weights) in one exchange. What arrives is grouped by source, then by local expert; the
local experts want it grouped by expert, then by source: one ``index_select`` each way. No token is
dropped and no capacity is fixed: the sizes are the counts. In backward the gradients take the
reverse routes, so the exchange is its own adjoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..comm import exchange, nbytes_of

__all__ = ["Arrived", "Route", "expert_major", "send_rows", "tie", "trade_counts"]


def trade_counts(
    counts: list[int], local: int, group: dist.ProcessGroup, device: torch.device
) -> list[list[int]]:
    """``counts`` (rows per global expert, ``ep x local`` of them): each peer's slice to that peer.

    Returns, per source rank of ``group``, its rows for each of this rank's ``local`` experts. Under
    torch's fake process group (one process standing in for a rank of a simulated world, where nothing
    arrives) each peer is taken to send this rank what this rank sends it: the traffic of a balanced
    world, of the same size both ways.
    """
    world = dist.get_world_size(group)
    if dist.get_backend(group) == "fake":
        return [counts[peer * local : (peer + 1) * local] for peer in range(world)]
    table = torch.tensor(counts, dtype=torch.int64).view(world, local).to(device)
    sends = [[table[peer]] for peer in range(world)]
    expect = [nbytes_of((local,), torch.int64)] * world
    received = exchange(sends, group, expect=expect, device=device, check=False)
    return [received.take(peer, (local,), torch.int64).tolist() for peer in range(world)]


@dataclass(frozen=True)
class Route:
    """Where the rows of one exchange go: ``send[r]`` rows to rank ``r``, ``receive[r]`` from it."""

    group: dist.ProcessGroup
    send: tuple[int, ...]
    receive: tuple[int, ...]

    @classmethod
    def between(cls, mine: list[int], theirs: list[list[int]], local: int, group: dist.ProcessGroup) -> Route:
        """The route of rows counted per global expert (``mine``) and per local expert of each source."""
        send = tuple(sum(mine[peer * local : (peer + 1) * local]) for peer in range(len(theirs)))
        return cls(group, send, tuple(sum(row) for row in theirs))

    def reversed(self) -> Route:
        return Route(self.group, self.receive, self.send)

    def move(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """``tensors`` (rows grouped by destination) to their ranks; what arrives, grouped by source."""
        world = len(self.send)
        device = tensors[0].device
        parts = [t.split(list(self.send)) for t in tensors]
        sends = [[part[peer] for part in parts] for peer in range(world)]
        expect = [
            sum(nbytes_of((self.receive[peer], *t.shape[1:]), t.dtype) for t in tensors)
            for peer in range(world)
        ]
        received = exchange(sends, self.group, expect=expect, device=device, check=False)
        pieces: list[list[torch.Tensor]] = [[] for _ in tensors]
        for peer in range(world):  # in the order each peer packed them
            for i, t in enumerate(tensors):
                pieces[i].append(received.take(peer, (self.receive[peer], *t.shape[1:]), t.dtype))
        return tuple(torch.cat(p) for p in pieces)


class Arrived(NamedTuple):
    """Rows that arrived grouped (source, local expert): ``order`` takes them to (local expert, source).

    ``per_expert``: the rows of each local expert, from every source (int64, on the CPU).
    """

    order: torch.Tensor
    per_expert: torch.Tensor


def expert_major(theirs: list[list[int]], device: torch.device) -> Arrived:
    """The permutation taking rows grouped (source, local expert) to (local expert, source).

    Tensor arithmetic on the ``sources x local`` counts: no Python pass over the rows.
    """
    counts = torch.tensor(theirs, dtype=torch.int64).reshape(len(theirs), -1)
    starts = (counts.flatten().cumsum(0) - counts.flatten()).view_as(counts)  # each run's first row
    lengths, firsts = counts.t().flatten(), starts.t().flatten()  # the runs in (expert, source) order
    offsets = torch.arange(int(lengths.sum())) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    order = torch.repeat_interleave(firsts, lengths) + offsets
    return Arrived(order.to(device), counts.sum(0))


class _SendRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, route: Route, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.route = route
        ctx.shapes = [(t.shape[1:], t.dtype, t.device) for t in tensors]
        return route.move(tuple(t.detach() for t in tensors))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        back = ctx.route.reversed()
        filled = tuple(
            g if g is not None else torch.zeros((sum(back.send), *shape), dtype=dtype, device=device)
            for g, (shape, dtype, device) in zip(grads, ctx.shapes, strict=True)
        )
        return (None, *back.move(tuple(g.contiguous() for g in filled)))


class _Tie(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.inputs = [(t.shape, t.dtype, t.device) for t in inputs]
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        zeros = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.inputs]
        return (grad, *zeros)


def tie(out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """``out``, made to reach ``inputs`` in backward (with zero gradients) whether or not it depends on them.

    [Note: Every rank runs every exchange's backward]
    The exchanges are collectives: in backward each rank must run the reverse of each, in the same
    order. Autograd runs a node only if the loss reaches it, and a rank whose experts got no rows (or
    whose output does not depend on the rows it got) would otherwise skip the dispatch's reverse
    while its peers wait in it. Tying the local output to the rows it was given (and, where even so
    it needs no gradient, to the weights) keeps every rank's graph the same shape; the zeros add
    nothing (``x + 0`` is ``x``).
    """
    return _Tie.apply(out, *inputs)  # type: ignore[no-any-return, no-untyped-call]


def send_rows(route: Route, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` along ``route`` (differentiable: gradients come back along the reverse route)."""
    return _SendRows.apply(route, *tensors)  # type: ignore[no-any-return, no-untyped-call]
