"""Foreach collectives over the parameters of one group: functions, tensors in and tensors out.

Owns: the all-gather copy-in (every parameter's 1-D input into one flat buffer), the all-gather,
the copy-out into per-parameter outputs, the reduce-scatter copy-in (chunk-concatenation of padded
gradients), the reduce-scatter, and the view-out into per-parameter shards; plus the reduce ops and
divide factors, and the agreements of a group's ranks (``all_ranks_true``, ``raise_everywhere``).
Buffers are allocated by, and collectives issued through, the comm objects passed in
(``_comms``; the defaults when none is given). Module state: one cache of contiguous strides by shape
(``_STRIDES``). Does not own: streams' lifetimes (``CommContext``) or registering parameters.

Layouts (W ranks, parameter i contributes ``n_i`` elements per rank, ``B = sum n_i``):
- all-gather buffer: ``[rank 0: p0 | p1 | ...][rank 1: p0 | p1 | ...]...``, ``W * B`` elements; this
  rank's input is the view ``[r*B, (r+1)*B)`` so the collective runs in place.
- reduce-scatter input: viewed as ``(W, S)``; row ``j`` is chunk ``j`` (dim 0, zero-padded) of every
  gradient, flattened, in parameter order. Row ``j`` is what rank ``j`` receives.
Several groups sharing one collective (``_bucket``) place their blocks side by side within each row;
an ``AllGatherResult`` then names its group's columns.

[Note: Ring summation order]
gloo's reduce-scatter is a ring all-reduce of the whole ``(W, S)`` buffer. The ring cuts the buffer's
``N = W * S`` elements into ``k * W`` segments of ``ceil(N / (k * W))`` elements (``k = 2``, more for
buffers over ``2W`` MiB: no segment above 1 MiB) and chunk ``c`` (``k`` segments) is summed in the order
``((x[c-1] + x[c-2]) + ...) + x[c]`` of the ranks' inputs (indices mod ``W``), then divided for AVG.
So an element's sum depends on which chunk holds it, and with ``S`` not a multiple of ``k`` chunks
straddle rows. Measured on torch 2.13's gloo, bit for bit, for 3 and 4 ranks and 4 to 8M elements;
pinned by tests/group/test_sums_gloo.py. Two buffers sum column ``c < S`` of row ``j`` alike iff that
element falls in the same chunk in both: a usage row (``group/_usage.py``) lengthens rows to ``S + P``
and would move the first elements of ranks 1.. into the previous chunk, unless padded
(``same_order_tail``: at most a few zeros).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ._comms import DefaultAllGather, DefaultReduceScatter, comm_type

ReduceOp = dist.ReduceOp
_DEFAULT_ALL_GATHER = DefaultAllGather()
_DEFAULT_REDUCE_SCATTER = DefaultReduceScatter()


@dataclass
class AllGatherResult:
    """An issued all-gather: its flat output, and what copy-out must wait on."""

    output: torch.Tensor  # 1D, world_size * sum(split_sizes)
    split_sizes: list[int]  # per-parameter input numel (one rank's share)
    world_size: int
    event: torch.Event | None  # all-gather stream event (CUDA); None on CPU
    work: dist.Work | None  # async work handle (async_op=True)
    # A bucketed all-gather (several groups, one collective): ``(start, width)``, the columns of the
    # ``(W, row)`` output that hold this group's inputs. ``None``: the whole row is this group's.
    columns: tuple[int, int] | None = None
    # The collective's input on the side streams (a view of ``output``, or a tensor of its own such as
    # the host-to-device copy of packed shards under CPU offload): released with the output, once
    # the all-gather streams wait on copy-out, so the caching allocator cannot hand its memory to
    # the copy-in stream while the all-gather stream may still read it.
    input: torch.Tensor | None = None


# (flat output, this rank's input block (often a view of the output), per-parameter input numels)
CopyIn = tuple[torch.Tensor, torch.Tensor, list[int]]


def all_gather_copy_in(
    inputs: list[torch.Tensor], world_size: int, rank: int, dtype: torch.dtype, comm: Any = None
) -> CopyIn:
    """Allocate the flat output (``comm.allocate``) and copy (and cast) ``inputs`` into this rank's block.

    Returns ``(output, local_block, split_sizes)``; ``local_block`` views ``output``.
    """
    split_sizes = [t.numel() for t in inputs]
    block = sum(split_sizes)
    comm = _DEFAULT_ALL_GATHER if comm is None else comm
    output = comm.allocate((block * world_size,), dtype=dtype, device=inputs[0].device)
    local = output.narrow(0, block * rank, block)
    torch._foreach_copy_(torch.split_with_sizes(local, split_sizes), inputs)
    return output, local, split_sizes


def packed_all_gather_copy_in(
    packed: torch.Tensor, world_size: int, rank: int, dtype: torch.dtype, comm: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, input)`` for an all-gather of ``packed`` (a group's shards in one 1-D buffer).

    Nothing is copied where nothing needs to be: one rank gathers nothing (the input is the output),
    and the built-in all-gather reads ``packed`` itself. A cast, or a custom all-gather (which may
    expect its input inside its own output buffer), copies ``packed`` into this rank's block.
    """
    if world_size == 1 and packed.dtype == dtype:
        return packed, packed
    comm = _DEFAULT_ALL_GATHER if comm is None else comm
    block = packed.numel()
    output = comm.allocate((block * world_size,), dtype=dtype, device=packed.device)
    if world_size > 1 and packed.dtype == dtype and comm_type(comm) is DefaultAllGather:
        return output, packed
    local = output.narrow(0, block * rank, block)
    local.copy_(packed)
    return output, local


def issue_all_gather(
    output: torch.Tensor,
    local: torch.Tensor,
    group: dist.ProcessGroup,
    world_size: int,
    async_op: bool,
    comm: Any = None,
) -> dist.Work | None:
    """All-gather ``local`` (this rank's block, usually a view of ``output``) into ``output``.

    Nothing to do for one rank.
    """
    if world_size == 1:
        return None
    comm = _DEFAULT_ALL_GATHER if comm is None else comm
    work: dist.Work | None = comm(output, local, group, async_op)
    return work if async_op else None


def foreach_all_gather(
    inputs: list[torch.Tensor],
    group: dist.ProcessGroup,
    world_size: int,
    rank: int,
    dtype: torch.dtype,
    async_op: bool = False,
    comm: Any = None,
) -> AllGatherResult:
    """Copy-in and all-gather on the current stream (the caller picks the stream)."""
    output, local, split_sizes = all_gather_copy_in(inputs, world_size, rank, dtype, comm)
    work = issue_all_gather(output, local, group, world_size, async_op, comm)
    return AllGatherResult(output, split_sizes, world_size, None, work)


def wait_all_gather(result: AllGatherResult) -> None:
    """Make the current stream (and, for async work, the CPU) wait for an issued all-gather."""
    if result.work is not None:
        result.work.wait()
    if result.event is not None:
        torch.cuda.current_stream(result.output.device).wait_event(result.event)


def foreach_all_gather_copy_out(result: AllGatherResult, outputs: list[torch.Tensor]) -> None:
    """Scatter the flat all-gather output into each parameter's 1-D output (``W * split`` elements)."""
    world = result.world_size
    copy_out_2d(result, [o.view(world, -1) for o in outputs])


def copy_out_2d(result: AllGatherResult, outputs_2d: list[torch.Tensor]) -> None:
    """Copy-out into outputs already viewed as ``(W, split)`` (callers may cache those views)."""
    gathered = result.output.view(result.world_size, -1)
    if result.columns is not None:
        gathered = gathered.narrow(1, *result.columns)
    torch.split_with_sizes_copy(gathered, result.split_sizes, dim=1, out=outputs_2d)


def reduce_scatter_copy_in(
    grads: list[torch.Tensor],
    world_size: int,
    dtype: torch.dtype,
    shard_numel: int | None = None,
    comm: Any = None,
) -> torch.Tensor:
    """Chunk-concatenate the (dim-0 zero-padded) gradients into a ``(W, S)`` buffer cast to ``dtype``.

    ``shard_numel`` is ``S``, the sum of the padded shard numels, when the caller already knows it.
    The buffer comes from ``comm.allocate``.
    """
    if shard_numel is None:
        shard_numel = sum(_padded_shard_numel(g, world_size) for g in grads)
    comm = _DEFAULT_REDUCE_SCATTER if comm is None else comm
    buffer: torch.Tensor = comm.allocate((world_size * shard_numel,), dtype=dtype, device=grads[0].device)
    # One fused pad-chunk-concatenate-cast kernel instead of a Python loop over gradients.
    torch._chunk_cat(grads, dim=0, num_chunks=world_size, out=buffer.view(world_size, -1))  # noqa: SLF001
    return buffer


def same_order_tail(world_size: int, width: int, tail: int, element_size: int) -> int:
    """Columns to give a ``tail`` of ``tail`` elements after rows of ``width``: ``tail`` or a few more.

    Rows of ``width + result`` elements (of ``element_size`` bytes) reduce their first ``width``
    columns in the summation order rows of ``width`` alone get (see [Note: Ring summation order]), so
    a reduce-scatter that carries a tail (the usage row) sums the gradients exactly as torch's, which
    has none. Rows narrower than the ring's misalignment (``width`` odd and below ``world_size - 2``,
    on small buffers) have no such tail: ``tail`` is returned.
    """
    if tail == 0 or width == 0 or world_size <= 2:
        return tail  # nothing to keep, or two ranks (a + b == b + a: no order to keep)
    return _searched_tail(world_size, width, tail, element_size, _RING_SEGMENT_BYTES)


@functools.lru_cache(maxsize=4096)  # every reduce-scatter asks (twice): the search runs once per shape
def _searched_tail(world_size: int, width: int, tail: int, element_size: int, segment_bytes: int) -> int:
    """``same_order_tail``'s search (``segment_bytes``: the ring's segment size, part of the key)."""
    want = _ring_chunks(world_size, width, width, element_size)
    per_rank = _ring_segments(world_size, width + tail, element_size) // world_size
    for extra in range(tail, tail + 2 * (per_rank + world_size) + 2):
        if _ring_chunks(world_size, width + extra, width, element_size) == want:
            return extra
    return tail


# gloo's ring all-reduce (behind its reduce-scatter) cuts its buffer into segments of at most 1 MiB
_RING_SEGMENT_BYTES = 1 << 20


def _ring_segments(world_size: int, row: int, element_size: int) -> int:
    """Segments of a ``(world_size, row)`` buffer in gloo's ring: a multiple of ``world_size``, >= 2W."""
    max_elements = max(1, _RING_SEGMENT_BYTES // element_size)
    segments = max(-(-world_size * row // max_elements), 2 * world_size)
    return -(-segments // world_size) * world_size


def _ring_chunks(world_size: int, row: int, columns: int, element_size: int) -> list[tuple[int, ...]]:
    """Where gloo's ring chunks cut each rank's row of ``row`` elements, within its first ``columns``.

    Per rank: the chunk of its column 0, then the first column of every later chunk.
    """
    segments = _ring_segments(world_size, row, element_size)
    chunk = segments // world_size * -(-world_size * row // segments)
    rows = []
    for rank in range(world_size):
        start = rank * row
        first, last = start // chunk, (start + columns - 1) // chunk
        rows.append((first, *(k * chunk - start for k in range(first + 1, last + 1))))
    return rows


def all_reduce_before_tail(
    tensor: torch.Tensor, tail: int, group: dist.ProcessGroup, op: Any, all_reduce: Any
) -> int:
    """All-reduce 1-D ``tensor``, its first ``numel - tail`` elements summed as if they were alone.

    Returns how many collectives it issued (through ``all_reduce``). HSDP's and ``replicate``'s
    all-reduce carry the usage row after the gradients, which torch's have not. On gloo with 3 or
    more ranks the ring's cuts follow the buffer's length ([Note: Ring summation order]); where the
    tail moves a cut within the gradients, the tail gets an all-reduce of its own, so the gradients
    sum exactly as torch's. Elsewhere (two ranks, other backends): one.
    """
    head = tensor.numel() - tail
    plain = tail == 0 or head == 0 or tensor.is_cuda  # the cheap checks first: this runs every backward
    world_size = 0 if plain else dist.get_world_size(group)
    if plain or world_size <= 2 or "gloo" not in _backend_name(group):
        all_reduce(tensor, group, op)
        return 1
    whole = _ring_chunk(world_size, head + tail, tensor.element_size())
    alone = _ring_chunk(world_size, head, tensor.element_size())
    if whole == alone or head <= min(whole, alone):  # every gradient element keeps its chunk
        all_reduce(tensor, group, op)
        return 1
    all_reduce(tensor.narrow(0, 0, head), group, op)
    all_reduce(tensor.narrow(0, head, tail), group, op)
    return 2


def _ring_chunk(world_size: int, numel: int, element_size: int) -> int:
    """Elements per chunk of gloo's ring over a 1-D buffer of ``numel`` (see ``_ring_segments``)."""
    max_elements = max(1, _RING_SEGMENT_BYTES // element_size)
    segments = max(-(-numel // max_elements), 2 * world_size)
    segments = -(-segments // world_size) * world_size
    return segments // world_size * -(-numel // segments)


def _backend_name(group: dist.ProcessGroup) -> str:
    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return ""


def _padded_shard_numel(tensor: torch.Tensor, world_size: int) -> int:
    rows = tensor.size(0)
    return -(-rows // world_size) * (tensor.numel() // rows if rows else 0)


def reduce_scatter(
    buffer: torch.Tensor,
    group: dist.ProcessGroup,
    world_size: int,
    op: dist.ReduceOp.RedOpType,
    predivide: float | None,
    comm: Any = None,
) -> torch.Tensor:
    """Reduce-scatter ``buffer`` over ``group`` (through ``comm``); returns this rank's 1-D output."""
    if predivide is not None:
        buffer.div_(predivide)
    if world_size == 1:
        return buffer
    comm = _DEFAULT_REDUCE_SCATTER if comm is None else comm
    output: torch.Tensor = comm.allocate(
        (buffer.numel() // world_size,), dtype=buffer.dtype, device=buffer.device
    )
    comm(output, buffer, group, op)
    return output


@dataclass(frozen=True)
class DivideFactors:
    """How to average a reduction of ``N`` ranks: the collective op and explicit divisions around it."""

    op: dist.ReduceOp.RedOpType
    predivide: float | None
    postdivide: float | None


_AVG_SAFE_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def divide_factors(
    world_size: int, dtype: torch.dtype, factor: float | None = None, force_sum: bool = False
) -> DivideFactors:
    """How to average gradients over ``world_size`` ranks (shard x replicate) in ``dtype``.

    - default: ``AVG`` where the backend averages safely (fp32, bf16, fp64), plain ``SUM`` for one rank;
    - fp16-like dtypes: ``SUM`` with the divisor split into a pre- and a post-division, so the sum
      neither overflows (pre) nor underflows (post);
    - a custom ``factor`` (the *total* divisor): pre-scale by ``1/factor`` and ``SUM``, which is what a
      ``PREMUL_SUM`` would do but works on every backend (gloo has no ``PREMUL_SUM``);
    - ``force_sum``: only ``SUM`` collectives, then divide by ``factor`` (default ``world_size``) after.
    """
    if factor is None and not force_sum:
        if world_size == 1:
            return DivideFactors(ReduceOp.SUM, None, None)
        if dtype in _AVG_SAFE_DTYPES:
            return DivideFactors(ReduceOp.AVG, None, None)
    total = float(factor) if factor is not None else float(world_size)
    if dtype not in _AVG_SAFE_DTYPES:
        pre, post = split_divide_factor(total)
    elif force_sum:
        pre, post = 1.0, total
    else:
        pre, post = total, 1.0
    return DivideFactors(ReduceOp.SUM, pre if pre != 1 else None, post if post != 1 else None)


def split_divide_factor(total: float) -> tuple[float, float]:
    """``(pre, post)`` with ``pre * post == total`` and ``pre`` the largest power of two near ``sqrt``."""
    pre = 1
    while total % pre == 0 and total / pre > pre:
        pre *= 2
    return float(pre), total / pre


def view_out_shards(
    output: torch.Tensor, padded_numels: list[int], local_sizes: list[torch.Size]
) -> list[torch.Tensor]:
    """Per-parameter views of the flat reduce-scatter output at their unpadded local shapes."""
    views = []
    offset = output.storage_offset()
    for padded, size in zip(padded_numels, local_sizes, strict=True):
        # One as_strided per shard (about half the cost of narrow + view on the hot path).
        strides = _STRIDES.get(size)
        if strides is None:
            strides = _STRIDES[size] = contiguous_strides(size)
        views.append(output.as_strided(size, strides, offset))
        offset += padded
    return views


_STRIDES: dict[torch.Size, tuple[int, ...]] = {}  # contiguous strides by shape (shapes repeat every step)


def contiguous_strides(size: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``size`` (a zero-size dim counts as 1)."""
    strides = [1] * len(size)
    for i in range(len(size) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(size[i + 1], 1)
    return tuple(strides)


def all_ranks_true(flag: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``flag`` holds on every rank of ``group`` (one small all-reduce)."""
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=ReduceOp.MIN, group=group)
    return bool(value.item())


def raise_everywhere(
    problem: str,
    group: dist.ProcessGroup | None,
    make: Callable[[str], BaseException],
    *,
    device: torch.device | None = None,
    combine: Callable[[list[str]], str] | None = None,
) -> None:
    """Raise ``make(text)`` on every rank of ``group`` when any rank has a ``problem`` (``""``: none).

    One ``all_gather_object`` of the messages; with ``device``, one all-reduce of a flag there first and
    the messages gathered only when some rank has one (for checks that run often). Nothing when no
    process group is initialized. ``text``: ``combine(every rank's problem)``; by default the problem
    when every rank that has one has the same, else each rank's, named (``rank 1: ... rank 2: ...``).
    """
    found = [problem]
    if dist.is_initialized():
        if device is not None:
            flag = torch.tensor([1 if problem else 0], dtype=torch.int64, device=device)
            dist.all_reduce(flag, group=group)
            if not int(flag.item()):
                return
        found = [""] * dist.get_world_size(group)
        dist.all_gather_object(found, problem, group=group)
    if not any(found):
        return
    raise make(combine(found) if combine is not None else _named(found))


def _named(found: list[str]) -> str:
    unique = list(dict.fromkeys(p for p in found if p))
    if len(unique) == 1:
        return unique[0]
    return " ".join(f"rank {r}: {p}" if len(found) > 1 else p for r, p in enumerate(found) if p)


def run_all_reduce_hook(
    hook: Callable[[torch.Tensor], None], output: torch.Tensor, stream: torch.Stream | None
) -> None:
    """``hook(output)``, on ``stream`` if given, ordered after the reduction and before what follows.

    On the CPU there is no stream to order: the hook runs in place, as torch runs it there.
    """
    if stream is None or output.device.type == "cpu":
        hook(output)
        return
    reducing = torch.accelerator.current_stream(output.device)
    stream.wait_stream(reducing)
    with stream:
        hook(output)
    reducing.wait_stream(stream)
