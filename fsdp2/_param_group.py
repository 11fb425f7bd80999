"""A communication group: the parameters of one ``fully_shard`` call.

Owns: the group's ``TrainingState`` and ``ShardedState``; unshard (one all-gather), wait_for_unshard
(copy-out and register), reshard, pre/post forward and backward of its own parameters, and prefetch;
with bucketing, its bucket keys, issuing one all-gather for its bucket's members, and packing its
gradients into the root's reduce-scatter queue. Gradient reduction is delegated to its
``GradientReducer``. Does not own: hooks, root logic, the cross-group forward order, the bucket plan
or default backward prefetch (``FSDPState``).
Invariants: the group's ``ShardedState`` equals every member parameter's; at most one all-gather is
pending (``_all_gather_result``, possibly this group's part of a bucket); an unshard is a no-op while
one is pending or when unsharded; every training-state change goes through ``_lifecycle.transition``.

[Note: Packed shards]
At ``fully_shard`` the group allocates one zeroed buffer and each parameter's padded local shard is
built in its own slot of it, in parameter order (the sharded DTensors view their slots). The slots
are exactly the all-gather input layout, so the unshard reads the buffer itself: no copy-in at all
with the built-in all-gather, one copy for a cast, one host-to-device copy under CPU offload, and
nothing to gather for a one-rank shard group. Groups with all-gather extensions or with parameters
of several dtypes or devices keep one buffer per parameter. Conversions and loads that install new
local tensors (``to_empty``, ``.double()``, ``load_state_dict(assign=True)``, a deep copy) are
packed again; the sharded parameters keep their Python identity (``_dtensor.rebase_local``), so an
optimizer built before keeps training them. Packing is checked (``_packing_intact``) at lazy init.

[Note: One unsharded buffer per group]
For ``Shard(0)`` groups without extensions, every parameter's all-gather output (``W`` padded
shards, rank blocks in order) is a slot of one group buffer, so unsharding grows one storage and
resharding frees it; the copy-out views into it are built once. For one rank the gathered layout is
the buffer's own and copy-out is a single copy. Registering the unsharded and sharded parameters is
a list of dict writes resolved once (``_build_slots``) instead of a method call per parameter.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from . import _events
from ._api import CPUOffloadPolicy
from ._autograd import in_backward_task_id, outside_functorch
from ._bucket import Bucketing, PendingReduceScatter, all_gather_bucket
from ._collectives import (
    AllGatherResult,
    all_gather_copy_in,
    all_ranks_true,
    copy_out_2d,
    issue_all_gather,
    packed_all_gather_copy_in,
    wait_all_gather,
)
from ._comm_context import CommContext
from ._comms import GroupComms
from ._config import GroupConfig, GroupControls, ParamSpec
from ._debug import watch_collective
from ._dtensor import local_of
from ._events import EventScope
from ._extension import has_extension, padded_rule_error
from ._init import warn_if_repeated_shards
from ._lifecycle import ShardedState, TrainingState, transition
from ._mesh import MeshInfo
from ._param import FSDPParam, can_pin, padded_shard_numel
from ._reduce import GradientReducer

_IDLE = TrainingState.IDLE
_FORWARD = TrainingState.FORWARD
_PRE_BACKWARD = TrainingState.PRE_BACKWARD
_POST_BACKWARD = TrainingState.POST_BACKWARD
_UNSHARDED = ShardedState.UNSHARDED


class FSDPParamGroup:
    """The parameters of one ``fully_shard`` call, gathered and reduced together."""

    def __init__(
        self,
        specs: list[ParamSpec],
        modules: tuple[nn.Module, ...],
        config: GroupConfig,
        post_forward_mesh_info: MeshInfo | None,
    ) -> None:
        self.modules = modules
        self.config = config
        self.mesh_info = config.mesh_info
        self.device = config.device  # the compute / communication device
        # See [Note: Packed shards]: the local shards as parts of one buffer, and the parts handed out.
        self._offload = isinstance(config.offload_policy, CPUOffloadPolicy)
        locals_ = [_local_of_param(s.param) for s in specs]
        world = self.mesh_info.shard_size
        sizes = [
            padded_shard_numel(t.size(), s.shard_dim, world) for t, s in zip(locals_, specs, strict=True)
        ]
        self._packed_splits: list[int] = sizes
        packed = self._packed_shards = (
            self._zeroed_shards(sum(sizes), locals_[0].dtype, locals_[0].device)
            if _can_pack(specs, locals_)
            else None
        )
        slots = _slots(packed, sizes) if packed is not None else (None,) * len(specs)
        self.fsdp_params = [
            FSDPParam(
                spec, config.mesh_info, post_forward_mesh_info, config.device, config.offload_policy, slot
            )
            for spec, slot in zip(specs, slots, strict=True)
        ]
        self._packed_views: tuple[torch.Tensor, ...] = tuple(v for v in slots if v is not None)
        self._gather_packed = False  # resolved at lazy init: all-gather straight from the packed buffer
        # Shard(d > 0) parameters need their gathered blocks concatenated along d after copy-out
        self._staged_params = [p for p in self.fsdp_params if p.shard_dim != 0]
        self._tensor_parallel = any(p.is_tensor_parallel for p in self.fsdp_params)  # fixed at construction
        self._byte_gather = False  # parameters of several dtypes: all-gather their bytes
        self._all_gather_dtype = self.fsdp_params[0].orig_dtype
        self._post_forward_mesh_info = post_forward_mesh_info
        self.controls = GroupControls()
        self.comms = GroupComms()
        self.reducer = GradientReducer(config.mesh_info)
        # handed down by the root's lazy init; None before it (no streams: work runs in program order)
        self.comm_ctx: CommContext | None = None
        self.event_scope: EventScope | None = None
        self.module_fqn = ""
        self.training_state = _IDLE
        self.sharded_state = ShardedState.SHARDED
        self._all_gather_result: AllGatherResult | None = None
        self._lazy_initialized = False
        self._watch_init = False  # see _check_materialized_init
        self._post_forward_event: torch.Event | None = None  # CUDA: post-forward slices written
        self._copy_out_targets: dict[int, list[torch.Tensor]] = {}  # world size -> (W, split) views
        # See [Note: One unsharded buffer per group]; resolved at lazy init.
        self._shares_storage = False
        self._unsharded_buffer: torch.Tensor | None = None  # .data alias of the 1-D group buffer
        self._unsharded_buffer_nbytes = 0
        # One rank without alignment gaps: the gathered layout is the buffer's, copy-out is one copy.
        self._one_copy_target: torch.Tensor | None = None
        # (module._parameters, name, tensor) entries registering every parameter's unsharded / sharded
        # form, and (sharded, unsharded) pairs whose requires_grad must agree; None: one by one.
        self._unsharded_slots: list[tuple[dict[str, Any], str, torch.Tensor]] | None = None
        self._sharded_slots: list[tuple[dict[str, Any], str, torch.Tensor]] | None = None
        self._requires_grad_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._has_extension = False  # some parameter all-gathers through fsdp_pre_all_gather
        self._padded_rule_agreed = False  # all ranks checked the extension's padded-size rule once
        self._gather_span: tuple[float | None, TrainingState] = (None, _IDLE)  # timeline: issue time
        # set_bucket_cap_mb: the root's settings (handed down at lazy init), and the groups this one
        # shares an all-gather with in forward / in backward (set by the root's plan, None: alone)
        self.bucketing: Bucketing | None = None
        self.forward_bucket: list[FSDPParamGroup] | None = None
        self.backward_bucket: list[FSDPParamGroup] | None = None
        # Read (and the last one set) by the optimizer-step guard, see ``_step_guard``:
        self.unreduced_grads = False  # a no-sync backward left gradients waiting for a synced one
        self.awaiting_backward = False  # a forward with gradients ran, its backward has not
        self.stepped_after_forward = False  # an optimizer stepped these parameters in between

    def __str__(self) -> str:
        return f"group {self.module_fqn or '<root>'}"

    def set_state(self, new: TrainingState) -> None:
        self.training_state = transition(self.training_state, new, self)

    # ---- configuration ---------------------------------------------------------------------------

    @property
    def post_forward_mesh_info(self) -> MeshInfo | None:
        return self._post_forward_mesh_info

    @post_forward_mesh_info.setter
    def post_forward_mesh_info(self, info: MeshInfo | None) -> None:
        self._post_forward_mesh_info = info
        self._forget_slots()
        for fsdp_param in self.fsdp_params:
            fsdp_param.post_forward_mesh_info = info

    @property
    def reshard_after_forward(self) -> bool:
        return self._post_forward_mesh_info is not None

    @outside_functorch
    def lazy_init(self) -> None:
        """Validate parameters and resolve per-step facts once (idempotent; re-run by ``unshard()``)."""
        if not self._lazy_initialized and self.sharded_state is ShardedState.SHARDED:
            # Catch load_state_dict / to_empty done after fully_shard but before training.
            for fsdp_param in self.fsdp_params:
                fsdp_param.reset_sharded_param()
        meta = [p.fqn for p in self.fsdp_params if p.sharded_param.is_meta]
        if meta:
            raise RuntimeError(
                f"Parameters {meta} are still on the meta device. Materialize them before training, "
                "e.g. module.to_empty(device=...), then reset_parameters() inside "
                "`with fsdp2.init_like_unsharded():` (or load the weights)."
            )
        policy = self.config.mp_policy
        for fsdp_param in self.fsdp_params:
            fsdp_param.init_dtypes(policy.param_dtype, policy.reduce_dtype)
            fsdp_param.init_extension(policy)
        self._check_extension_support()
        if any(p.offload_to_cpu for p in self.fsdp_params):
            misplaced = [p.fqn for p in self.fsdp_params if p.sharded_param.device.type != "cpu"]
            if misplaced:
                raise RuntimeError(
                    f"CPUOffloadPolicy keeps sharded parameters on the CPU, but {misplaced} are not. "
                    "Materialize them on the CPU, e.g. module.to_empty(device='cpu')."
                )
        gather_dtypes = {p.unsharded_dtype for p in self.fsdp_params}
        # One all-gather needs one buffer dtype: with several, gather the parameters' bytes.
        self._byte_gather = len(gather_dtypes) > 1
        self._all_gather_dtype = torch.uint8 if self._byte_gather else gather_dtypes.pop()
        shares = not self._byte_gather and all(
            p.shard_dim == 0 and not p.has_extension for p in self.fsdp_params
        )
        if self.sharded_state is ShardedState.SHARDED and not self._packing_intact():
            self._pack_shards()  # shards replaced since fully_shard (e.g. a deep copy's adopted shards)
        self._gather_packed = not self._has_extension and not self._byte_gather and self._packing_intact()
        buffer = self._unsharded_buffer
        if (
            self.sharded_state is ShardedState.SHARDED
            and buffer is not None
            and (not shares or buffer.dtype != self._all_gather_dtype)
        ):
            # Converted since the last unshard (e.g. model.double()): rebuild the buffer at the next one.
            for fsdp_param in self.fsdp_params:
                fsdp_param.drop_unsharded()
            self._unsharded_buffer = self._one_copy_target = None
        self._shares_storage = shares
        self.reducer.resolve(self.fsdp_params)
        self._copy_out_targets.clear()
        self._forget_slots()
        # Materialised from meta: look at the first all-gather's rank blocks (see _init.py).
        self._watch_init = any(p.from_meta and not p.has_extension for p in self.fsdp_params)
        self._lazy_initialized = True

    def _pack_shards(self) -> None:
        """Move the local shards into one buffer, one padded slot per parameter, in parameter order.

        See [Note: Packed shards]. Not for groups with all-gather extensions (their inputs come from a
        hook) or with shards of several dtypes or devices: those keep one buffer per parameter.
        """
        params = self.fsdp_params
        if not params or any(p.has_extension for p in params):
            return
        if len({p.shard_dtype for p in params}) != 1 or len({p.shard_device for p in params}) != 1:
            return
        if not all(p.can_move_shard() for p in params):
            return  # a sharded parameter is part of an autograd graph now: keep per-parameter shards
        flat = self._zeroed_shards(sum(self._packed_splits), params[0].shard_dtype, params[0].shard_device)
        views = _slots(flat, self._packed_splits)
        for fsdp_param, view in zip(params, views, strict=True):
            fsdp_param.move_shard_into(view)
        self._packed_shards, self._packed_views = flat, views

    def _zeroed_shards(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed 1-D buffer for packed shards: on the CPU (pinned where possible) under offload."""
        policy = self.config.offload_policy
        if self._offload and device.type != "meta":
            return torch.zeros(numel, dtype=dtype, device="cpu", pin_memory=can_pin(policy))
        return torch.zeros(numel, dtype=dtype, device=device)

    def _packing_intact(self) -> bool:
        """Every parameter's local shard is still its slot of the packed buffer."""
        views = self._packed_views
        return bool(views) and all(p.holds_shard(v) for p, v in zip(self.fsdp_params, views, strict=True))

    def _packed_input(self) -> torch.Tensor | None:
        """The packed shards as this rank's all-gather input (on the compute device), if usable."""
        flat = self._packed_shards
        if not self._gather_packed or flat is None:
            return None
        if self._offload and self.device.type != "cpu":
            return flat.to(self.device, non_blocking=flat.is_pinned())
        return flat

    def readopt_sharded_params(self) -> None:
        """Re-adopt the registered sharded parameters; the next unshard re-runs lazy init.

        After a conversion (``model.to``, ``to_empty``, ``.double()``) or ``load_state_dict(assign=True)``.
        """
        for fsdp_param in self.fsdp_params:
            fsdp_param.reset_sharded_param()
        if not self._packing_intact():
            self._pack_shards()
        self._forget_slots()
        self._lazy_initialized = False

    def _forget_slots(self) -> None:
        self._unsharded_slots = self._sharded_slots = None
        self._requires_grad_pairs = []

    def _check_extension_support(self) -> None:
        """All-gather extensions: resolve which parameters use one; refuse what they cannot do."""
        extended = [p for p in self.fsdp_params if p.has_extension]
        self._has_extension = bool(extended)
        self._staged_params = [p for p in self.fsdp_params if p.shard_dim != 0 or p.has_extension]
        info = self._post_forward_mesh_info
        for fsdp_param in extended:
            if info is not None and info is not self.mesh_info:
                raise NotImplementedError(
                    f"Parameter {fsdp_param.fqn} uses fsdp_pre_all_gather, which fsdp2 does not combine "
                    "with an int reshard_after_forward; use True or False for this module."
                )
            if fsdp_param.is_tensor_parallel:
                raise NotImplementedError(
                    f"Parameter {fsdp_param.fqn}: fsdp_pre_all_gather on a tensor-parallel parameter is not "
                    "supported by fsdp2 yet."
                )

    # ---- unshard / reshard -----------------------------------------------------------------------

    @outside_functorch
    def unshard(self, async_op: bool = False, as_state: TrainingState | None = None) -> None:
        """Issue this group's all-gather, unless one is pending or the group is already unsharded.

        ``as_state`` is the phase the all-gather serves (a prefetch issues it for the next forward or
        backward use); it picks the streams and labels the event. Default: the group's own state.
        """
        if self._all_gather_result is not None or self.sharded_state is _UNSHARDED:
            return
        if not self._lazy_initialized:
            self.lazy_init()  # parameters re-adopted since the last step (readopt_sharded_params)
            if self.comm_ctx is not None:
                # Lazy init may have (re)packed the shards on the current stream: the copy-in and
                # all-gather streams read them, so they wait for those writes.
                self.comm_ctx.wait_for_current_stream()
        state = self.training_state if as_state is None else as_state
        post_forward = self.sharded_state is ShardedState.SHARDED_POST_FORWARD
        bucketing = self.bucketing
        if bucketing is not None and bucketing.all_gather_cap is not None and not (async_op or post_forward):
            members = self._bucket_members(state)
            if members is not None:
                self._unshard_bucket(members, state)  # records every member's unshard
                return
        _events.record("unshard", self.module_fqn, state, self.event_scope)
        self._gather_span = (_events.span_start(self.event_scope), state)
        info = self._post_forward_mesh_info if post_forward else self.mesh_info
        assert info is not None, "post-forward state without a post-forward mesh"
        ctx = self.comm_ctx
        # Custom collectives are not used for a single rank (nothing is communicated).
        comm = self.comms.all_gather if info.shard_size > 1 else None
        with watch_collective("all-gather", self.module_fqn, state):
            if ctx is not None and ctx.use_streams and not async_op and state in (_FORWARD, _PRE_BACKWARD):
                self._all_gather_result = self._all_gather_on_streams(ctx, info, post_forward, comm)
            else:
                output, local, split_sizes = self._copy_in(info, post_forward, comm)
                work = issue_all_gather(output, local, info.shard_group, info.shard_size, async_op, comm)
                self._all_gather_result = AllGatherResult(output, split_sizes, info.shard_size, None, work)

    def _copy_in(
        self, info: MeshInfo, post_forward: bool, comm: object
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """``(output, this rank's input, split sizes)`` of the next all-gather, on the current stream.

        The packed shards are the input where they can be; otherwise each parameter's input is copied
        into this rank's block (post-forward slices, extensions, byte gathers).
        """
        packed = None if post_forward else self._packed_input()
        if packed is not None:
            output, local = packed_all_gather_copy_in(
                packed, info.shard_size, info.shard_rank, self._all_gather_dtype, comm
            )
            return output, local, self._packed_splits
        return all_gather_copy_in(
            self._all_gather_inputs(post_forward),
            info.shard_size,
            info.shard_rank,
            self._all_gather_dtype,
            comm,
        )

    # ---- bucketing (set_bucket_cap_mb) -----------------------------------------------------------

    def all_gather_bucket_key(self) -> Hashable | None:
        """What groups sharing one all-gather must agree on; ``None``: this group gathers alone.

        Alone: a single-rank shard group, all-gather extensions, several gathered dtypes (byte
        gathers), tensor-parallel parameters, custom collectives, or an int ``reshard_after_forward``.
        """
        info = self.mesh_info
        post = self._post_forward_mesh_info
        if (
            info.shard_size == 1
            or not self._lazy_initialized
            or self._has_extension
            or self._byte_gather
            or self.comms.custom
            or (post is not None and post is not info)
            or self._tensor_parallel
        ):
            return None
        # The built-in collectives a setter installs are bound to the shard group: their type suffices.
        return (id(info.shard_group), self._all_gather_dtype, self.device, type(self.comms.all_gather))

    def all_gather_bytes(self) -> int:
        """Bytes of this group's all-gather output (what the all-gather cap counts)."""
        numel = sum(p.padded_shard_numel for p in self.fsdp_params) * self.mesh_info.shard_size
        return numel * self._all_gather_dtype.itemsize

    def _bucket_members(self, state: TrainingState) -> list[FSDPParamGroup] | None:
        """The groups (this one first) to all-gather with now, or ``None`` to gather alone."""
        bucketing = self.bucketing
        if bucketing is None or bucketing.all_gather_cap is None:
            return None
        if state is _FORWARD:
            bucket = self.forward_bucket
        elif state is _PRE_BACKWARD:
            bucket = self.backward_bucket
        else:
            return None
        if bucket is None:
            return None
        key = self.all_gather_bucket_key()
        if key is None:
            return None
        members = [self]
        members.extend(g for g in bucket if g is not self and g.joins_bucket(state, key))
        return members if len(members) > 1 else None

    def joins_bucket(self, state: TrainingState, key: Hashable) -> bool:
        """Whether this group joins a bucketed all-gather for ``state`` now (it needs one, same key)."""
        return (
            self._all_gather_result is None
            and self.sharded_state is ShardedState.SHARDED
            and (state is _FORWARD or self.controls.unshard_in_backward)
            and self.all_gather_bucket_key() == key
        )

    def bucket_inputs(self, state: TrainingState) -> list[torch.Tensor]:
        """This group's all-gather inputs for a bucket issued for ``state`` (records its unshard)."""
        _events.record("unshard", self.module_fqn, state, self.event_scope)
        self._gather_span = (_events.span_start(self.event_scope), state)
        return self._all_gather_inputs(False)

    def set_bucket_result(self, result: AllGatherResult) -> None:
        """This group's part of a bucketed all-gather, copied out by ``wait_for_unshard``."""
        self._all_gather_result = result

    def _unshard_bucket(self, members: list[FSDPParamGroup], state: TrainingState) -> None:
        """One all-gather for ``members``; each waits for (and copies out) its own part later."""
        info = self.mesh_info
        names = "; ".join(g.module_fqn or "<root>" for g in members)
        with watch_collective("all-gather (bucket)", names, state):
            results = all_gather_bucket(
                lambda: [g.bucket_inputs(state) for g in members],
                info.shard_group,
                info.shard_size,
                info.shard_rank,
                self._all_gather_dtype,
                self.comms.all_gather,
                self.comm_ctx,
            )
        for group, result in zip(members, results, strict=True):
            group.set_bucket_result(result)

    def _reduce_scatter_bucket_key(
        self, params: list[FSDPParam], grads: list[torch.Tensor]
    ) -> Hashable | None:
        """What groups sharing one reduce-scatter must agree on; ``None``: alone.

        Alone: a single-rank shard group, HSDP (the replica all-reduce), an all-reduce hook, custom
        collectives, tensor-parallel parameters, or gradients in several reduce dtypes.
        """
        info = self.mesh_info
        controls, comms = self.controls, self.comms
        if (
            info.shard_size == 1
            or info.replicate_group is not None
            or controls.all_reduce_hook is not None
            or comms.custom
            or self._tensor_parallel
        ):
            return None
        dtypes = {
            p.reduce_dtype or g.dtype for p, g in zip(params, grads, strict=True) if p.padded_shard_numel
        }
        if len(dtypes) != 1:
            return None
        dtype = dtypes.pop()
        factors = self.reducer.divide_factors(dtype, controls)
        group = comms.reduce_scatter_group or info.shard_group
        comm = comms.reduce_scatter
        return (id(group), dtype, factors, self.device, type(comm))

    def _queue_reduce_scatter(
        self, bucketing: Bucketing, cap: int, params: list[FSDPParam], grads: list[torch.Tensor]
    ) -> bool:
        """Pack the gradients and queue them for a shared reduce-scatter; ``False``: reduce them now."""
        key = self._reduce_scatter_bucket_key(params, grads)
        if key is None:
            # Reduce alone, after the queue: buckets stay runs of consecutive post-backwards.
            bucketing.queue.flush(self.comm_ctx)
            return False
        ctx, controls, comms = self.comm_ctx, self.controls, self.comms
        start = _events.span_start(self.event_scope)
        # One reduce dtype (the key says so): exactly one packed buffer. Empties grads.
        ((_, reduced, buffer),) = self.reducer.pack(params, grads, ctx, controls, comms.reduce_scatter)
        entry = PendingReduceScatter(
            self.reducer,
            params,
            reduced,
            buffer,
            controls,
            comms,
            self.module_fqn,
            self.training_state,
            self.event_scope,
            start,
        )
        bucketing.queue.add(entry, key, cap, ctx)
        return True

    def _all_gather_inputs(self, post_forward: bool) -> list[torch.Tensor]:
        if self._has_extension:
            return self._extension_all_gather_inputs(post_forward)
        inputs = [p.all_gather_input(post_forward) for p in self.fsdp_params]
        if self._byte_gather:
            inputs = [_as_bytes(t, p.unsharded_dtype) for t, p in zip(inputs, self.fsdp_params, strict=True)]
        return inputs

    def _extension_all_gather_inputs(self, post_forward: bool) -> list[torch.Tensor]:
        """Inputs of a group with extension parameters; the collective dtype follows what they return."""
        inputs: list[torch.Tensor] = []
        dtypes: list[torch.dtype] = []
        for fsdp_param in self.fsdp_params:
            tensors = fsdp_param.all_gather_inputs(post_forward)
            inputs.extend(tensors)
            if fsdp_param.has_extension:
                dtypes.extend(t.dtype for t in tensors)
            else:
                dtypes.extend(fsdp_param.unsharded_dtype for _ in tensors)
        self._check_padded_rule()
        kinds = set(dtypes)
        self._byte_gather = len(kinds) > 1
        self._all_gather_dtype = torch.uint8 if self._byte_gather else kinds.pop()
        if self._byte_gather:
            inputs = [_as_bytes(t, d) for t, d in zip(inputs, dtypes, strict=True)]
        return inputs

    def _check_padded_rule(self) -> None:
        """Every rank raises together if any pre hook broke the padded-size rule (no hang)."""
        extended = [p for p in self.fsdp_params if p.has_extension]
        bad = [p.fqn for p in extended if not p.extension_rule_ok]
        if not self._padded_rule_agreed and any(p.unevenly_sharded for p in extended):
            info = self.mesh_info
            everyone_ok = info.shard_size == 1 or all_ranks_true(not bad, info.shard_group, self.device)
            if not everyone_ok:
                raise padded_rule_error(bad or [p.fqn for p in extended if p.unevenly_sharded])
            self._padded_rule_agreed = True
        elif bad:
            raise padded_rule_error(bad)

    def _all_gather_on_streams(
        self, ctx: CommContext, info: MeshInfo, post_forward: bool, comm: object
    ) -> AllGatherResult:
        copy_in_stream, gather_stream = ctx.all_gather_copy_in_stream, ctx.all_gather_stream
        assert copy_in_stream is not None, "all-gather copy-in stream not initialized"
        assert gather_stream is not None, "all-gather stream not initialized"
        if post_forward and self._post_forward_event is not None:
            # The post-forward slices were cloned on the current stream after forward.
            copy_in_stream.wait_event(self._post_forward_event)
            self._post_forward_event = None
        with torch.cuda.stream(copy_in_stream):
            # Inputs (host-to-device copies under CPU offload) are made on the copy-in stream too.
            output, local, split_sizes = self._copy_in(info, post_forward, comm)
        gather_stream.wait_stream(copy_in_stream)
        with torch.cuda.stream(gather_stream):
            issue_all_gather(output, local, info.shard_group, info.shard_size, False, comm)
            event = gather_stream.record_event()
        return AllGatherResult(output, split_sizes, info.shard_size, event, None, input=local)

    @outside_functorch
    def wait_for_unshard(self) -> None:
        """Finish the pending all-gather: copy out and register the unsharded parameters."""
        result = self._all_gather_result
        if result is None:
            return
        with watch_collective("all-gather wait", self.module_fqn, self.training_state):
            wait_all_gather(result)
        if self._shares_storage:
            self._grow_unsharded_buffer()
        else:
            for fsdp_param in self.fsdp_params:
                fsdp_param.all_gather_outputs()  # (re)allocates their storage
        # Hot path: the (W, split) views survive storage resizes, so build them once per world size.
        targets = self._copy_out_targets.get(result.world_size)
        if targets is None:
            outputs = [o for p in self.fsdp_params for o in p.all_gather_outputs()]
            if self._byte_gather:
                outputs = [o.view(torch.uint8) for o in outputs]
            targets = [o.view(result.world_size, -1) for o in outputs]
            self._copy_out_targets[result.world_size] = targets
        one_copy = self._one_copy_target if self._shares_storage else None
        if one_copy is not None:
            one_copy.copy_(result.output)  # one rank: no buckets, no post-forward mesh
        else:
            copy_out_2d(result, targets)
        if self._watch_init:
            self._check_materialized_init(result.world_size)
        for fsdp_param in self._staged_params:
            fsdp_param.finish_unshard()
        self._all_gather_result = None
        self._register_unsharded()
        self.sharded_state = _UNSHARDED
        start, issued_in = self._gather_span
        _events.span_end(start, "all-gather", self.module_fqn, issued_in, self.event_scope)
        ctx = self.comm_ctx
        if ctx is not None and ctx.use_streams:
            copy_out_event = torch.cuda.current_stream(self.device).record_event()
            ctx.release_deferred_all_gather()
            ctx.deferred_all_gather = ((result.output, result.input), copy_out_event)
            if self.training_state is not _FORWARD:
                ctx.release_deferred_all_gather()

    def _check_materialized_init(self, world: int) -> None:
        """Once after materialising from meta: warn if a parameter's full value repeats per rank."""
        self._watch_init = False
        if world != self.mesh_info.shard_size:
            return
        params = [p for p in self.fsdp_params if p.from_meta and not p.has_extension]
        for fsdp_param in params:
            fsdp_param.from_meta = False
        warn_if_repeated_shards(params, [p.all_gather_output() for p in params], world)

    @outside_functorch
    def reshard(self) -> None:
        """Register sharded parameters again and free the unsharded ones.

        In forward this follows ``reshard_after_forward``: no-op for ``False``, the smaller
        post-forward shard for an int.
        """
        if self.training_state is _FORWARD:
            info = self._post_forward_mesh_info
            if info is None:
                return
            if info is not self.mesh_info:
                if self.sharded_state is _UNSHARDED:
                    for fsdp_param in self.fsdp_params:
                        fsdp_param.to_sharded_post_forward()
                    self._free_unsharded_buffer()
                    self.sharded_state = ShardedState.SHARDED_POST_FORWARD
                    ctx = self.comm_ctx
                    if ctx is not None and ctx.use_streams:
                        self._post_forward_event = torch.cuda.current_stream(self.device).record_event()
                    _events.record("reshard", self.module_fqn, self.training_state, self.event_scope)
                return
        if self.sharded_state is not ShardedState.SHARDED:
            slots = self._sharded_slots
            if slots is not None and self.sharded_state is _UNSHARDED:
                for params, name, tensor in slots:
                    params[name] = tensor
            else:
                for fsdp_param in self.fsdp_params:
                    fsdp_param.to_sharded()
            self._free_unsharded_buffer()
            self.sharded_state = ShardedState.SHARDED
            _events.record("reshard", self.module_fqn, self.training_state, self.event_scope)

    # ---- the group's unsharded buffer and registrations --------------------------------------------

    def _grow_unsharded_buffer(self) -> None:
        """Allocate the group buffer (binding every parameter to its part), or re-grow its storage."""
        buffer = self._unsharded_buffer
        if buffer is None:
            sizes = [self.mesh_info.shard_size * p.padded_shard_numel for p in self.fsdp_params]
            # Every parameter starts on a 64-byte boundary, as a tensor of its own would: vectorized
            # kernels and cuBLAS pick slower paths for misaligned operands.
            align = max(1, _ALIGN_BYTES // self._all_gather_dtype.itemsize)
            aligned = [-(-size // align) * align for size in sizes]
            flat = torch.empty(sum(aligned), dtype=self._all_gather_dtype, device=self.device)
            self._unsharded_buffer = buffer = flat.data
            self._unsharded_buffer_nbytes = buffer.untyped_storage().nbytes()
            gapless = self.mesh_info.shard_size == 1 and aligned[:-1] == sizes[:-1]
            self._one_copy_target = buffer.narrow(0, 0, sum(sizes)) if gapless else None
            views = _slots(flat, sizes, aligned)
            data_views = _slots(buffer, sizes, aligned)
            for fsdp_param, view, data in zip(self.fsdp_params, views, data_views, strict=True):
                fsdp_param.bind_unsharded_storage(view, data)
            self._copy_out_targets.clear()
            self._forget_slots()
        elif buffer.untyped_storage().nbytes() == 0:
            buffer.untyped_storage().resize_(self._unsharded_buffer_nbytes)

    def _free_unsharded_buffer(self) -> None:
        buffer = self._unsharded_buffer
        if buffer is not None:
            buffer.untyped_storage().resize_(0)

    def _register_unsharded(self) -> None:
        """Register every parameter's unsharded form (batched once the entries are known)."""
        slots = self._unsharded_slots
        if slots is None:
            for fsdp_param in self.fsdp_params:
                fsdp_param.to_unsharded()
            self._build_slots()
            return
        if self.training_state is not _PRE_BACKWARD:
            # Freezing or unfreezing a sharded parameter takes effect at the next forward. Backward
            # re-gathers for the graph that forward recorded, so it needs no sync (it is the costly
            # part here: DTensor attribute reads).
            for sharded, unsharded in self._requires_grad_pairs:
                if sharded.requires_grad is not unsharded.requires_grad:
                    unsharded.requires_grad_(sharded.requires_grad)
        for params, name, tensor in slots:
            params[name] = tensor

    def _build_slots(self) -> None:
        """Resolve the batched registrations, where every owner module allows them.

        Not with an int ``reshard_after_forward`` (post-forward placeholders are registered too) or
        all-gather extensions (their unsharded parameters may be rebuilt).
        """
        info = self._post_forward_mesh_info
        if self._has_extension or (info is not None and info is not self.mesh_info):
            return
        unsharded: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        sharded: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        for fsdp_param in self.fsdp_params:
            entries = fsdp_param.registration_slots(unsharded=True)
            back = fsdp_param.registration_slots(unsharded=False)
            if entries is None or back is None:
                return
            unsharded.extend(entries)
            sharded.extend(back)
        self._requires_grad_pairs = [
            (p.sharded_param, p.unsharded_param)  # type: ignore[misc]  # reason: unsharded after to_unsharded
            for p in self.fsdp_params
        ]
        self._unsharded_slots, self._sharded_slots = unsharded, sharded

    def prefetch(self, as_state: TrainingState) -> None:
        """Unshard ahead of a use in ``as_state`` (``FORWARD`` or ``PRE_BACKWARD``)."""
        if as_state is _PRE_BACKWARD and not self.controls.unshard_in_backward:
            return
        self.unshard(False, as_state)

    # ---- forward ---------------------------------------------------------------------------------

    def pre_forward(self) -> None:
        """Enter ``FORWARD`` and make the unsharded parameters available."""
        self.set_state(_FORWARD)
        self.stepped_after_forward = False
        if self.sharded_state is _UNSHARDED:
            # Still unsharded (reshard_after_forward=False): register the unsharded parameters again,
            # since a restore such as torch.func.functional_call's may have put the sharded ones back.
            self._register_unsharded()
        self.unshard(self.controls.unshard_async_op)
        self.wait_for_unshard()

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
        """Enter ``PRE_BACKWARD`` and unshard for backward; ``False`` if already in it (nothing done)."""
        if self.training_state is _PRE_BACKWARD:
            return False
        if self.stepped_after_forward:
            self.stepped_after_forward = False
            raise RuntimeError(
                f"fsdp2: {self.module_fqn or 'the root'}'s parameters were updated by optimizer.step() "
                "after the forward this backward differentiates and before the backward, so its "
                "gradients would be computed with the new parameters (the unsharded model fails here "
                "too, with autograd's in-place error). Call optimizer.step() after loss.backward(). "
                "This iteration is unfinished: call reset_iter_state() on the root module first."
            )
        self.set_state(_PRE_BACKWARD)
        if self.controls.unshard_in_backward:
            self.unshard(self.controls.unshard_async_op)
        self.wait_for_unshard()
        return True

    def post_backward(self) -> None:
        """Reshard and reduce-scatter the gradients autograd left on the unsharded parameters."""
        self.set_state(_POST_BACKWARD)
        self.awaiting_backward = False
        controls = self.controls
        if not controls.reduce_grads:
            # No-sync step: gradients stay unsharded (in reduce_dtype where one is set) and keep
            # accumulating until a step with gradient sync reduces their sum.
            for fsdp_param in self.fsdp_params:
                fsdp_param.stash_unsharded_grad()
            self.unreduced_grads = any(p.holds_unsharded_grad() for p in self.fsdp_params)
            if controls.reshard_after_backward:
                self.reshard()
            _events.record("post_backward", self.module_fqn, self.training_state, self.event_scope)
            return
        self.unreduced_grads = False
        reduced: list[FSDPParam] = []
        grads: list[torch.Tensor] = []
        unused_too = controls.reduce_scatter_unused_params
        for fsdp_param in self.fsdp_params:
            grad = fsdp_param.take_unsharded_grad()
            if grad is None and unused_too and fsdp_param.sharded_param.requires_grad:
                grad = fsdp_param.zero_unsharded_grad()
            if grad is not None:
                reduced.append(fsdp_param)
                grads.append(grad)
        if controls.reshard_after_backward:
            self.reshard()
        # With a reduce-scatter cap, the root's queue reduces them (at the cap or the end of backward).
        bucketing = self.bucketing
        cap = bucketing.reduce_scatter_cap if bucketing is not None else None
        if grads and not (
            bucketing is not None
            and cap is not None
            and self._queue_reduce_scatter(bucketing, cap, reduced, grads)
        ):
            start = _events.span_start(self.event_scope)
            with watch_collective("reduce-scatter", self.module_fqn, self.training_state):
                self.reducer.reduce(reduced, grads, self.comm_ctx, controls, self.comms)
            _events.span_end(start, "reduce-scatter", self.module_fqn, self.training_state, self.event_scope)
        _events.record("post_backward", self.module_fqn, self.training_state, self.event_scope)

    def drop_unreduced_grads(self) -> None:
        """Discard the gradients left on the unsharded parameters (``zero_grad``, ``reset``)."""
        for fsdp_param in self.fsdp_params:
            fsdp_param.take_unsharded_grad()
        self.unreduced_grads = False

    def finish_backward(self, last: bool) -> None:
        """End-of-backward callback: post-backward if autograd never reached it, then ``IDLE``.

        On the ``last`` backward of a step, also drain a mis-targeted prefetch and wait for reductions.
        """
        if self.training_state is not _POST_BACKWARD:
            self.post_backward()
        self.set_state(_IDLE)
        if last:
            self.finalize_backward()

    def finalize_backward(self) -> None:
        """Drain a mis-targeted prefetch and wait for this group's reductions."""
        result = self._all_gather_result
        if result is not None:
            wait_all_gather(result)
            self._all_gather_result = None
        self.reducer.finalize(self.device)

    def unsharded_tensors(self) -> list[torch.Tensor]:
        """Tensors that hold this group's unsharded data (for memory tools; some may be size 0 now).

        The in-flight all-gather output, the unsharded parameters' storages and post-forward slices.
        """
        tensors = [t for p in self.fsdp_params for t in p.unsharded_tensors()]
        result = self._all_gather_result
        if result is not None and result.output is not self._packed_shards:
            tensors.append(result.output)
        return tensors

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


def _as_bytes(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype``, viewed as bytes (for a group that gathers several dtypes at once)."""
    return (tensor if tensor.dtype == dtype else tensor.to(dtype)).view(torch.uint8)


_ALIGN_BYTES = 64  # where each parameter's part of a group's unsharded buffer starts


def _slots(
    flat: torch.Tensor, sizes: list[int], strides: list[int] | None = None
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


def _local_of_param(param: torch.Tensor) -> torch.Tensor:
    """The tensor FSDP shards: the tensor-parallel local tensor of a DTensor parameter."""
    return local_of(param) if isinstance(param, DTensor) else param


def _can_pack(specs: list[ParamSpec], locals_: list[torch.Tensor]) -> bool:
    """Whether the group's shards can share one buffer (see [Note: Packed shards]).

    Not with all-gather extensions (their inputs come from a hook; their shards keep their tensor
    subclass) or with parameters of several dtypes or devices.
    """
    if not locals_ or any(has_extension(t, s.owners[0][1]) for t, s in zip(locals_, specs, strict=True)):
        return False
    return len({t.dtype for t in locals_}) == 1 and len({t.device for t in locals_}) == 1
