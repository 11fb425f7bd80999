"""``torch.optim.Muon`` on row shards: only the Newton-Schulz input and output travel, once each.

Owns: ``rows_step``, torch 2.13's Muon update (``_single_tensor_muon``) for the matrices
``fully_shard`` sharded on dim 0. Does not own: when it runs (``_whole_tensor``'s step hooks), the
owners (``_owner_exchange``), the routes and the exchange (``param._rows``, ``comm._exchange``), the
Newton-Schulz iteration and the learning-rate adjustment (torch's own functions, called as they are).

[Note: Muon on rows]
Of Muon's update only the orthogonalisation needs the whole matrix; the momentum, the Nesterov blend,
the weight decay and the final add are elementwise. So each rank updates its rows of the momentum and
blends its rows of the update, one all-to-all sends the update's rows to the matrix's owner (owners
balanced by Newton-Schulz work), the owner orthogonalises the whole update with torch's own function,
one all-to-all returns each rank its rows of the result (bf16, as torch's Newton-Schulz returns it),
and each rank applies weight decay and the update to its rows. The same operations on the same
values as the unsharded model: fp32 parameters are bit-identical. bf16 parameters may differ by a
bf16 ulp where the CPU's vectorised add rounds an element differently than on the whole matrix (which
elements fall in a vector's body or its tail depends on the row count); at one rank they are
bit-identical. Per step, each rank receives 2 N M (W - 1) / W^2 bytes for N matrices of M bytes (an
update's rows on the way to its owner, the result's rows on the way back), against 5 N M (W - 1) / W^2
for the general owner step and N M (W - 1) / W for an all-gather of every update on every rank. The
momentum stays a DTensor sharded like its parameter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..comm import exchange, nbytes_of
from ..param import RowLayout, local_of, routes
from ._owner_exchange import DISAGREE, join_rows, owners_of, sharded_like

try:  # torch's own functions: the unsharded model's operations, bit for bit
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
except ImportError:  # another torch: the general owner step serves Muon instead
    _adjust_lr = _zeropower_via_newtonschulz = None  # type: ignore[assignment]  # reason: absent

__all__ = ["ROWS_AVAILABLE", "rows_step"]

ROWS_AVAILABLE = _zeropower_via_newtonschulz is not None


def rows_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """One Muon step of ``params`` (row-sharded DTensor matrices with gradients, one shard group)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = params[0].device
    settings = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    rows = [RowLayout.chunked(p.shape[0], world) for p in params]
    owners = owners_of(params, world)
    owned = [RowLayout.owned(p.shape[0], world, owner) for p, owner in zip(params, owners, strict=True)]
    updates = []
    with torch.no_grad():
        for param in params:
            g = settings[id(param)]
            grad = local_of(param.grad)  # type: ignore[arg-type]
            buffer = local_of(_momentum(optimizer, param, grad))
            buffer.lerp_(grad, 1 - g["momentum"])
            updates.append(grad.lerp(buffer, g["momentum"]) if g["nesterov"] else buffer)
        # There: each rank's rows of each update to the matrix's owner.
        sends: list[list[torch.Tensor]] = [[] for _ in range(world)]
        expect = [0] * world
        for i, update in enumerate(updates):
            sends[owners[i]].append(update)
            for piece in routes(rows[i], owned[i], rank).receive:
                expect[piece.peer] += nbytes_of((piece.rows, *update.shape[1:]), update.dtype)
        received = exchange(sends, group, expect=expect, device=device, mismatch=DISAGREE)
        results: dict[int, torch.Tensor] = {}
        for i, update in enumerate(updates):
            if owners[i] != rank:
                continue
            pieces = [
                received.take(piece.peer, (piece.rows, *update.shape[1:]), update.dtype)
                for piece in routes(rows[i], owned[i], rank).receive
            ]
            g = settings[id(params[i])]
            whole = join_rows(pieces, update)
            results[i] = _zeropower_via_newtonschulz(whole, g["ns_coefficients"], g["ns_steps"], g["eps"])
        # Back: each rank's rows of each orthogonalised update.
        sends = [[] for _ in range(world)]
        for i, result in results.items():
            for piece in routes(owned[i], rows[i], rank).send:
                sends[piece.peer].append(result[piece.start : piece.stop])
        expect = [0] * world  # torch 2.13's Newton-Schulz returns bf16 (a change shows as a count mismatch)
        for i, param in enumerate(params):
            expect[owners[i]] += nbytes_of((rows[i].count(rank), param.shape[1]), torch.bfloat16)
        received = exchange(sends, group, expect=expect, device=device, mismatch=DISAGREE)
        for i, param in enumerate(params):
            g = settings[id(param)]
            shape = (rows[i].count(rank), param.shape[1])
            result = received.take(owners[i], shape, torch.bfloat16)
            if param.shape[0] > param.shape[1]:
                # torch's Newton-Schulz returns a tall matrix as a transposed view, and the add takes
                # another kernel for such an operand (in bf16, another rounding): lay the rows out alike.
                result = result.t().contiguous().t()
            lr = float(g["lr"])
            local = local_of(param)  # type: ignore[arg-type]
            local.mul_(1 - lr * g["weight_decay"])
            local.add_(result, alpha=-_adjust_lr(lr, g["adjust_lr_fn"], param.shape))


def _momentum(optimizer: torch.optim.Optimizer, param: torch.Tensor, grad: torch.Tensor) -> DTensor:
    """``param``'s momentum buffer, made as torch's ``_init_group`` makes it, sharded like ``param``."""
    state: dict[str, Any] = optimizer.state[param]
    buffer = state.get("momentum_buffer")
    if buffer is None:
        buffer = sharded_like(param, torch.zeros_like(grad, memory_format=torch.preserve_format))
        state["momentum_buffer"] = buffer
    return buffer
