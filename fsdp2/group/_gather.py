"""A group's all-gather: its inputs, its one pending collective, and the wait.

Owns: ``AllGatherer``: what this rank contributes (the packed shards, or each parameter's input,
extension inputs, byte views for groups of several dtypes), issuing the collective on the side
streams (``CommContext.all_gather_on_streams``, the protocol buckets use too) or in program order, and
the one result a group may have pending (its own all-gather or its part of a bucket).
Does not own: what the output becomes (``UnshardedBuffer``), whether to join a bucket (the group and
the root's plan), events and watchdog labels (the group).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..base._lifecycle import TrainingState
from ..comm._collectives import (
    AllGatherResult,
    CopyIn,
    all_gather_copy_in,
    all_ranks_true,
    issue_all_gather,
    packed_all_gather_copy_in,
    wait_all_gather,
)
from ..comm._comm_context import gathers_on_streams
from ..comm._comms import comm_type
from ..param._extension import padded_rule_error
from ..trace._events import GpuTiming

if TYPE_CHECKING:
    from ..base._mesh import MeshInfo
    from ..comm._comm_context import CommContext
    from ..param._param import FSDPParam
    from ._packed import PackedShards

__all__ = ["AllGatherer"]

_FORWARD = TrainingState.FORWARD
_PRE_BACKWARD = TrainingState.PRE_BACKWARD


class AllGatherer:
    """The all-gather of one group.

    Fields:
    - ``result``: the pending all-gather (1-D output ``W * sum(splits)`` in ``dtype``, on the compute
      device; CUDA: allocated on the copy-in stream) or ``None``; at most one per group.
    - ``dtype``: the collective's dtype, the parameters' unsharded dtype, or ``uint8`` when
      ``as_bytes`` (parameters of several unsharded dtypes gather their bytes). Resolved at lazy
      init; for extensions, by what their pre-all-gather hooks return at each unshard.
    - ``extension``: some parameter gathers through ``fsdp_pre_all_gather``.
    - ``span``: (issue time, phase) of the pending all-gather, for the timeline.
    - ``gpu``: CUDA side streams, while recording: the timing events of the last all-gather issued
      or waited (``_events.GpuTiming``: the collective on its stream, the compute stream's wait).
    - ``post_forward_event``: CUDA: recorded after the slices kept for an int
      ``reshard_after_forward`` were written; the next copy-in waits on it.
    """

    def __init__(self, params: Sequence[FSDPParam], mesh_info: MeshInfo, device: torch.device) -> None:
        self.result: AllGatherResult | None = None
        self.dtype = params[0].orig_dtype
        self._params = params
        self.as_bytes = False
        self.extension = False
        self.span: tuple[float | None, TrainingState] = (None, TrainingState.IDLE)
        self.gpu: GpuTiming | None = None
        self.post_forward_event: torch.Event | None = None
        self._mesh_info = mesh_info
        self._device = device
        self._rule_agreed = False  # all ranks checked the extension's padded-size rule once

    def resolve(self, post_forward_info: MeshInfo | None) -> None:
        """Lazy init: the gathered dtype, and whether any parameter uses an extension (and may)."""
        params = self._params
        for fsdp_param in params:
            if not fsdp_param.has_extension:
                continue
            if post_forward_info is not None and post_forward_info is not self._mesh_info:
                raise NotImplementedError(
                    f"Parameter {fsdp_param.fqn} uses fsdp_pre_all_gather, which fsdp2 does not combine "
                    "with an int reshard_after_forward; use True or False for this module."
                )
            if fsdp_param.is_tensor_parallel:
                raise NotImplementedError(
                    f"Parameter {fsdp_param.fqn}: fsdp_pre_all_gather on a tensor-parallel parameter is "
                    "not supported by fsdp2 yet."
                )
        dtypes = {p.unsharded_dtype for p in params}
        # One all-gather needs one buffer dtype: with several, gather the parameters' bytes.
        self.as_bytes = len(dtypes) > 1
        self.dtype = torch.uint8 if self.as_bytes else dtypes.pop()
        self.extension = any(p.has_extension for p in params)

    def bucket_key(
        self, comms: Any, tensor_parallel: bool, post_forward_info: MeshInfo | None
    ) -> Hashable | None:
        """What groups sharing one all-gather must agree on; ``None``: this group gathers alone.

        Alone: a single-rank shard group, all-gather extensions, several gathered dtypes (byte
        gathers), tensor-parallel parameters, custom collectives, or an int ``reshard_after_forward``.
        """
        info = self._mesh_info
        if (
            info.shard_size == 1
            or self.extension
            or self.as_bytes
            or comms.custom
            or (post_forward_info is not None and post_forward_info is not info)
            or tensor_parallel
        ):
            return None
        # The built-in collectives a setter installs are bound to the shard group: their type suffices.
        return (id(info.shard_group), self.dtype, self._device, comm_type(comms.all_gather))

    def output_bytes(self) -> int:
        """Bytes of the all-gather output (what the all-gather bucket cap counts)."""
        numel = sum(p.padded_shard_numel for p in self._params) * self._mesh_info.shard_size
        return numel * self.dtype.itemsize

    # ---- inputs ----------------------------------------------------------------------------------

    def inputs(self, post_forward: bool) -> list[torch.Tensor]:
        """Each parameter's 1-D contribution, cast (or viewed as bytes) for one collective."""
        params = self._params
        if self.extension:
            return self._extension_inputs(params, post_forward)
        inputs = [p.all_gather_input(post_forward) for p in params]
        if self.as_bytes:
            inputs = [_as_bytes(t, p.unsharded_dtype) for t, p in zip(inputs, params, strict=True)]
        return inputs

    def _extension_inputs(self, params: Sequence[FSDPParam], post_forward: bool) -> list[torch.Tensor]:
        """Inputs of a group with extension parameters; the collective dtype follows what they return."""
        inputs: list[torch.Tensor] = []
        dtypes: list[torch.dtype] = []
        for fsdp_param in params:
            tensors = fsdp_param.all_gather_inputs(post_forward)
            inputs.extend(tensors)
            if fsdp_param.has_extension:
                dtypes.extend(t.dtype for t in tensors)
            else:
                dtypes.extend(fsdp_param.unsharded_dtype for _ in tensors)
        self._check_padded_rule(params)
        kinds = set(dtypes)
        self.as_bytes = len(kinds) > 1
        self.dtype = torch.uint8 if self.as_bytes else kinds.pop()
        if self.as_bytes:
            inputs = [_as_bytes(t, d) for t, d in zip(inputs, dtypes, strict=True)]
        return inputs

    def _check_padded_rule(self, params: Sequence[FSDPParam]) -> None:
        """Every rank raises together if any pre hook broke the padded-size rule (no hang)."""
        extended = [p for p in params if p.has_extension]
        bad = [p.fqn for p in extended if not p.extension_rule_ok]
        if not self._rule_agreed and any(p.unevenly_sharded for p in extended):
            info = self._mesh_info
            everyone_ok = info.shard_size == 1 or all_ranks_true(not bad, info.shard_group, self._device)
            if not everyone_ok:
                raise padded_rule_error(bad or [p.fqn for p in extended if p.unevenly_sharded])
            self._rule_agreed = True
        elif bad:
            raise padded_rule_error(bad)

    # ---- the collective --------------------------------------------------------------------------

    def issue(
        self,
        packed: PackedShards,
        info: MeshInfo,
        all_gather: object,
        ctx: CommContext | None,
        async_op: bool,
        state: TrainingState,
    ) -> None:
        """Copy in and issue the all-gather over ``info``'s shard group; the result stays pending.

        ``info``: the group's mesh, or its post-forward mesh (gathering the post-forward slices);
        ``packed`` is read directly where usable. On the side streams of ``ctx`` (CUDA) for a forward
        or backward use that waits for it, else in program order; ``all_gather`` is the group's
        collective (not used for one rank: nothing is communicated).
        """
        post_forward = info is not self._mesh_info
        comm = all_gather if info.shard_size > 1 else None
        serves_use = state is _FORWARD or state is _PRE_BACKWARD
        if ctx is None or not gathers_on_streams(ctx, async_op, serves_use):
            output, local, splits = self._copy_in(packed, post_forward, info, comm)  # no closures
            work = issue_all_gather(output, local, info.shard_group, info.shard_size, async_op, comm)
            self.result = AllGatherResult(output, splits, info.shard_size, None, work)
            return
        after = None
        if post_forward:  # the post-forward slices were cloned on the current stream
            after, self.post_forward_event = self.post_forward_event, None

        def copy_in() -> CopyIn:
            return self._copy_in(packed, post_forward, info, comm)

        timing = self.gpu = _timing() if self.span[0] is not None else None  # recording

        def issue(staged: CopyIn) -> None:
            if timing is not None and timing.began is not None:
                timing.began.record()  # on the all-gather stream
            issue_all_gather(staged[0], staged[1], info.shard_group, info.shard_size, False, comm)
            if timing is not None and timing.ended is not None:
                timing.ended.record()

        (output, local, splits), event = ctx.all_gather_on_streams(copy_in, issue, after)
        self.result = AllGatherResult(output, splits, info.shard_size, event, None, input=local)

    def _copy_in(self, packed: PackedShards, post_forward: bool, info: MeshInfo, comm: object) -> CopyIn:
        """The output and this rank's input of the next all-gather (from the packed shards if usable)."""
        flat = None if post_forward else packed.gather_input(self._device)
        if flat is not None:
            world, rank = info.shard_size, info.shard_rank
            output, local = packed_all_gather_copy_in(flat, world, rank, self.dtype, comm)
            return output, local, packed.splits
        inputs = self.inputs(post_forward)
        return all_gather_copy_in(inputs, info.shard_size, info.shard_rank, self.dtype, comm)

    def wait(self) -> AllGatherResult | None:
        """Wait for the pending all-gather (CPU: its work; CUDA: its event) and hand it over."""
        result = self.result
        if result is None:
            self.gpu = None
            return None
        if result.event is not None and self.span[0] is not None:  # CUDA side streams, recorded
            # Timing from this group's own issue, not yet waited; a bucket's all-gather (issued by the
            # schedule) has none: only its wait is timed.
            timing = self.gpu if self.gpu is not None and self.gpu.before is None else GpuTiming(None, None)
            stream = torch.cuda.current_stream(result.output.device)
            timing.before = torch.cuda.Event(enable_timing=True)
            timing.before.record(stream)
            wait_all_gather(result)
            timing.after = torch.cuda.Event(enable_timing=True)
            timing.after.record(stream)
            self.gpu = timing
        else:
            wait_all_gather(result)
            self.gpu = None
        self.result = None
        return result


def _timing() -> GpuTiming:
    return GpuTiming(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))


def _as_bytes(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype``, viewed as bytes (for a group that gathers several dtypes at once)."""
    return (tensor if tensor.dtype == dtype else tensor.to(dtype)).view(torch.uint8)
