"""``torch.optim.Muon`` (and ``StackedMuon``) on shards: only the Newton-Schulz input and output travel.

Owns: ``muon_step``, torch 2.13's Muon update (``_single_tensor_muon``) for the matrices and stacks of
matrices ``fully_shard`` sharded, ``muon_rows_step`` (the same over given rows: a shard's, or a
replica slice's spread over all ``R x S`` ranks, see ``_cross_replica``) and ``rows_group_of`` (the
layouts it serves). Does not own: when it
runs (``_whole_tensor``'s step hooks), the routes and the exchange (``param._rows``,
``comm._exchange``), the Newton-Schulz iteration and the learning-rate adjustment (torch's own
functions, called as they are).

[Note: Muon on rows]
Of Muon's update only the orthogonalisation needs the whole matrix; the momentum, the Nesterov blend,
the weight decay and the final add are elementwise. So each rank updates its part of the momentum and
blends its part of the update, and each matrix is orthogonalised once, with torch's own function, on
a rank that holds it whole:
- a matrix ``fully_shard`` sharded by rows (dim 0 of a matrix, dim 1 of an ``[E, m, n]`` stack):
  one all-to-all per shard group sends the update's rows to the matrix's owner (owners balanced by
  Newton-Schulz work), the owner orthogonalises the whole update, one all-to-all returns each rank
  its rows of the result (bf16, as torch's Newton-Schulz returns it);
- a matrix a rank holds whole (each expert of a stack sharded on dim 0, whatever the mesh dims:
  FSDP's rows, or experts placed on an ``ep`` mesh and sharded over ``efsdp``): that rank
  orthogonalises it, and nothing travels. A rank with no rows of a stack has nothing to do.
Each rank then applies weight decay and the update to its part, the learning rate adjusted for the
matrix's ``[m, n]``. The same operations on the same values as the unsharded model (a stack as ``E``
separate matrices): fp32 parameters are bit-identical. bf16 parameters may differ by a bf16 ulp where
the CPU's vectorised add rounds an element differently than on the whole matrix (which elements fall
in a vector's body or its tail depends on the row count); at one rank they are bit-identical. Per
step, each rank receives 2 N M (W - 1) / W^2 bytes for N row-sharded matrices of M bytes (an update's
rows on the way to its owner, the result's rows on the way back), against 5 N M (W - 1) / W^2 for the
general owner step and N M (W - 1) / W for an all-gather of every update on every rank. The momentum
stays a DTensor sharded like its parameter. An owner takes a matrix's rows as one view of the received
bytes where they arrived back to back, and sends the result's rows as its bytes as they are where it
owns one matrix (``comm``'s [Note: Sparse sends]): its Python work per step does not follow how many
ranks hold the rows.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from ..comm import ALIGN, Packed, Received, exchange, nbytes_of
from ..param import RowGroup, RowLayout, local_of, owners_by_load, routes
from ._owner_exchange import DISAGREE
from ._step_rows import StepRows, shard_rows

try:  # torch's own functions: the unsharded model's operations, bit for bit
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
except ImportError:  # another torch: the general owner step serves Muon instead
    _adjust_lr = _zeropower_via_newtonschulz = None  # type: ignore[assignment]  # reason: absent

__all__ = ["ROWS_AVAILABLE", "muon_rows_step", "muon_step", "rows_group_of"]

ROWS_AVAILABLE = _zeropower_via_newtonschulz is not None


@dataclass(frozen=True)
class _Matrix:
    """One matrix to orthogonalise: this rank's rows of its update and of its parameter."""

    update: torch.Tensor  # this rank's rows of the update (all of them where it holds the matrix)
    target: torch.Tensor  # the same rows of the parameter: a view of its local tensor
    shape: tuple[int, int]  # the whole matrix's
    settings: dict[str, Any]  # its optimizer param group


def rows_group_of(param: DTensor) -> dist.ProcessGroup | None:
    """The process group ``param``'s matrix rows are sharded over (``None``: each rank holds whole ones).

    ``None`` for a stack sharded on dim 0 only, and for rows sharded over one rank.

    Raises:
        ValueError: a layout the Muon step cannot serve, naming the parameter's shape and placements.
    """
    ndim, rows_dim, served = param.ndim, None, param.ndim in (2, 3)
    for mesh_dim, placement in enumerate(param.placements):
        if placement.is_replicate():
            continue
        dim = getattr(placement, "dim", None)  # Shard, and the strided shard of a dim split twice
        if dim is not None and ndim == 3 and dim % ndim == 0:
            continue  # experts: each rank holds whole matrices
        if dim is not None and dim % ndim == ndim - 2 and type(placement) is Shard and rows_dim is None:
            rows_dim = mesh_dim
            continue
        served = False
    if not served:
        raise ValueError(
            f"Muon over sharded parameters: a parameter of shape {tuple(param.shape)} is laid out as "
            f"{tuple(param.placements)} on its mesh. fsdp2's Muon step serves matrices [m, n] with their "
            "rows sharded over one mesh dim (FSDP, HSDP's shard dim) and stacks [E, m, n] with their "
            "experts (dim 0) sharded over any mesh dims and their rows (dim 1) over at most one; columns "
            "sharded (tensor parallelism), rows sharded twice or partial sums are not. Step such "
            "parameters with an optimizer built for that layout, or leave them out of this optimizer."
        )
    mesh = param.device_mesh
    if rows_dim is None or mesh.size(rows_dim) == 1:
        return None
    held = local_of(param).shape[-2]
    even = RowLayout.chunked(param.shape[-2], mesh.size(rows_dim)).count(mesh.get_local_rank(rows_dim))
    if held != even:  # fsdp2's dim-0 shards and Shard(1) of divisible sizes are torch.chunk's
        raise ValueError(
            f"Muon over sharded parameters: this rank holds {held} rows of the {tuple(param.shape)} "
            f"parameter laid out as {tuple(param.placements)}, where torch.chunk's split gives it {even}; "
            "the step serves torch.chunk's row splits (fsdp2's and DTensor's)."
        )
    return mesh.get_group(rows_dim)


def muon_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """One Muon step of ``params`` (sharded DTensor matrices and stacks of them, with gradients)."""
    groups = [rows_group_of(p) for p in params]  # type: ignore[arg-type]  # raises before anything changes
    muon_rows_step(optimizer, [shard_rows(p, g) for p, g in zip(params, groups, strict=True)])


def muon_rows_step(optimizer: torch.optim.Optimizer, parts: list[StepRows]) -> None:
    """One Muon step of each parameter's rows in ``parts`` (its shard's, or its replica slice's)."""
    settings = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    by_ring: dict[RowGroup | None, list[_Matrix]] = {}
    with torch.no_grad():
        for part in parts:
            g = settings[id(part.param)]
            grad = part.grad
            buffer = local_of(_momentum(optimizer, part))
            buffer.lerp_(grad, 1 - g["momentum"])
            update = grad.lerp(buffer, g["momentum"]) if g["nesterov"] else buffer
            shape = (int(part.param.shape[-2]), int(part.param.shape[-1]))
            for rows, target in zip(_matrices(update), _matrices(part.local), strict=True):
                by_ring.setdefault(part.ring, []).append(_Matrix(rows, target, shape, g))
        results: list[tuple[_Matrix, torch.Tensor]] = []
        for ring, matrices in by_ring.items():
            if ring is None:
                results.extend((m, _orthogonalise(m.update, m.settings)) for m in matrices)
            else:
                results.extend(zip(matrices, _on_owners(matrices, ring), strict=True))
        for part in parts:
            g = settings[id(part.param)]
            part.local.mul_(1 - float(g["lr"]) * g["weight_decay"])
        for matrix, result in results:
            g = matrix.settings
            lr = _adjust_lr(float(g["lr"]), g["adjust_lr_fn"], torch.Size(matrix.shape))
            matrix.target.add_(result, alpha=-lr)


def _matrices(tensor: torch.Tensor) -> list[torch.Tensor]:
    """A matrix as itself, a stack as its matrices (views; none for a rank with no experts)."""
    return [tensor] if tensor.ndim == 2 else [tensor[e] for e in range(tensor.shape[0])]


def _orthogonalise(update: torch.Tensor, g: dict[str, Any]) -> torch.Tensor:
    return _zeropower_via_newtonschulz(update, g["ns_coefficients"], g["ns_steps"], g["eps"])


def _on_owners(matrices: list[_Matrix], ring: RowGroup) -> list[torch.Tensor]:
    """Each matrix orthogonalised on its owner rank of ``ring``; this rank's rows of each result.

    Ranks are ``ring``'s layout ranks (row order) here, the group's only in the exchanges.
    """
    world, rank = len(ring.peers), ring.position
    device = matrices[0].update.device
    rows = [ring.layout(m.shape[0]) for m in matrices]
    owners = owners_by_load([m.shape[0] * m.shape[1] * min(m.shape) for m in matrices], world)
    owned = [RowLayout.owned(m.shape[0], world, owner) for m, owner in zip(matrices, owners, strict=True)]
    # There: each rank's rows of each update to the matrix's owner (only the peers bytes go to or
    # come from are named: see comm's [Note: Sparse sends]).
    sends: dict[int, list[torch.Tensor]] = defaultdict(list)
    expect: dict[int, int] = defaultdict(int)
    for i, m in enumerate(matrices):
        if m.update.shape[0]:
            sends[owners[i]].append(m.update)
        for piece in routes(rows[i], owned[i], rank).receive:
            expect[piece.peer] += nbytes_of((piece.rows, m.shape[1]), m.update.dtype)
    received = _exchange(sends, expect, ring, device)
    wholes: dict[int, torch.Tensor] = {}
    for i, m in enumerate(matrices):
        if owners[i] == rank:
            pieces = routes(rows[i], owned[i], rank).receive
            whole = received.take_rows(
                [ring.peers[piece.peer] for piece in pieces],
                [piece.rows for piece in pieces],
                m.shape[1],
                m.update.dtype,
            )  # one view where the pieces arrived back to back in row order
            wholes[i] = _orthogonalise(whole, m.settings)
    # Back: each rank's rows of each orthogonalised update.
    back = _back_sends(wholes, rows, owned, ring)
    expect = defaultdict(int)  # torch 2.13's Newton-Schulz returns bf16 (a change shows as a count mismatch)
    for i, m in enumerate(matrices):
        if rows[i].count(rank):
            expect[owners[i]] += nbytes_of((rows[i].count(rank), m.shape[1]), torch.bfloat16)
    received = _exchange(back, expect, ring, device)
    results = []
    for i, m in enumerate(matrices):
        result = received.take(ring.peers[owners[i]], (rows[i].count(rank), m.shape[1]), torch.bfloat16)
        if m.shape[0] > m.shape[1]:
            # torch's Newton-Schulz returns a tall matrix as a transposed view, and the add takes
            # another kernel for such an operand (in bf16, another rounding): lay the rows out alike.
            result = result.t().contiguous().t()
        results.append(result)
    return results


def _back_sends(
    wholes: dict[int, torch.Tensor], rows: list[RowLayout], owned: list[RowLayout], ring: RowGroup
) -> dict[int, list[torch.Tensor]] | Packed:
    """The owner's rows of each result for each rank holding them (by layout rank).

    One matrix owned whose pieces go to ranks in ascending group order, none padded: its bytes as they
    are (the pieces lie back to back in row order), no view or copy per rank.
    """
    if len(wholes) == 1:
        ((i, whole),) = wholes.items()
        pieces = routes(owned[i], rows[i], ring.position).send
        row_bytes = whole.shape[1] * whole.element_size()
        ranks = [ring.peers[piece.peer] for piece in pieces]
        if row_bytes % ALIGN == 0 and ranks == sorted(ranks):
            data = whole.contiguous().view(-1).view(torch.uint8)
            return Packed(data, {r: piece.rows * row_bytes for r, piece in zip(ranks, pieces, strict=True)})
    sends: dict[int, list[torch.Tensor]] = defaultdict(list)
    for i, whole in wholes.items():
        for piece in routes(owned[i], rows[i], ring.position).send:
            sends[piece.peer].append(whole[piece.start : piece.stop])
    return sends


def _exchange(
    sends: Mapping[int, list[torch.Tensor]] | Packed,
    expect: Mapping[int, int],
    ring: RowGroup,
    device: torch.device,
) -> Received:
    """``exchange`` over ``ring``'s group; ``sends`` and ``expect`` by layout rank, only the peers named.

    ``Packed`` sends are by group rank already.
    """
    peers = ring.peers
    return exchange(
        sends if isinstance(sends, Packed) else {peers[p]: tensors for p, tensors in sends.items()},
        ring.group,
        expect={peers[p]: n for p, n in expect.items()},
        device=device,
        mismatch=DISAGREE,
    )


def _momentum(optimizer: torch.optim.Optimizer, part: StepRows) -> DTensor:
    """The momentum buffer of ``part``'s parameter, made as torch's ``_init_group`` does, over its rows."""
    state: dict[str, Any] = optimizer.state[part.param]
    buffer = state.get("momentum_buffer")
    if buffer is None:
        buffer = part.wrap(torch.zeros_like(part.grad, memory_format=torch.preserve_format), None)
        state["momentum_buffer"] = buffer
    return buffer
