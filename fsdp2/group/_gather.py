"""A group's all-gather: its input buffer, its inputs, its one pending collective, and the wait.

Owns: ``PackedShards`` (the group's local shards packed into one buffer: the all-gather input, see
[Note: Packed shards]; not the shards' contents or their sharded DTensors, each ``FSDPParam``'s) and
``AllGatherer``: what this rank contributes (the packed shards, or each parameter's input,
extension inputs, byte views for groups of several dtypes), issuing the collective on the side
streams (``CommContext.all_gather_on_streams``, the protocol buckets use too) or in program order, and
the one result a group may have pending (its own all-gather or its part of a bucket).
Does not own: what the output becomes (``UnshardedBuffer``), whether to join a bucket (the group and
the root's plan), events and watchdog labels (the group).

[Note: Packed shards]
At ``fully_shard`` each parameter's padded local shard is built in its own slot of one zeroed buffer,
in parameter order, so the slots are exactly the all-gather input layout and an unshard reads the
buffer itself (no copy-in with the built-in all-gather, one copy for a cast, one host-to-device copy
under CPU offload, nothing to gather for a one-rank shard group). Groups with all-gather extensions, or
with shards of several dtypes or devices, keep one buffer per parameter. Conversions and loads that
install new local tensors (``to_empty``, ``.double()``, ``load_state_dict(assign=True)``, a deep copy)
are packed again at the next lazy init; the sharded parameters keep their Python identity
(``_dtensor.rebase_local``), so an optimizer built before keeps training them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..base import TrainingState
from ..comm import (
    AllGatherResult,
    CopyIn,
    all_gather_copy_in,
    all_ranks_true,
    comm_type,
    issue_all_gather,
    packed_all_gather_copy_in,
    serves_on_streams,
    wait_all_gather,
)
from ..param import has_extension, padded_rule_error, warn_if_repeated_shards
from ..trace import GpuTiming

if TYPE_CHECKING:
    from ..base import MeshInfo, ParamSpec
    from ..comm import CommContext
    from ..param import FSDPParam

__all__ = ["AllGatherer", "PackedShards", "slots_of", "zeroed_shards"]

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
    - ``_staged``: resolved at lazy init: parameters whose unshard finishes after copy-out
      (``Shard(d > 0)``, extensions).
    - ``_check_first``: the next all-gather is the first after materialising from meta: its rank blocks
      are checked once (``param/_init.py``).
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
        self._staged: list[FSDPParam] = []
        self._check_first = False

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
        self._staged = [p for p in params if p.layout.shard_dim != 0 or p.has_extension]
        self._check_first = any(p.from_meta and not p.has_extension for p in params)

    def finish(self, world_size: int) -> None:
        """After copy-out: check the first gather after a meta init, finish the staged unshards."""
        if self._check_first:
            self._check_first = False
            warn_if_repeated_shards(self._params, world_size)
        for fsdp_param in self._staged:
            fsdp_param.finish_unshard()

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
        numel = sum(p.layout.padded_shard_numel for p in self._params) * self._mesh_info.shard_size
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
        if not self._rule_agreed and any(p.layout.unevenly_sharded for p in extended):
            info = self._mesh_info
            everyone_ok = info.shard_size == 1 or all_ranks_true(not bad, info.shard_group, self._device)
            if not everyone_ok:
                raise padded_rule_error(bad or [p.fqn for p in extended if p.layout.unevenly_sharded])
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
        if ctx is None or not ctx.use_streams or not serves_on_streams(async_op, serves_use):
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


# ---- the input buffer ----------------------------------------------------------------------------


class PackedShards:
    """The local shards of one group as slots of one 1-D buffer.

    Fields:
    - ``flat``: 1-D, ``sum(splits)`` elements, the shards' dtype, on the shards' device (the CPU,
      pinned where possible, under CPU offload; meta until materialised); ``None`` where the group
      cannot pack. Zero in every padding element.
    - ``splits``: each parameter's padded shard numel, in parameter order (fixed at ``fully_shard``).
    - ``views``: each parameter's 1-D slot of ``flat``: its local shard while packing is intact.
    - ``usable``: resolved at lazy init: the next all-gather reads ``flat`` directly.
    """

    def __init__(self, splits: list[int], flat: torch.Tensor | None, offload: bool, pin: bool) -> None:
        self.splits = splits
        self.flat = flat
        self.views: tuple[torch.Tensor, ...] = slots_of(flat, splits) if flat is not None else ()
        self.usable = False
        self._offload = offload
        self._pin = pin

    @staticmethod
    def can_pack(specs: Sequence[ParamSpec], locals_: Sequence[torch.Tensor]) -> bool:
        """Whether these shards can share one buffer: no extensions, one dtype, one device."""
        if not locals_ or any(has_extension(t, s.owners[0][1]) for t, s in zip(locals_, specs, strict=True)):
            return False
        return len({t.dtype for t in locals_}) == 1 and len({t.device for t in locals_}) == 1

    def slots(self, count: int) -> Sequence[torch.Tensor | None]:
        """The slot of each of ``count`` parameters, or ``None`` each where the group does not pack."""
        return self.views if self.flat is not None else (None,) * count

    def intact(self, params: Sequence[FSDPParam]) -> bool:
        """Every parameter's local shard is still its slot of the buffer."""
        views = self.views
        return bool(views) and all(p.holds_shard(v) for p, v in zip(params, views, strict=True))

    def repack(self, params: Sequence[FSDPParam]) -> None:
        """Unless packing is intact: move the local shards into a fresh buffer, one padded slot each.

        Only where the group allows it: not for extensions (their inputs come from a hook), shards of
        several dtypes or devices, or a sharded parameter that is part of an autograd graph now: those
        keep per-parameter shards.
        """
        if self.intact(params) or not params or any(p.has_extension for p in params):
            return
        if len({p.shard_dtype for p in params}) != 1 or len({p.shard_device for p in params}) != 1:
            return
        if not all(p.can_move_shard() for p in params):
            return
        dtype, device = params[0].shard_dtype, params[0].shard_device
        flat = zeroed_shards(sum(self.splits), dtype, device, self._offload, self._pin)
        views = slots_of(flat, self.splits)
        for fsdp_param, view in zip(params, views, strict=True):
            fsdp_param.move_shard_into(view)
        self.flat, self.views = flat, views

    def gather_input(self, device: torch.device) -> torch.Tensor | None:
        """The packed shards as this rank's all-gather input on ``device``, if usable."""
        flat = self.flat
        if not self.usable or flat is None:
            return None
        if self._offload and device.type != "cpu":
            return flat.to(device, non_blocking=flat.is_pinned())
        return flat


def zeroed_shards(
    numel: int, dtype: torch.dtype, device: torch.device, offload: bool, pin: bool
) -> torch.Tensor:
    """A zeroed 1-D buffer for packed shards: on the CPU (pinned where ``pin``) under offload."""
    if offload and device.type != "meta":
        return torch.zeros(numel, dtype=dtype, device="cpu", pin_memory=pin)
    return torch.zeros(numel, dtype=dtype, device=device)


def slots_of(
    flat: torch.Tensor, sizes: Sequence[int], strides: Sequence[int] | None = None
) -> tuple[torch.Tensor, ...]:
    """1-D views of ``flat`` of ``sizes`` elements, each starting ``strides[i]`` after the previous.

    Plain ``narrow`` views, not ``split``'s: autograd and torch.compile treat views made by one
    multi-output op specially (no in-place updates through them, no view replay when fakified).
    """
    views = []
    offset = 0
    for size, stride in zip(sizes, sizes if strides is None else strides, strict=True):
        views.append(flat.narrow(0, offset, size))
        offset += stride
    return tuple(views)
