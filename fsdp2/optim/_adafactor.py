"""``torch.optim.Adafactor`` on row shards: its factored statistics from small all-reduces, no matrix moved.

Owns: ``factored_step``, torch 2.13's Adafactor update (``_single_tensor_adafactor``) computed on each
rank's rows of the parameters ``fully_shard`` sharded on dim 0 (of its shard, or of its replica slice
with the sums over all ``R x S`` ranks, see ``_cross_replica``), and the layout of its state between
steps. Does not own: when it runs (``_whole_tensor``'s step hooks) or Adafactor's settings (its param
groups).

[Note: Adafactor on rows]
Of Adafactor's quantities for a matrix (rows sharded), the row statistics, the variance estimate and
the update are each a function of one row, given two vectors every rank can hold: the column factor
(one value per column) and the mean of the row factor. What needs every row is a sum: of the squared
gradient down each column (for the column factor), of the row factor (for its mean), of the squared
parameter and of the squared update (for the relative step size and the update clipping). So one
step is two all-reduces per shard group, whatever the number of parameters: the parameter norms, the
column sums and the row-factor sums of every parameter in one, then the update norms in the other
(they need the first's results). A tensor of more dims factors over its last two, which dim 0 is not:
only its norms are summed. State between steps: ``step`` a plain tensor, ``row_var`` and a vector's
``variance`` DTensors sharded like their parameter, ``col_var`` of a matrix a plain tensor equal on
every rank (of more dims: sharded). Numbers: the unsharded model's within fp32 rounding (sums in
another order).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..param import local_of
from ._step_rows import StepRows

__all__ = ["factored_step"]


def factored_step(optimizer: torch.optim.Optimizer, parts: list[StepRows], group: dist.ProcessGroup) -> None:
    """One Adafactor step of each parameter's rows in ``parts``, its rows spread over ``group``.

    ``parts``: the rows of local shards (``group``: their shard group), or of replica slices
    (``group``: all ``R x S`` ranks).
    """
    settings = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    device = parts[0].local.device
    entries = []
    for part in parts:
        g = settings[id(part.param)]
        grad = -part.grad if g["maximize"] else part.grad
        state = _state_of(optimizer, part, grad)
        state["step"] += 1
        entries.append((part, grad, state, g))
    # Round 1: squared parameter norms (before weight decay), and for matrices the column sums of the
    # squared gradient and the row factor's sum (after its update, which needs only this rank's rows).
    first: list[torch.Tensor] = []
    for part, grad, state, g in entries:
        first.append(part.local.float().pow(2).sum().reshape(1))
        if grad.dim() == 2:
            step_float = state["step"].item()
            row_mean = torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1))
            local_of(state["row_var"]).lerp_(row_mean, step_float ** g["beta2_decay"])
            first.append(grad.pow(2).sum(dim=-2).reshape(-1).float())
            first.append(local_of(state["row_var"]).sum().reshape(1).float())
    sums = iter(_all_reduce(first, device, group))
    second: list[torch.Tensor] = []
    updates = []
    for part, grad, state, g in entries:
        param, local = part.param, part.local
        eps1, eps2 = g["eps"]
        eps1 = torch.finfo(local.dtype).eps if eps1 is None else eps1
        lr = float(g["lr"])
        step_float = state["step"].item()
        beta = step_float ** g["beta2_decay"]
        rho_t = min(lr, 1 / (step_float**0.5))
        param_norm = math.sqrt(next(sums).item())
        alpha = max(eps2, param_norm / (param.numel() ** 0.5)) * rho_t
        if g["weight_decay"] != 0:
            local.mul_(1 - lr * g["weight_decay"])
        if grad.dim() == 2:
            columns = next(sums)
            col_mean = columns.sqrt().square_().div_(param.shape[0]).to(grad.dtype).reshape(1, -1)
            state["col_var"].lerp_(col_mean, beta)
            row_mean_all = next(sums).to(grad.dtype) / param.shape[0]
            var_estimate = local_of(state["row_var"]) @ state["col_var"]
            var_estimate.div_(row_mean_all.clamp_(min=eps1))
        elif grad.dim() > 2:
            row_var, col_var = local_of(state["row_var"]), local_of(state["col_var"])
            row_var.lerp_(torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1)), beta)
            col_var.lerp_(torch.norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2)), beta)
            var_estimate = row_var @ col_var
            var_estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
        else:
            variance = local_of(state["variance"])
            variance.lerp_(grad * grad, beta)
            var_estimate = variance.clone()
        update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
        update.mul_(grad)
        second.append(update.float().pow(2).sum().reshape(1))
        updates.append((local, update, alpha, g["d"], param.numel()))
    norms = _all_reduce(second, device, group)
    for (local, update, alpha, d, numel), norm_sq in zip(updates, norms, strict=True):
        denom = max(1.0, math.sqrt(norm_sq.item()) / ((numel**0.5) * d))
        local.add_(update, alpha=-alpha / denom)


def _all_reduce(
    tensors: list[torch.Tensor], device: torch.device, group: dist.ProcessGroup
) -> list[torch.Tensor]:
    """Sum ``tensors`` over ``group`` in one all-reduce; the sums, in the same pieces."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1).to(device=device, dtype=torch.float32) for t in tensors])
    dist.all_reduce(flat, group=group)
    return list(flat.split([t.numel() for t in tensors]))


def _state_of(optimizer: torch.optim.Optimizer, part: StepRows, grad: torch.Tensor) -> dict[str, Any]:
    """The Adafactor state of ``part``'s parameter, made as torch's ``_init_group`` makes it, on rows."""
    param = part.param
    state: dict[str, Any] = optimizer.state[param]
    if state:
        return state
    state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
    if grad.dim() > 1:
        row_shape = list(param.shape)
        row_shape[-1] = 1
        col_shape = list(param.shape)
        col_shape[-2] = 1
        state["row_var"] = _zero_rows(part, grad, row_shape)
        if grad.dim() == 2:
            state["col_var"] = grad.new_zeros(col_shape)  # every column: the same on every rank
        else:
            state["col_var"] = _zero_rows(part, grad, col_shape)
    else:
        state["variance"] = _zero_rows(part, grad, list(param.shape))
    return state


def _scalar_dtype() -> torch.dtype:
    """The dtype torch's optimizers keep step counts in (float64 under a float64 default dtype)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _zero_rows(part: StepRows, grad: torch.Tensor, shape: list[int]) -> DTensor:
    """Zeros of global ``shape`` over this rank's rows of ``part``, kept as its state is."""
    return part.wrap(grad.new_zeros([grad.shape[0], *shape[1:]]), tuple(shape))
