"""The reduction across replicas when the optimizer is sharded across them: a reduce-scatter of slices.

Owns: ``reduce_across_replicas`` (a group's shard-reduced gradients laid out as one row per replica,
each row holding that replica's slice of every parameter, then one reduce-scatter over the replicate
group and the post-division; this rank's slice of each parameter in its output). Does not own: the
slice layout (``param._replica_slices``, see [Note: Replica slices] there), the usage row's reading
or the gradients' assignment (``GradientReducer``).

The input row of replica ``r`` holds, per parameter, the ``r``-th ``torch.chunk`` piece of its local
shard's rows, zero-padded to the first piece's rows, then the reduction's tail (the zeros and the
usage row, see [Note: Unused parameters] in ``_usage.py``) once per row, so every rank gets the tail
summed over all ranks. Replicas of one shard rank share its row counts, so their rows line up. Bytes
across the replicate dim: ``(R - 1) / R`` of the input here and ``(R - 1)`` slices in the parameters'
all-gather after the step, the ``2 (R - 1) / R`` of the shard that HSDP's all-reduce sends when ``R``
divides every shard's rows (plus ``(R - 2)`` tails when ``R > 2``).
"""

from __future__ import annotations

import torch

from ..base import GroupControls, MeshInfo
from ..comm import DivideFactors, GroupComms, reduce_scatter
from ..param import FSDPParam, RowLayout

__all__ = ["reduce_across_replicas"]


def _slice_widths(params: list[FSDPParam], replicas: int) -> list[tuple[int, int]]:
    """Per parameter: ``(rows of its largest slice, elements per row)``."""
    out = []
    for fsdp_param in params:
        rows = fsdp_param.layout.local_shard_size[0] if fsdp_param.layout.local_numel else 0
        out.append((RowLayout.chunked(rows, replicas).step, fsdp_param.layout.row_numel))
    return out


def reduce_across_replicas(
    output: torch.Tensor,
    params: list[FSDPParam],
    info: MeshInfo,
    tail: int,
    factors: DivideFactors,
    comms: GroupComms,
    controls: GroupControls,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Reduce-scatter ``output`` (this rank's shard-reduced gradients, 1-D) across the replicas.

    ``tail``: the elements after the gradients (zeros and the usage row). Returns this rank's row of
    the result (its slice of each parameter, padded as packed, then the tail), divided as
    ``factors`` say, and each parameter's slice in it.

    Raises:
        RuntimeError: the group has an all-reduce hook (set after the optimizer was sharded).
    """
    if controls.all_reduce_hook is not None:
        raise RuntimeError(
            "an all-reduce hook (set_all_reduce_hook) was set on a group whose optimizer is sharded "
            "across replicas (shard_optimizer_across_replicas): the hook reads whole reduced shards, "
            "and each rank holds only its slice. Remove the hook or keep this optimizer on plain HSDP."
        )
    replicas = info.replicate_size
    assert info.replicate_group is not None, "a reduction across replicas without replicas"
    widths = _slice_widths(params, replicas)
    row_width = sum(rows * numel for rows, numel in widths) + tail
    rows_in = output.new_zeros((replicas, row_width))
    offset = 0  # in output
    column = 0  # in each row
    for fsdp_param, (step, numel) in zip(params, widths, strict=True):
        layout = fsdp_param.layout
        local_rows = layout.local_shard_size[0] if layout.local_numel else 0
        shard = output.narrow(0, offset, local_rows * numel).view(local_rows, numel)
        full, rest = divmod(local_rows, step) if step else (0, 0)
        if full:  # replicas [0, full) hold `step` rows each: one strided copy for all of them
            rows_in[:full, column : column + step * numel].copy_(shard[: full * step].view(full, -1))
        if rest:  # the replica after them holds the rest; the ones after that hold none
            rows_in[full, column : column + rest * numel].copy_(shard[full * step :].reshape(-1))
        offset += layout.padded_shard_numel
        column += step * numel
    if tail:
        rows_in[:, column:].copy_(output.narrow(0, output.numel() - tail, tail).expand(replicas, tail))
    comm = None if comms.custom else comms.reduce_scatter  # the default one, or the recorder's
    reduced = reduce_scatter(rows_in.view(-1), info.replicate_group, replicas, factors.op, None, comm)
    if factors.postdivide is not None:
        reduced.div_(factors.postdivide)
    return reduced, _slice_views(reduced, params, info)


def _slice_views(reduced: torch.Tensor, params: list[FSDPParam], info: MeshInfo) -> list[torch.Tensor]:
    """This rank's slice of each parameter's gradient in ``reduced`` (``reduce_across_replicas``'s)."""
    replicas = info.replicate_size
    rank = info.mesh.get_local_rank(info.replicate_mesh_dim)
    views = []
    column = 0
    for fsdp_param, (step, numel) in zip(params, _slice_widths(params, replicas), strict=True):
        layout = fsdp_param.layout
        local_rows = layout.local_shard_size[0] if layout.local_numel else 0
        mine = RowLayout.chunked(local_rows, replicas).count(rank)
        view = reduced.narrow(0, column, mine * numel)
        views.append(view.view(mine, *layout.local_shard_size[1:]))
        column += step * numel
    return views
