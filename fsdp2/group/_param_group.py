"""A communication group: the parameters of one ``fully_shard`` call.

Owns: the group's ``TrainingState`` and ``ShardedState`` and the sequence of one step over its own
parameters: unshard (issue its own all-gather), wait_for_unshard (copy out, register), reshard,
pre/post forward and backward (the post-backward takes the gradients), its own reduction, and the
reduction of gradients no-sync backwards kept (``reduce_held_grads``). Its parts, declared at class
level: ``PackedShards`` (the all-gather input) and ``AllGatherer`` (the pending all-gather), both in
``_gather.py``, ``UnshardedBuffer`` (the output and registrations, ``_unshard_buffer.py``),
``GradientReducer`` (``_reduce.py``) and, once a root adopts it, ``UseTracker`` (``_skip.py``). What
it works with under its root (the streams, the event scope) is handed over by ``attach``.
Does not own: hooks and prefetch targets (``FSDPState``), the iteration's begin and end
(``RootContext``), the execution orders, bucket plan and reduce-scatter queue (``Schedule``, the one
caller of a step's gathers and reductions). A group never calls its schedule, root or siblings.
Invariants: the group's ``ShardedState`` equals every member parameter's; at most one all-gather is
pending (``gatherer.result``, possibly this group's part of a bucket); an unshard is a no-op while
one is pending or when unsharded; every training-state change goes through ``_lifecycle.transition``.
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..base import (
    ALLOWED,
    CPUOffloadPolicy,
    GroupConfig,
    GroupControls,
    MeshInfo,
    ParamSpec,
    ShardedState,
    TrainingState,
    in_backward_task_id,
    outside_functorch,
    stepped_before_backward,
    transition,
)
from ..comm import GroupComms
from ..param import (
    FSDPParam,
    can_pin,
    check_materialized,
    local_of,
    padded_shard_numel,
)
from ..trace import DEBUG, NOT_WATCHED, RECORDING, record, span_end, span_start, wait_end, watch_collective
from ._gather import AllGatherer, PackedShards, zeroed_shards
from ._reduce import GradientReducer
from ._skip import Skip, UseTracker
from ._unshard_buffer import UnshardedBuffer

if TYPE_CHECKING:
    from ..comm import CommContext
    from ..trace import EventScope

_IDLE = TrainingState.IDLE
_FORWARD = TrainingState.FORWARD
_PRE_BACKWARD = TrainingState.PRE_BACKWARD
_POST_BACKWARD = TrainingState.POST_BACKWARD
_UNSHARDED = ShardedState.UNSHARDED
_SHARDED = ShardedState.SHARDED


class FSDPParamGroup:
    """The parameters of one ``fully_shard`` call, gathered and reduced together.

    What a bucket reads of it (keys, inputs, packed gradients) is read from its parts by ``runtime``'s
    ``_bucket.py``; callers call the part that does the work.
    """

    # Its parameters and parts (see the module docstring); the layouts are each part's own.
    fsdp_params: list[FSDPParam]
    packed: PackedShards  # the all-gather input: the local shards in one buffer
    gatherer: AllGatherer  # the pending all-gather
    buffer: UnshardedBuffer  # the all-gather output and what it registers
    reducer: GradientReducer  # the reduction and the sharded gradients
    use_tracker: UseTracker | None  # which submodules ran, once a root's usage agreement took it in
    comms: GroupComms  # its collectives
    controls: GroupControls  # the run-time controls its module's setters write

    def __init__(
        self,
        params: list[FSDPParam],
        packed: PackedShards,
        modules: tuple[nn.Module, ...],
        config: GroupConfig,
        post_forward_mesh_info: MeshInfo | None,
    ) -> None:
        """A group of ``params`` (``build_group`` makes them from ``fully_shard``'s specs)."""
        self.modules = modules
        self.config = config
        self.mesh_info = config.mesh_info
        self.device = config.device  # the compute / communication device
        self.packed = packed  # see [Note: Packed shards]
        self.fsdp_params = params
        self.tensor_parallel = any(p.is_tensor_parallel for p in params)  # fixed at construction
        self.gatherer = AllGatherer(params, config.mesh_info, config.device)
        self.buffer = UnshardedBuffer()  # see [Note: One unsharded buffer per group]
        self.post_forward_mesh_info = post_forward_mesh_info
        self.controls = GroupControls()
        self.comms = GroupComms()
        self.reducer = GradientReducer(config.mesh_info)
        # What the group works with under its root, handed over by the root's lazy init (``attach``);
        # None before it: no side streams (work runs in program order), no events.
        self.comm_ctx: CommContext | None = None
        self.event_scope: EventScope | None = None
        self.module_fqn = ""
        self.training_state = _IDLE
        self.sharded_state = ShardedState.SHARDED
        self.lazy_initialized = False
        # Read (and the last two set) by the optimizer-step guard, see ``_step_guard``:
        self.unreduced_grads = False  # a no-sync backward left gradients waiting for a synced one
        self.partial_grads: str | None = None  # why the gradients are partial (fsdp2.accumulate raised)
        self.awaiting_backward = False  # a forward with gradients ran, its backward has not
        self.stepped_after_forward = False  # an optimizer stepped these parameters in between
        # Which submodules ran forward since the last reduction: made by the first root's usage
        # agreement that takes the group in (runtime/_agreement.py), then kept with its hooks.
        self.use_tracker: UseTracker | None = None

    def __str__(self) -> str:
        return f"group {self.module_fqn or '<root>'}"

    def set_state(self, new: TrainingState) -> None:
        if new not in ALLOWED[self.training_state]:
            transition(self.training_state, new, self)  # raises
        self.training_state = new

    def _watch(self, kind: str, state: TrainingState) -> AbstractContextManager[None]:
        """The debug watchdog's context for one of this group's collectives (a no-op while off)."""
        return watch_collective(kind, self.module_fqn, state) if DEBUG.enabled else NOT_WATCHED

    def attach(self, comm_ctx: CommContext, event_scope: EventScope) -> None:
        """Work with the root's streams and event scope from now on (its lazy init, after validation)."""
        self.comm_ctx, self.event_scope = comm_ctx, event_scope

    # ---- configuration ---------------------------------------------------------------------------

    def set_post_forward_mesh(self, info: MeshInfo | None) -> None:
        """Reshard after forward to ``info`` (``None``: keep the parameters; see ``reshard``)."""
        self.post_forward_mesh_info = info
        self.buffer.forget_slots()
        for fsdp_param in self.fsdp_params:
            fsdp_param.post_forward_mesh_info = info

    @outside_functorch
    def lazy_init(self) -> None:
        """Validate parameters and resolve per-step facts once (idempotent; re-run by ``unshard()``)."""
        if not self.lazy_initialized and self.sharded_state is _SHARDED:
            # Catch load_state_dict / to_empty done after fully_shard but before training.
            for fsdp_param in self.fsdp_params:
                fsdp_param.reset_sharded_param()
        check_materialized(self.fsdp_params)
        policy = self.config.mp_policy
        for fsdp_param in self.fsdp_params:
            fsdp_param.init_dtypes(policy.param_dtype, policy.reduce_dtype)
            fsdp_param.init_extension(policy)
        gatherer, params, sharded = self.gatherer, self.fsdp_params, self.sharded_state is _SHARDED
        gatherer.resolve(self.post_forward_mesh_info)  # also: staged parameters, the first gather's check
        if sharded:
            self.packed.repack(params)  # if shards were replaced since fully_shard (e.g. a deep copy's)
        self.packed.usable = not gatherer.extension and not gatherer.as_bytes and self.packed.intact(params)
        self.buffer.resolve(params, _shares_buffer(params, gatherer.as_bytes), gatherer.dtype, sharded)
        self.reducer.resolve(params, policy.wire_dtype)
        self.lazy_initialized = True

    def readopt_sharded_params(self) -> None:
        """Re-adopt the registered sharded parameters; the next unshard re-runs lazy init.

        After a conversion (``model.to``, ``to_empty``, ``.double()``) or ``load_state_dict(assign=True)``.
        """
        for fsdp_param in self.fsdp_params:
            fsdp_param.reset_sharded_param()
        self.packed.repack(self.fsdp_params)
        self.buffer.forget_slots()
        self.lazy_initialized = False

    # ---- unshard / reshard -----------------------------------------------------------------------

    def needs_gather(self) -> bool:
        """Whether an unshard would issue an all-gather (none pending, not unsharded, no kept copy).

        A kept copy's versions are read only where one is held (see [Note: A kept copy]).
        """
        if self.gatherer.result is not None or self.sharded_state is _UNSHARDED:
            return False
        return self.buffer.held is None or not self.buffer.current(self.fsdp_params)

    def ready_to_gather(self) -> None:
        """Lazy-init again if the parameters were re-adopted since the last step (idempotent)."""
        if not self.lazy_initialized:
            self.lazy_init()  # see readopt_sharded_params
            ctx = self.comm_ctx
            if ctx is not None:
                # Lazy init may have (re)packed the shards on the current stream: the copy-in and
                # all-gather streams read them, so they wait for those writes.
                ctx.wait_for_current_stream()

    @outside_functorch
    def unshard(self, async_op: bool = False, as_state: TrainingState | None = None) -> None:
        """Issue this group's own all-gather, unless one is pending or the group is already unsharded.

        ``as_state`` is the phase the all-gather serves (a prefetch issues it for the next forward or
        backward use); it picks the streams and labels the event. Default: the group's own state.
        Whether it gathers with other groups instead is the schedule's call (``Schedule.unshard``).
        """
        if not self.needs_gather():
            return
        self.ready_to_gather()
        state = self.training_state if as_state is None else as_state
        post_forward = self.sharded_state is ShardedState.SHARDED_POST_FORWARD
        scope = self.event_scope
        start = None
        if RECORDING.on:
            start = span_start(scope)  # the thread blocks from here until the issue returns
            record("unshard", self.module_fqn, state, scope)
        self.gatherer.span = (start, state)
        info = self.post_forward_mesh_info if post_forward else self.mesh_info
        assert info is not None, "post-forward state without a post-forward mesh"
        with self._watch("all-gather", state):
            self.gatherer.issue(self.packed, info, self.comms.all_gather, self.comm_ctx, async_op, state)
        if start is not None:
            wait_end(start, "all-gather", self.module_fqn, state, scope)

    @outside_functorch
    def wait_for_unshard(self) -> None:
        """Finish the pending all-gather: copy out and register the unsharded parameters."""
        gatherer = self.gatherer
        if gatherer.result is None:
            if self.sharded_state is _SHARDED and self.buffer.current(self.fsdp_params):
                self._register_unsharded()  # the kept copy is current: no collective
                self.sharded_state = _UNSHARDED
            return
        waited = span_start(self.event_scope) if RECORDING.on else None  # blocked until copied out
        with self._watch("all-gather wait", self.training_state):
            result = gatherer.wait()
        assert result is not None, "an all-gather vanished while waiting for it"
        keep = self.controls.keep_gathered  # see [Note: A kept copy]
        self.buffer.fill(result, self.fsdp_params, gatherer.dtype, gatherer.as_bytes, keep)
        gatherer.finish(result.world_size)  # staged parameters; the first gather after a meta init
        self._register_unsharded()
        self.sharded_state = _UNSHARDED
        start, issued_in = gatherer.span
        if start is not None:
            gpu = gatherer.gpu  # CUDA, recorded: the collective's time on its stream, compute's stall
            span_end(start, "all-gather", self.module_fqn, issued_in, self.event_scope, waited, gpu)
        ctx = self.comm_ctx
        if ctx is not None and ctx.use_streams:
            ctx.defer_all_gather_buffers(
                result.output, result.input, self.device, self.training_state is _FORWARD
            )

    @outside_functorch
    def reshard(self) -> None:
        """Register sharded parameters again and free the unsharded ones.

        In forward this follows ``reshard_after_forward``: no-op for ``False``, the smaller
        post-forward shard for an int.
        """
        if self.training_state is _FORWARD:
            info = self.post_forward_mesh_info
            if info is None:
                return
            if info is not self.mesh_info:
                if self.sharded_state is _UNSHARDED:
                    for fsdp_param in self.fsdp_params:
                        fsdp_param.to_sharded_post_forward()
                    self.buffer.free()
                    self.sharded_state = ShardedState.SHARDED_POST_FORWARD
                    ctx = self.comm_ctx
                    if ctx is not None and ctx.use_streams:
                        event = torch.cuda.current_stream(self.device).record_event()
                        self.gatherer.post_forward_event = event
                    if RECORDING.on:
                        record("reshard", self.module_fqn, self.training_state, self.event_scope)
                return
        if self.sharded_state is not ShardedState.SHARDED:
            self.buffer.register_sharded(self.fsdp_params, self.sharded_state is _UNSHARDED)  # and frees
            self.sharded_state = ShardedState.SHARDED
            if RECORDING.on:
                record("reshard", self.module_fqn, self.training_state, self.event_scope)

    def release(self) -> None:
        """A full reshard that also frees a kept copy (``model.reshard()``, loads, conversions)."""
        self.reshard()
        self.buffer.release(self.fsdp_params)

    def _register_unsharded(self) -> None:
        """Register every parameter's unsharded form on its modules.

        Freezing or unfreezing a sharded parameter takes effect at the next forward; backward
        re-gathers for the graph that forward recorded. Batched registration is not used with an int
        ``reshard_after_forward`` (post-forward placeholders are registered too) or all-gather
        extensions (their unsharded parameters may be rebuilt).
        """
        info = self.post_forward_mesh_info
        batch = not self.gatherer.extension and (info is None or info is self.mesh_info)
        sync = self.training_state is not _PRE_BACKWARD
        self.buffer.register_unsharded(self.fsdp_params, sync, batch)

    # ---- forward ---------------------------------------------------------------------------------

    def pre_forward(self) -> None:
        """Enter ``FORWARD`` (the schedule then unshards the group for it: ``Schedule.use``)."""
        self.set_state(_FORWARD)
        self.stepped_after_forward = False
        if self.sharded_state is _UNSHARDED:
            # Still unsharded (reshard_after_forward=False): register the unsharded parameters again,
            # since a restore such as torch.func.functional_call's may have put the sharded ones back.
            self._register_unsharded()

    def post_forward(self) -> bool:
        """Reshard per policy and return to ``IDLE``; returns whether a backward may use this forward."""
        if in_backward_task_id() != -1:  # a forward re-run inside backward (checkpoint recompute)
            self.set_state(_IDLE)
            return False
        if torch.is_grad_enabled():
            self.reshard()  # in FORWARD: follows reshard_after_forward
            self.set_state(_IDLE)
            self.awaiting_backward = True
            return True
        self.set_state(_IDLE)
        if self.controls.reshard_after_no_grad_forward:
            # No backward can follow a no-grad forward: a full reshard (now IDLE), so model.parameters()
            # (an optimizer built now, a state dict) never sees unsharded tensors. Groups the user asked
            # to keep unsharded (reshard_after_forward=False) keep them: eval loops gather once.
            self.reshard()
        return False

    # ---- backward --------------------------------------------------------------------------------

    def pre_backward(self) -> bool:
        """Enter ``PRE_BACKWARD`` (the schedule then unshards); ``False`` if already in it (nothing done)."""
        if self.training_state is _PRE_BACKWARD:
            return False
        if self.stepped_after_forward:
            self.stepped_after_forward = False
            raise stepped_before_backward(self.module_fqn)
        self.set_state(_PRE_BACKWARD)
        return True

    def post_backward(self, skip: Skip | None = None) -> tuple[list[FSDPParam], list[torch.Tensor]] | None:
        """Reshard and take the gradients autograd left on the unsharded parameters.

        Returns ``(parameters, gradients)`` to reduce (the schedule reduces them: ``Schedule.reduce``),
        or ``None`` in a no-sync backward, which keeps them for a later one. ``skip``: the parameters
        no rank used, agreed by every rank (see ``_skip.py``).
        """
        self.set_state(_POST_BACKWARD)
        self.awaiting_backward = False
        controls = self.controls
        if not controls.reduce_grads:
            # No-sync step: gradients stay unsharded (in reduce_dtype where one is set) and keep
            # accumulating until a step with gradient sync reduces their sum.
            self.unreduced_grads = self.reducer.stash_grads(self.fsdp_params)
            if controls.reshard_after_backward:
                self.reshard()
            return None
        self.unreduced_grads = False
        taken = self.reducer.take_grads(self.fsdp_params, controls.reduce_scatter_unused_params, skip=skip)
        if controls.reshard_after_backward:
            self.reshard()
        return taken

    def reduce(self, params: list[FSDPParam], grads: list[torch.Tensor]) -> None:
        """Reduce-scatter this group's gradients with its own collective and assign the shards."""
        scope = self.event_scope
        start = span_start(scope) if RECORDING.on else None
        with self._watch("reduce-scatter", self.training_state):
            self.reducer.reduce(params, grads, self.comm_ctx, self.controls, self.comms)
        if start is not None:
            span_end(start, "reduce-scatter", self.module_fqn, self.training_state, scope, start)

    def reduce_held_grads(self) -> bool:
        """Reduce the gradients no-sync backwards kept, now (outside backward); whether there were any.

        Waits for the reduction before returning, as the end of a backward does.
        """
        if not self.unreduced_grads:
            return False
        reduced, grads = self.reducer.take_grads(self.fsdp_params, unused_too=False)
        self.unreduced_grads = False
        if grads:
            self.reduce(reduced, grads)
        self.reducer.finalize(self.device)
        return True

    def drop_unreduced_grads(self) -> None:
        """Discard the gradients left on the unsharded parameters (``zero_grad``, ``reset``)."""
        self.reducer.take_grads(self.fsdp_params, unused_too=False, reducing=False)  # and drop them
        self.unreduced_grads, self.partial_grads = False, None

    def finish_backward(self, last: bool) -> None:
        """End-of-backward callback, after the post-backward: back to ``IDLE``.

        On the ``last`` backward of a step, also drain a mis-targeted prefetch and wait for reductions.
        """
        self.set_state(_IDLE)
        if last:
            self.finalize_backward()

    def finalize_backward(self) -> None:
        """Drain a mis-targeted prefetch and wait for this group's reductions.

        Parameters left out of a reduction although some rank held a gradient for one (see
        ``_skip.py``) are reduced here, on every rank (the decision is read from reduced values).
        """
        self.gatherer.wait()
        late = self.reducer.finalize(self.device)
        if late:
            self.reduce(*self.reducer.take_grads(late, unused_too=True))
            self.reducer.finalize(self.device)

    def reset(self) -> None:
        """Forget in-flight work after an aborted iteration and return to ``SHARDED``/``IDLE``.

        Unlike torch's, this also drops the unsharded gradients of groups whose post-backward never
        ran, so they cannot leak into the next step's reduction.
        """
        self.finalize_backward()
        self.drop_unreduced_grads()
        self.awaiting_backward = self.stepped_after_forward = False
        self.reducer.reset(self.device)
        self.set_state(_IDLE)
        self.reshard()


def build_group(
    specs: list[ParamSpec],
    modules: tuple[nn.Module, ...],
    config: GroupConfig,
    post_forward_mesh_info: MeshInfo | None,
) -> FSDPParamGroup:
    """The group of one ``fully_shard`` call's parameters on one mesh, their shards packed."""
    packed = _packed_shards(specs, config)
    params = [
        FSDPParam(spec, config.mesh_info, post_forward_mesh_info, config.device, config.offload_policy, slot)
        for spec, slot in zip(specs, packed.slots(len(specs)), strict=True)
    ]
    return FSDPParamGroup(params, packed, modules, config, post_forward_mesh_info)


def split_group(group: FSDPParamGroup, params: list[FSDPParam]) -> FSDPParamGroup:
    """Move ``params`` (some of ``group``'s; sharded) into a new group over the same modules and mesh.

    The new group copies ``group``'s controls and collectives; both repack their shards at their next
    lazy init (the sharded parameters stay the same objects).
    """
    assert group.sharded_state is ShardedState.SHARDED, "split a group while sharded"
    if group.use_tracker is not None:
        group.use_tracker.close()  # the next root adoption tracks both groups anew
    # ``group`` leaves ``params`` to the new group and gathers the rest without them from now on.
    group.fsdp_params = rest = [p for p in group.fsdp_params if p not in params]
    group.packed = _unpacked(rest, group.config)  # repacked at the next lazy init
    group.gatherer = AllGatherer(rest, group.mesh_info, group.device)
    group.buffer, group.use_tracker = UnshardedBuffer(), None
    group.readopt_sharded_params()
    new = FSDPParamGroup(
        params, _unpacked(params, group.config), group.modules, group.config, group.post_forward_mesh_info
    )
    new.controls.update(**vars(group.controls))
    new.comms = dataclasses.replace(group.comms)
    new.module_fqn = group.module_fqn
    return new


def _unpacked(params: list[FSDPParam], config: GroupConfig) -> PackedShards:
    """A ``PackedShards`` for ``params`` without a buffer yet (``repack`` makes one at lazy init)."""
    sizes = [p.layout.padded_shard_numel for p in params]
    offload = isinstance(config.offload_policy, CPUOffloadPolicy)
    return PackedShards(sizes, None, offload, can_pin(config.offload_policy))


def _shares_buffer(params: list[FSDPParam], as_bytes: bool) -> bool:
    """Whether the group's parameters share one unsharded buffer (dim-0, no extension, one dtype)."""
    return not as_bytes and all(p.layout.shard_dim == 0 and not p.has_extension for p in params)


def _packed_shards(specs: list[ParamSpec], config: GroupConfig) -> PackedShards:
    """The group's packed-shard buffer (zeroed), or a ``PackedShards`` without one where it cannot pack."""
    locals_ = [_local_of_param(s.param) for s in specs]
    world = config.mesh_info.shard_size
    sizes = [padded_shard_numel(t.size(), s.shard_dim, world) for t, s in zip(locals_, specs, strict=True)]
    offload = isinstance(config.offload_policy, CPUOffloadPolicy)
    pin = can_pin(config.offload_policy)
    flat = None
    if PackedShards.can_pack(specs, locals_):
        flat = zeroed_shards(sum(sizes), locals_[0].dtype, locals_[0].device, offload, pin)
    return PackedShards(sizes, flat, offload, pin)


def _local_of_param(param: torch.Tensor) -> torch.Tensor:
    """The tensor FSDP shards: the tensor-parallel local tensor of a DTensor parameter."""
    return local_of(param) if isinstance(param, DTensor) else param
