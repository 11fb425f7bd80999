"""``clip_grad_norm_`` for sharded models: norms of local shards, one all-reduce per layout.

Owns: ``clip_grad_norm_``, a drop-in for ``torch.nn.utils.clip_grad_norm_`` on models whose gradients
are DTensors (fsdp2, HSDP, tensor parallel, or mixes of them). Does not own: anything of the FSDP
engine; it only reads ``.grad`` of the parameters it is given.

How: gradients are grouped by layout (mesh and placements). For each layout, the local tensors'
``|g|^p`` sums (one foreach norm) are reduced over the mesh dims that shard them and kept as they are
over the dims that replicate them: one collective per layout, not one per gradient. Plain-tensor
gradients count as they are. Scaling multiplies the local tensors in place (one foreach op).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

from ..param import local_of


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradients of ``parameters`` to a total ``norm_type`` norm of ``max_norm``, in place.

    Same arguments and meaning as ``torch.nn.utils.clip_grad_norm_``, for gradients that are DTensors
    on any meshes (FSDP, HSDP, tensor parallel, mixed in one model) or plain tensors. Every rank gets
    the same total norm.

    Args:
        parameters: tensors (or one tensor) whose ``.grad`` to clip; ``None`` gradients are skipped.
        max_norm: the largest total norm allowed.
        norm_type: the p of the p-norm; ``float("inf")`` for the largest absolute value.
        error_if_nonfinite: raise if the total norm is NaN or infinite.
        foreach: accepted for compatibility; fsdp2 always uses the foreach kernels.

    Returns:
        The total norm before clipping, a plain scalar tensor (``.item()`` works directly).

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the total norm is not finite.
    """
    del foreach
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    if not grads:
        return torch.tensor(0.0)
    layouts: dict[Any, list[torch.Tensor]] = {}
    plain: list[torch.Tensor] = []
    for grad in grads:
        if isinstance(grad, DTensor):
            layouts.setdefault((grad.device_mesh, tuple(grad.placements)), []).append(grad)
        else:
            plain.append(grad)
    is_inf = math.isinf(norm_type)
    partials = [_layout_norm_power(group, norm_type) for group in layouts.values()]
    if plain:
        partials.append(_local_norm_power([g.detach() for g in plain], norm_type))
    device = partials[0].device
    stacked = torch.stack([p.to(device) for p in partials])
    total = stacked.max() if is_inf else stacked.sum().pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so it "
            "cannot be clipped. Set error_if_nonfinite=False to clip anyway (gradients become NaN)."
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    locals_ = [local_of(g) if isinstance(g, DTensor) else g for g in grads]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in locals_:
        by_device.setdefault(tensor.device, []).append(tensor)
    for tensor_device, tensors in by_device.items():
        torch._foreach_mul_(tensors, coef.to(tensor_device))
    return total


def _local_norm_power(tensors: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """``sum |t|^p`` over ``tensors`` (``max |t|`` for the inf norm), as a float32 scalar.

    Empty tensors (a rank's empty shard) contribute nothing: 0 is the identity of both.
    """
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    norms = torch._foreach_norm(tensors, norm_type)  # noqa: SLF001 - the foreach kernels are public in practice
    stacked = torch.stack([n.float() for n in norms])
    return stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum()


def _layout_norm_power(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm power of gradients sharing one layout, reduced over the mesh dims that shard them."""
    first = grads[0]
    assert isinstance(first, DTensor)
    local = _local_norm_power([local_of(g) for g in grads if isinstance(g, DTensor)], norm_type)
    reduce_op = "max" if math.isinf(norm_type) else "sum"
    placements = [Replicate() if p.is_replicate() else Partial(reduce_op) for p in first.placements]
    if all(p.is_replicate() for p in placements):
        return local
    scalar = DTensor.from_local(local, first.device_mesh, placements, run_check=False)
    return scalar.full_tensor()
