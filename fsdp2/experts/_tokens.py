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

from ..comm import Packed, exchange, nbytes_of

__all__ = ["Arrived", "Route", "expert_major", "send_rows", "tie", "trade_counts"]


def trade_counts(
    counts: torch.Tensor, local: int, group: dist.ProcessGroup, device: torch.device
) -> torch.Tensor:
    """``counts`` (rows per global expert, ``ep x local`` of them, int64): each peer's slice to that peer.

    Returns ``[sources, local]`` (int64, on the CPU): per source rank of ``group``, its rows for each of
    this rank's ``local`` experts. The counts travel as one block of bytes, each peer's slice back to
    back, and come back as one view: no Python per peer. Under torch's fake process group (one process
    standing in for a rank of a simulated world, where nothing arrives) each peer is taken to send
    this rank what this rank sends it: the traffic of a balanced world, of the same size both ways.
    """
    world = dist.get_world_size(group)
    table = counts.to(device="cpu", dtype=torch.int64).view(world, local)
    if dist.get_backend(group) == "fake":
        return table
    nbytes = nbytes_of((local,), torch.int64)  # a multiple of 8: the slices lie back to back
    sends = Packed(table.to(device).reshape(-1).view(torch.uint8), dict.fromkeys(range(world), nbytes))
    expect = [nbytes] * world
    received = exchange(sends, group, expect=expect, device=device, check=False)
    return received.buffer.view(torch.int64).view(world, local).cpu()


def _rows_per_peer(rows: torch.Tensor) -> dict[int, int]:
    """``{peer: rows}`` for the peers with rows (``rows``: one count per rank), in rank order."""
    peers = rows.nonzero().flatten()
    return dict(zip(peers.tolist(), rows[peers].tolist(), strict=True))


@dataclass(frozen=True)
class Route:
    """Where the rows of one exchange go: ``send[r]`` rows to rank ``r``, ``receive[r]`` from it.

    Only the peers rows go to or come from are named (in rank order): a rank that routes a few
    hundred rows among thousands of ranks does Python work for those peers only (torch's
    ``all_to_all_single`` still takes a size per rank, built in C; see ``comm``'s [Note: Sparse sends]).
    """

    group: dist.ProcessGroup
    send: dict[int, int]
    receive: dict[int, int]

    @classmethod
    def between(cls, mine: torch.Tensor, theirs: torch.Tensor, local: int, group: dist.ProcessGroup) -> Route:
        """The route of rows counted per global expert (``mine``) and per local expert of each source."""
        sends = mine.to(device="cpu", dtype=torch.int64).view(-1, local).sum(1)
        return cls(group, _rows_per_peer(sends), _rows_per_peer(theirs.sum(1)))

    def reversed(self) -> Route:
        return Route(self.group, self.receive, self.send)

    def move(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """``tensors`` (rows grouped by destination) to their ranks; what arrives, grouped by source."""
        device = tensors[0].device
        parts = [t.split(list(self.send.values())) if self.send else () for t in tensors]
        sends = {peer: [part[k] for part in parts] for k, peer in enumerate(self.send)}
        expect = {
            peer: sum(nbytes_of((rows, *t.shape[1:]), t.dtype) for t in tensors)
            for peer, rows in self.receive.items()
        }
        received = exchange(sends, self.group, expect=expect, device=device, check=False)
        out = []
        for t in tensors:  # each peer packed its tensors in this order; take() reads each peer in turn
            shape = t.shape[1:]
            pieces = [received.take(peer, (rows, *shape), t.dtype) for peer, rows in self.receive.items()]
            out.append(torch.cat(pieces) if pieces else t.new_empty((0, *t.shape[1:])))
        return tuple(out)


class Arrived(NamedTuple):
    """Rows that arrived grouped (source, local expert): ``order`` takes them to (local expert, source).

    ``per_expert``: the rows of each local expert, from every source (int64, on the CPU).
    """

    order: torch.Tensor
    per_expert: torch.Tensor


def expert_major(theirs: torch.Tensor, device: torch.device) -> Arrived:
    """The permutation taking rows grouped (source, local expert) to (local expert, source).

    Tensor arithmetic on the ``sources x local`` counts: no Python pass over the rows or the sources.
    """
    counts = theirs.to(device="cpu", dtype=torch.int64)
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
            g if g is not None else torch.zeros((sum(back.send.values()), *shape), dtype=dtype, device=device)
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
