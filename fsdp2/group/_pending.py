"""What a group offers a shared reduce-scatter: its key and its gradients packed (``PendingReduceScatter``).

Owns: ``PendingReduceScatter`` (one group's packed gradients, waiting in the schedule's queue),
``reduce_scatter_key`` (what groups sharing one reduce-scatter must agree on) and ``pack_gradients``,
both read from the group's parts. Does not own: the queue, its cap and the shared collective
(``runtime/_bucket.py``), or the packing itself (``GradientReducer.pack``).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from ..base import GroupControls, TrainingState
from ..comm import GroupComms
from ..param import FSDPParam
from ..trace import EventScope, span_start
from ._param_group import FSDPParamGroup
from ._reduce import GradientReducer, bucket_key

__all__ = ["PendingReduceScatter", "pack_gradients", "reduce_scatter_key"]


@dataclass
class PendingReduceScatter:
    """One group's packed gradients waiting for a shared reduce-scatter."""

    reducer: GradientReducer
    dtype: torch.dtype  # the reduce dtype (the buffer's, unless packed in a wire dtype)
    params: list[FSDPParam]  # every parameter given to the reduction (zero-element ones included)
    reduced_params: list[FSDPParam]  # the parameters packed into ``buffer``, in order
    buffer: torch.Tensor  # 1-D, W * s: the group's (W, s) reduce-scatter input
    controls: GroupControls
    comms: GroupComms
    module_fqn: str
    state: TrainingState
    scope: EventScope | None
    start: float | None  # span start (timeline), when recorded


def reduce_scatter_key(
    group: FSDPParamGroup, params: list[FSDPParam], grads: list[torch.Tensor]
) -> Hashable | None:
    """What groups sharing one reduce-scatter must agree on; ``None``: ``group`` reduces alone."""
    return bucket_key(
        group.reducer, params, grads, group.controls, group.comms, group.tensor_parallel, group.device
    )


def pack_gradients(
    group: FSDPParamGroup, params: list[FSDPParam], grads: list[torch.Tensor]
) -> PendingReduceScatter:
    """Pack ``group``'s gradients into one input for a shared reduce-scatter (empties ``grads``)."""
    controls, comms, scope = group.controls, group.comms, group.event_scope
    start = span_start(scope)
    # One reduce dtype (the key says so): exactly one packed buffer. Empties grads.
    ((dtype, reduced, buffer),) = group.reducer.pack(
        params, grads, group.comm_ctx, controls, comms.reduce_scatter
    )
    return PendingReduceScatter(
        group.reducer,
        dtype,
        params,
        reduced,
        buffer,
        controls,
        comms,
        group.module_fqn,
        group.training_state,
        scope,
        start,
    )
