"""Weights streamed to an inference engine: every parameter once, then only the values that changed.

Owns: ``WeightSync``: the values of each parameter as last sent (this rank's local shard, in the sync
dtype), and one sync: per parameter, how many of its values changed on any rank, then the full tensor
(dense) or the changed values at their positions (sparse COO), whichever is fewer bytes; and when it
yields against when it gathers (see [Note: No yield inside a collective]). Does not own: the gathers
(``_gather_buckets``: one all-gather per bucket of parameters), each rank's shards with their
places (``_local_shards``), or the consumer.

[Note: What a sync costs]
Per call after the first: one small all-reduce of how many values of each parameter changed (per
process group the parameters are sharded over: one for an FSDP or HSDP model; a DTensor sum each for
other layouts); nothing more for a parameter none of whose values did. The changed parameters are
gathered in the sync dtype in buckets of up to ``bucket_mb`` (unsharded), one all-gather each; a
sparse one adds its change mask (one byte per element) to its bucket. Each rank keeps its local
shard as last sent (one shard of the model in the sync dtype), and compares it once per call.

[Note: No yield inside a collective]
A consumer may run collectives or sends of its own between two pairs (rank 0 sending each tensor to
the engine over another process group). That deadlocks if the peer it waits on is inside one of this
call's collectives, waiting for the consumer's rank. So:
- A rank yields a bucket's pairs only once every collective of that bucket has completed on it, and
  issues the next bucket's collectives (or the next call's count) only once its consumer has come
  back from the bucket's last pair.
- With ``rank=None`` every rank yields the same pairs in the same buckets. A rank enters the next
  bucket only after its consumer handled every pair so far, so a consumer that waits between yields
  on outside processes, or on another rank's consumer handling the same pair, never waits on a rank
  that waits for it in a collective. (A peer may still be finishing the bucket's all-gather, but the
  yielding rank's part of it has completed: the peer needs nothing more from it.)
- With ``rank=r`` the other ranks yield nothing, and their consumers can only act after their loop.
  So every collective of the call (every bucket) completes before rank ``r`` yields its first pair:
  rank ``r`` then holds everything it sends (the whole model, in the sync dtype, on the first call);
  the others free each bucket once gathered.
What remains the consumer's: not to wait, between yields, on work another rank does later in its own
loop (with ``rank=None``: for a pair that rank has not reached yet).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from ..param import local_in_placements
from ._gather_buckets import Item, buckets, gather_bucket, gather_device, row_group
from ._local_shards import LocalShard, local_shards

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
    receives pairs and the others iterate through nothing but still take part in the gathers.
    Parameters are gathered in buckets of up to ``bucket_mb`` megabytes once unsharded, one
    all-gather of packed shards per bucket. A bucket's pairs are yielded only once all its
    collectives have completed, and no collective is in flight on this rank while a pair is out, so
    the consumer may communicate on other process groups between pairs; with ``rank=r``, every
    bucket is gathered before the first pair (see [Note: No yield inside a collective]).
    ``bytes_sent`` is the bytes yielded by the last finished call (dense: the tensor's; sparse: its
    indices and values). The values last sent are committed when a call finishes, so a call that
    stopped early is repeated in full by the next. See [Note: What a sync costs].

    ``local_shards()`` yields each rank's own shards with their places instead, for engines that
    reshard themselves: no collective at all.

    Args:
        model: the sharded model (plain parameters are sent as they are).
        dtype: the dtype the consumer holds (default ``torch.bfloat16``): float16, bfloat16, float32 or
            float64.
        rank: the one rank that receives the pairs (``None``: every rank), a rank of the job.
        bucket_mb: the most unsharded megabytes (2**20 bytes) one all-gather carries (default 64); a
            larger parameter is gathered alone, and ``0`` gathers one parameter at a time.

    Raises:
        TypeError: ``model`` is not a module, ``dtype`` not a dtype, or ``bucket_mb`` not a number.
        ValueError: ``dtype`` is not one of the four above (an integer or bool would truncate the
            weights; float8 cannot be compared and sent sparse), ``rank`` is not a rank of the job,
            or ``bucket_mb`` is negative or not finite.
    """

    def __init__(
        self,
        model: nn.Module,
        dtype: torch.dtype = torch.bfloat16,
        *,
        rank: int | None = None,
        bucket_mb: float = 64,
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
        _check_bucket_mb(bucket_mb)
        self.model = model
        self.dtype = dtype
        self.rank = rank
        self.bucket_mb = bucket_mb
        self.bytes_sent = 0
        self._sent: dict[str, torch.Tensor] = {}  # name -> this rank's local values as last sent

    def updates(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield what changed since the last finished call (everything the first time); see the class."""
        here = self.rank is None or not dist.is_initialized() or dist.get_rank() == self.rank
        with torch.no_grad():
            items, sending = self._items(list(self.model.named_parameters()))
        cuts = buckets(items, int(self.bucket_mb * 2**20))
        batches: Iterator[list[tuple[str, torch.Tensor]]]
        if self.rank is not None and dist.is_initialized() and dist.get_world_size() > 1:
            # the other ranks yield nothing: every collective before the first pair (see the Note)
            batches = _drain([self._gather(group, bucket, keep=here) for group, bucket in cuts])
        else:  # every rank yields: one bucket at a time, in step
            batches = (self._gather(group, bucket, keep=here) for group, bucket in cuts)
        total = 0
        for pairs in batches:
            for name, out in pairs:
                total += _nbytes(out)
                yield name, out
        self._sent = sending
        self.bytes_sent = total if here else 0

    def local_shards(self) -> Iterator[LocalShard]:
        """This rank's part of every parameter, in ``dtype``, with its place in the full tensor.

        No collective and nothing kept: each call yields one ``LocalShard`` per parameter (the
        unsharded model's names), for a receiver that assembles or reshards the weights itself
        (see docs/post-training.md). Every parameter, every call; ``bytes_sent`` is not changed.

        Raises:
            ValueError: a parameter's local part is not one block of the full tensor (a
                ``_StridedShard`` of FSDP inside tensor parallelism) or holds partial sums.
        """
        return local_shards(self.model, self.dtype)

    def _items(
        self, params: Sequence[tuple[str, torch.Tensor]]
    ) -> tuple[list[Item], dict[str, torch.Tensor]]:
        """What this call sends (changed parameters, each dense or with its mask), and the new values."""
        values = {name: self._local_values(param) for name, param in params}
        if not self._sent:
            return [Item(name, param, values[name]) for name, param in params], values
        masks = {
            name: _bits(local) != _bits(self._sent[name])
            for name, local in values.items()
            if name in self._sent and self._sent[name].shape == local.shape
        }
        counts = _changed_counts(params, masks)
        items = []
        for (name, param), changed in zip(params, counts, strict=True):
            if changed == 0:
                continue
            mask = masks.get(name)
            item_size = values[name].element_size()
            sparse = mask is not None and changed * (param.dim() * 8 + item_size) < param.numel() * item_size
            items.append(Item(name, param, values[name], mask if sparse else None))
        return items, values

    def _gather(self, group: object, bucket: list[Item], *, keep: bool) -> list[tuple[str, torch.Tensor]]:
        """The bucket's pairs, every collective of it completed (nothing kept unless ``keep``)."""
        with torch.no_grad():
            gathered = gather_bucket(group, bucket, _full)
            if not keep:
                return []
            return [
                (item.name, _pair(full, where)) for item, (full, where) in zip(bucket, gathered, strict=True)
            ]

    def _local_values(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's values of ``param`` in the sync dtype, as a tensor of their own."""
        source = _local(param)
        local = source.to(self.dtype)
        return local.clone() if local is source else local  # the shard changes in place


def _drain(batches: list[list[tuple[str, torch.Tensor]]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The batches in order, each let go of once handed out."""
    while batches:
        yield batches.pop(0)


def _check_bucket_mb(bucket_mb: object) -> None:
    if not isinstance(bucket_mb, int | float) or isinstance(bucket_mb, bool):
        raise TypeError(f"WeightSync bucket_mb must be a number of megabytes (e.g. 64), got {bucket_mb!r}.")
    if not math.isfinite(bucket_mb) or bucket_mb < 0:
        raise ValueError(
            f"WeightSync bucket_mb must be 0 (one parameter per gather) or a positive number of "
            f"megabytes; got {bucket_mb!r}."
        )


def _changed_counts(params: Sequence[tuple[str, torch.Tensor]], masks: dict[str, torch.Tensor]) -> list[int]:
    """How many values of each parameter changed on any rank since the last call.

    One all-reduce per process group the parameters' rows are sharded over (replicas counted once);
    a DTensor sum each for other layouts; a parameter with no mask (new or reshaped) counts as all.
    """
    counts: list[int] = [0] * len(params)
    batched: dict[int, tuple[object, list[int], list[torch.Tensor]]] = {}
    for index, (name, param) in enumerate(params):
        mask = masks.get(name)
        group = row_group(param)
        if mask is None:
            counts[index] = param.numel() or 1  # new, or reshaped: sent dense
        elif group is not None:
            entry = batched.setdefault(id(group), (group, [], []))
            entry[1].append(index)
            entry[2].append(mask.sum().reshape(1).to(gather_device(param, mask)))
        else:
            counts[index] = int(_full_sum(param, mask))
    for group, indices, local_counts in batched.values():
        summed = torch.cat(local_counts)
        dist.all_reduce(summed, group=group, async_op=True).wait()
        for index, count in zip(indices, summed.tolist(), strict=True):
            counts[index] = int(count)
    return counts


def _pair(full: torch.Tensor, where: torch.Tensor | None) -> torch.Tensor:
    """The full tensor, or its values at ``where`` as a sparse COO tensor."""
    if where is None:
        return full
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
    """The whole tensor of which ``local`` is this rank's part, its collectives completed."""
    laid_out = _like(param, local)
    if not isinstance(laid_out, DTensor):
        return laid_out
    return local_in_placements(laid_out, [Replicate()] * laid_out.device_mesh.ndim)  # waits


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
