"""Weights streamed to an inference engine: every parameter once, then only the values that changed.

Owns: ``WeightSync``: the values of each parameter as last sent (this rank's local shard, in the sync
dtype), and one sync: per parameter, how many of its values changed on any rank, then the full tensor
(dense) or the changed values at their positions (sparse COO), whichever is fewer bytes. Does not
own: the gathers (DTensor's ``full_tensor``, one parameter at a time) or the consumer.

[Note: What a sync costs]
Per call after the first: one small all-reduce of how many values of each parameter changed (for
parameters sharded on one 1-D mesh, as an FSDP model's; others count with a DTensor sum each, replicas
once); nothing more for a parameter none of whose values did. A changed parameter is gathered in the
sync dtype (one all-gather of its shards); a sparse one also gathers its change mask (one byte per
element). Each rank keeps its local shard as last sent (one shard of the model in the sync dtype),
and compares it twice per call (counting, then sending).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["WeightSync"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SENDABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what engines load


class WeightSync:
    """Send a sharded model's weights to an inference engine, each call only what changed.

    ``updates()`` yields ``(name, tensor)`` pairs with the unsharded model's parameter names, in
    ``dtype``: on the first call every parameter, dense; on later calls only the parameters with a
    value that changed in ``dtype`` since the previous call, each as the full dense tensor or as a
    sparse COO tensor of the new values at the changed positions, whichever is fewer bytes. Feed
    them to a ``load_weights(...)``-style consumer (vLLM, SGLang) or copy them into a plain model.

    Every rank must iterate ``updates()`` to the end (it gathers); with ``rank=r``, only rank ``r``
    receives pairs and the others iterate through nothing but still take part in the gathers. One
    parameter is unsharded at a time. ``bytes_sent`` is the bytes yielded by the last finished call
    (dense: the tensor's; sparse: its indices and values). The values last sent are committed when a
    call finishes, so a call that stopped early is repeated in full by the next. See [Note: What a
    sync costs].

    Args:
        model: the sharded model (plain parameters are sent as they are).
        dtype: the dtype the consumer holds (default ``torch.bfloat16``): float16, bfloat16, float32 or
            float64.
        rank: the one rank that receives the pairs (``None``: every rank), a rank of the job.

    Raises:
        TypeError: ``model`` is not a module, or ``dtype`` not a dtype.
        ValueError: ``dtype`` is not one of the four above (an integer or bool would truncate the
            weights; float8 cannot be compared and sent sparse), or ``rank`` is not a rank of the job.
    """

    def __init__(
        self, model: nn.Module, dtype: torch.dtype = torch.bfloat16, *, rank: int | None = None
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"WeightSync expects an nn.Module, got {type(model).__name__}.")
        if not isinstance(dtype, torch.dtype):  # a user may pass anything
            raise TypeError(f"WeightSync dtype must be a torch.dtype (e.g. torch.bfloat16), got {dtype!r}.")
        if dtype not in _SENDABLE:
            raise ValueError(
                f"WeightSync cannot send weights as {dtype}: integers and bool would truncate them, and "
                "float8 and complex dtypes cannot be compared and sent sparse. Use one of float16, "
                "bfloat16, float32 or float64, and quantise on the engine's side."
            )
        world = dist.get_world_size() if dist.is_initialized() else 1
        usable = isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < world
        if rank is not None and not usable:
            raise ValueError(
                "WeightSync rank must be None (every rank receives) or a rank of this job, "
                f"0 to {world - 1}; got {rank!r}."
            )
        self.model = model
        self.dtype = dtype
        self.rank = rank
        self.bytes_sent = 0
        self._sent: dict[str, torch.Tensor] = {}  # name -> this rank's local values as last sent

    def updates(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield what changed since the last finished call (everything the first time); see the class."""
        here = self.rank is None or not dist.is_initialized() or dist.get_rank() == self.rank
        params = list(self.model.named_parameters())
        with torch.no_grad():
            changed = self._changed_counts(params) if self._sent else None
        sending: dict[str, torch.Tensor] = {}
        total = 0
        with torch.no_grad():
            for index, (name, param) in enumerate(params):
                local = self._local_values(param)
                sending[name] = local
                if changed is None:
                    out = _full(param, local)
                elif changed[index] == 0:
                    continue
                else:
                    mask = _bits(local) != _bits(self._sent[name])
                    out = self._changed(param, local, mask, changed[index])
                if here:
                    total += _nbytes(out)
                    yield name, out
                del out
        self._sent = sending
        self.bytes_sent = total if here else 0

    def _local_values(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's values of ``param`` in the sync dtype, as a tensor of their own."""
        source = _local(param)
        local = source.to(self.dtype)
        return local.clone() if local is source else local  # the shard changes in place

    def _changed_counts(self, params: Sequence[tuple[str, torch.Tensor]]) -> list[int]:
        """How many values of each parameter changed on any rank since the last call.

        One all-reduce for the parameters sharded on one 1-D mesh (an FSDP model's); a DTensor sum
        each for the others (replicas counted once).
        """
        counts: list[int] = [0] * len(params)
        batched: dict[int, tuple[Any, list[int], list[torch.Tensor]]] = {}
        for index, (name, param) in enumerate(params):
            previous = self._sent.get(name)
            local = self._local_values(param)
            if previous is None or previous.shape != local.shape:
                counts[index] = local.numel() or 1  # new, or reshaped: sent dense
                continue
            mask = _bits(local) != _bits(previous)
            if isinstance(param, DTensor) and param.device_mesh.ndim == 1:
                mesh = param.device_mesh
                entry = batched.setdefault(id(mesh), (mesh, [], []))
                entry[1].append(index)
                entry[2].append(mask.sum().reshape(1))
            else:
                counts[index] = int(_full_sum(param, mask))
        for mesh, indices, local_counts in batched.values():
            summed = torch.cat(local_counts).to(mesh.device_type)
            dist.all_reduce(summed, group=mesh.get_group())
            for index, count in zip(indices, summed.tolist(), strict=True):
                counts[index] = int(count)
        return counts

    def _changed(
        self, param: torch.Tensor, local: torch.Tensor, mask: torch.Tensor, changed: int
    ) -> torch.Tensor:
        """The new values of a parameter with ``changed`` changed values: dense or sparse, fewer bytes."""
        full = _full(param, local)
        sparse_bytes = changed * (full.dim() * 8 + full.element_size())
        if sparse_bytes >= full.numel() * full.element_size():
            return full
        where = _full(param, mask)
        indices = where.nonzero().t()
        # nonzero() gives sorted, unique indices: coalesced and valid by construction
        return torch.sparse_coo_tensor(
            indices, full[where], full.shape, is_coalesced=True, check_invariants=False
        )


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's values of ``param``: a DTensor's local shard, or the tensor itself."""
    return param.to_local() if isinstance(param, DTensor) else param.detach()


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` laid out as ``param`` is (a DTensor with its mesh, placements, shape and stride)."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _full(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The whole tensor of which ``local`` is this rank's part (one all-gather for a DTensor)."""
    laid_out = _like(param, local)
    return laid_out.full_tensor() if isinstance(laid_out, DTensor) else laid_out


def _full_sum(param: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """How many elements ``mask`` marks over every rank (replicas counted once)."""
    laid_out = _like(param, mask.to(torch.int64))
    total = laid_out.sum()
    return total.full_tensor() if isinstance(total, DTensor) else total


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values as integers: a NaN equals itself, -0.0 differs from 0.0."""
    return tensor.contiguous().view(_INT_OF_SIZE[tensor.element_size()])


def _nbytes(tensor: torch.Tensor) -> int:
    if tensor.is_sparse:
        return tensor._indices().numel() * 8 + tensor._values().numel() * tensor.element_size()  # noqa: SLF001
    return tensor.numel() * tensor.element_size()
