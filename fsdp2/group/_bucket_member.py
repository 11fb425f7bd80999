"""What a group offers its schedule for sharing one collective with other groups (bucketing).

Owns: ``BucketMember``, the half of ``FSDPParamGroup`` the schedule talks to (the ``GroupLike``
protocol in ``_schedule.py``): a group's bucket keys (what groups sharing an all-gather or a
reduce-scatter must agree on), the size the caps count, whether it joins a bucketed all-gather now,
its all-gather inputs and its part of the shared result, and its gradients packed for the
reduce-scatter queue. Everything here reads the group's own parts; none of it calls a sibling.
Does not own: the bucket plan and the queue (``Schedule``, ``_bucket.py``), the group's own
all-gather and reduction (``FSDPParamGroup`` and its parts).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from ..base._config import GroupControls
from ..base._lifecycle import ShardedState, TrainingState
from ..base._mesh import MeshInfo
from ..comm._collectives import AllGatherResult
from ..comm._comm_context import CommContext
from ..comm._comms import GroupComms
from ..param._param import FSDPParam
from ..trace import _events
from ..trace._events import EventScope
from ._gather import AllGatherer
from ._reduce import GradientReducer, bucket_key


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


class BucketMember:
    """A group's side of bucketing, mixed into ``FSDPParamGroup``; reads only the group's own parts."""

    # Set by FSDPParamGroup.__init__ / lazy_init:
    gatherer: AllGatherer
    reducer: GradientReducer
    controls: GroupControls
    comms: GroupComms
    device: torch.device
    module_fqn: str
    training_state: TrainingState
    sharded_state: ShardedState
    lazy_initialized: bool
    tensor_parallel: bool  # fixed at construction

    @property
    def post_forward_mesh_info(self) -> MeshInfo | None: ...

    comm_ctx: CommContext | None  # the root's streams, set at its lazy init (``attach``)
    event_scope: EventScope | None

    # ---- what the schedule asks ------------------------------------------------------------------

    def all_gather_bucket_key(self) -> Hashable | None:
        """What groups sharing one all-gather must agree on; ``None``: this group gathers alone."""
        if not self.lazy_initialized:
            return None
        return self.gatherer.bucket_key(self.comms, self.tensor_parallel, self.post_forward_mesh_info)

    def all_gather_bytes(self) -> int:
        """Bytes of this group's all-gather output (what the all-gather cap counts)."""
        return self.gatherer.output_bytes()

    def joins_bucket(self, state: TrainingState, key: Hashable) -> bool:
        """Whether this group joins a bucketed all-gather for ``state`` now (it needs one, same key)."""
        return (
            self.gatherer.result is None
            and self.sharded_state is ShardedState.SHARDED
            and (state is TrainingState.FORWARD or self.controls.unshard_in_backward)
            and self.all_gather_bucket_key() == key
        )

    def bucket_inputs(self, state: TrainingState) -> list[torch.Tensor]:
        """This group's all-gather inputs for a bucket issued for ``state`` (records its unshard)."""
        _events.record("unshard", self.module_fqn, state, self.event_scope)
        self.gatherer.span = (_events.span_start(self.event_scope), state)
        return self.gatherer.inputs(False)

    def set_bucket_result(self, result: AllGatherResult) -> None:
        """This group's part of a bucketed all-gather, copied out by ``wait_for_unshard``."""
        self.gatherer.result = result

    def reduce_scatter_bucket_key(
        self, params: list[FSDPParam], grads: list[torch.Tensor]
    ) -> Hashable | None:
        """What groups sharing one reduce-scatter must agree on; ``None``: this group reduces alone."""
        return bucket_key(
            self.reducer, params, grads, self.controls, self.comms, self.tensor_parallel, self.device
        )

    def pack_gradients(self, params: list[FSDPParam], grads: list[torch.Tensor]) -> PendingReduceScatter:
        """Pack the gradients into one reduce-scatter input for a shared collective (empties ``grads``)."""
        controls, comms, scope = self.controls, self.comms, self.event_scope
        start = _events.span_start(scope)
        # One reduce dtype (the key says so): exactly one packed buffer. Empties grads.
        ((dtype, reduced, buffer),) = self.reducer.pack(
            params, grads, self.comm_ctx, controls, comms.reduce_scatter
        )
        return PendingReduceScatter(
            self.reducer,
            dtype,
            params,
            reduced,
            buffer,
            controls,
            comms,
            self.module_fqn,
            self.training_state,
            scope,
            start,
        )
