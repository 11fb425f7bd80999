"""A communication group: the parameters of one ``fully_shard`` call.

Owns: the group's ``TrainingState`` and ``ShardedState``; unshard (one all-gather), wait_for_unshard
(copy-out and register), reshard, pre/post forward and backward, prefetch, and the reduce-scatter of
gradients. Does not own: hooks, root logic or event ordering across groups (``FSDPState``).
Invariants: the group's ``ShardedState`` equals every member parameter's; at most one all-gather is
pending (``_all_gather_result``); an unshard is a no-op while one is pending or when unsharded.

[Note: Prefetch order]
Every post-forward appends the group to the shared ``post_forward_order`` and remembers its index
(one per forward use). A pre-backward without an explicit prefetch list pops its latest index ``i``
and unshards ``post_forward_order[i - 1]``: the module that ran just before it in forward runs just
after it in backward. Explicit lists replace that default (``FSDPState``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import _events
from ._api import MixedPrecisionPolicy, OffloadPolicy
from ._autograd import in_backward_task_id, register_post_backward
from ._collectives import (
    AllGatherResult,
    DivideFactors,
    all_gather_copy_in,
    copy_out_2d,
    divide_factors,
    foreach_all_gather,
    issue_all_gather,
    reduce_scatter,
    reduce_scatter_copy_in,
    view_out_shards,
    wait_all_gather,
)
from ._comm_context import CommContext
from ._lifecycle import ShardedState, TrainingState
from ._mesh import MeshInfo, mesh_device
from ._param import FSDPParam

_FORWARD = TrainingState.FORWARD
_PRE_BACKWARD = TrainingState.PRE_BACKWARD
_UNSHARDED = ShardedState.UNSHARDED


class FSDPParamGroup:
    """The parameters of one ``fully_shard`` call, gathered and reduced together."""

    def __init__(
        self,
        params: list[nn.Parameter],
        owners: dict[int, list[tuple[nn.Module, str]]],
        modules: tuple[nn.Module, ...],
        mesh_info: MeshInfo,
        post_forward_mesh_info: MeshInfo | None,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
        device: torch.device | None = None,
        shard_dims: dict[int, int] | None = None,
    ) -> None:
        self.modules = modules
        # the compute / communication device
        self.device = device if device is not None else mesh_device(mesh_info.mesh)
        self.mesh_info = mesh_info
        self.mp_policy = mp_policy
        dims = shard_dims or {}
        self.fsdp_params = [
            FSDPParam(
                p,
                owners[id(p)],
                mesh_info,
                post_forward_mesh_info,
                self.device,
                dims.get(id(p), 0),
                offload_policy,
            )
            for p in params
        ]
        # Shard(d > 0) parameters need their gathered blocks concatenated along d after copy-out
        self._staged_params = [p for p in self.fsdp_params if p.shard_dim != 0]
        self._byte_gather = False  # parameters of several dtypes: all-gather their bytes
        self._post_forward_mesh_info = post_forward_mesh_info
        self.comm_ctx = CommContext()
        self.module_fqn = ""
        self.training_state = TrainingState.IDLE
        self.sharded_state = ShardedState.SHARDED
        self._all_gather_result: AllGatherResult | None = None
        self._post_forward_indices: list[int] = []
        self._lazy_initialized = False
        self._all_gather_dtype = self.fsdp_params[0].orig_dtype
        self._divide_factors: dict[torch.dtype, DivideFactors] = {}
        self._post_reduce_event: torch.Event | None = None
        # HSDP with all-reduce off: shard-reduced gradients waiting for a step that all-reduces
        self._partial_reduce_outputs: dict[torch.dtype, torch.Tensor] = {}
        self._offload_copies_in_flight = False  # CPU offload: device-to-host gradient copies pending
        self._post_forward_event: torch.Event | None = None  # CUDA: post-forward slices written
        self._copy_out_targets: dict[int, list[torch.Tensor]] = {}  # world size -> (W, split) views
        # user controls (FSDPModule setters)
        self.reduce_grads = True
        self.reshard_after_backward = True
        self.unshard_in_backward = True
        self.unshard_async_op = False
        self.all_reduce_grads = True
        self.gradient_divide_factor: float | None = None
        self.force_sum_reduction = False
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None

    # ---- configuration ---------------------------------------------------------------------------

    @property
    def post_forward_mesh_info(self) -> MeshInfo | None:
        return self._post_forward_mesh_info

    @post_forward_mesh_info.setter
    def post_forward_mesh_info(self, info: MeshInfo | None) -> None:
        self._post_forward_mesh_info = info
        for fsdp_param in self.fsdp_params:
            fsdp_param.post_forward_mesh_info = info

    @property
    def reshard_after_forward(self) -> bool:
        return self._post_forward_mesh_info is not None

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
                "e.g. module.to_empty(device=...) followed by reset_parameters()."
            )
        policy = self.mp_policy
        for fsdp_param in self.fsdp_params:
            fsdp_param.init_dtypes(policy.param_dtype, policy.reduce_dtype)
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
        self._divide_factors.clear()
        self._copy_out_targets.clear()
        self._lazy_initialized = True

    def _factors(self, dtype: torch.dtype) -> DivideFactors:
        factors = self._divide_factors.get(dtype)
        if factors is None:
            world = self.mesh_info.shard_size * self.mesh_info.replicate_size
            factors = divide_factors(world, dtype, self.gradient_divide_factor, self.force_sum_reduction)
            self._divide_factors[dtype] = factors
        return factors

    # ---- unshard / reshard -----------------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> None:
        """Issue this group's all-gather, unless one is pending or the group is already unsharded."""
        if self._all_gather_result is not None or self.sharded_state is _UNSHARDED:
            return
        _events.record("unshard", self.module_fqn, self.training_state)
        post_forward = self.sharded_state is ShardedState.SHARDED_POST_FORWARD
        info = self._post_forward_mesh_info if post_forward else self.mesh_info
        assert info is not None, "post-forward state without a post-forward mesh"
        ctx = self.comm_ctx
        if ctx.use_streams and not async_op and self.training_state in (_FORWARD, _PRE_BACKWARD):
            self._all_gather_result = self._all_gather_on_streams(info, post_forward)
        else:
            self._all_gather_result = foreach_all_gather(
                self._all_gather_inputs(post_forward),
                info.shard_group,
                info.shard_size,
                info.shard_rank,
                self._all_gather_dtype,
                async_op,
            )

    def _all_gather_inputs(self, post_forward: bool) -> list[torch.Tensor]:
        inputs = [p.all_gather_input(post_forward) for p in self.fsdp_params]
        if self._byte_gather:
            inputs = [_as_bytes(t, p.unsharded_dtype) for t, p in zip(inputs, self.fsdp_params, strict=True)]
        return inputs

    def _all_gather_on_streams(self, info: MeshInfo, post_forward: bool) -> AllGatherResult:
        ctx = self.comm_ctx
        copy_in_stream, gather_stream = ctx.all_gather_copy_in_stream, ctx.all_gather_stream
        assert copy_in_stream is not None, "all-gather copy-in stream not initialized"
        assert gather_stream is not None, "all-gather stream not initialized"
        if post_forward and self._post_forward_event is not None:
            # The post-forward slices were cloned on the current stream after forward.
            copy_in_stream.wait_event(self._post_forward_event)
            self._post_forward_event = None
        with torch.cuda.stream(copy_in_stream):
            # Inputs (host-to-device copies under CPU offload) are made on the copy-in stream too.
            output, local, split_sizes = all_gather_copy_in(
                self._all_gather_inputs(post_forward),
                info.shard_size,
                info.shard_rank,
                self._all_gather_dtype,
            )
        gather_stream.wait_stream(copy_in_stream)
        with torch.cuda.stream(gather_stream):
            issue_all_gather(output, local, info.shard_group, info.shard_size, async_op=False)
            event = gather_stream.record_event()
        return AllGatherResult(output, split_sizes, info.shard_size, event, None)

    def wait_for_unshard(self) -> None:
        """Finish the pending all-gather: copy out and register the unsharded parameters."""
        result = self._all_gather_result
        if result is None:
            return
        wait_all_gather(result)
        outputs = [p.all_gather_output() for p in self.fsdp_params]  # (re)allocates storage
        # Hot path: the (W, split) views survive storage resizes, so build them once per world size.
        targets = self._copy_out_targets.get(result.world_size)
        if targets is None:
            if self._byte_gather:
                outputs = [o.view(torch.uint8) for o in outputs]
            targets = [o.view(result.world_size, -1) for o in outputs]
            self._copy_out_targets[result.world_size] = targets
        copy_out_2d(result, targets)
        for fsdp_param in self._staged_params:
            fsdp_param.finish_unshard()
        self._all_gather_result = None
        for fsdp_param in self.fsdp_params:
            fsdp_param.to_unsharded()
        self.sharded_state = _UNSHARDED
        ctx = self.comm_ctx
        if ctx.use_streams:
            copy_out_event = torch.cuda.current_stream().record_event()
            ctx.release_deferred_all_gather()
            ctx.deferred_all_gather = (result.output, copy_out_event)
            if self.training_state is not _FORWARD:
                ctx.release_deferred_all_gather()

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
                    self.sharded_state = ShardedState.SHARDED_POST_FORWARD
                    if self.comm_ctx.use_streams:
                        self._post_forward_event = torch.cuda.current_stream().record_event()
                    _events.record("reshard", self.module_fqn, self.training_state)
                return
        if self.sharded_state is not ShardedState.SHARDED:
            for fsdp_param in self.fsdp_params:
                fsdp_param.to_sharded()
            self.sharded_state = ShardedState.SHARDED
            _events.record("reshard", self.module_fqn, self.training_state)

    def prefetch(self, training_state: TrainingState) -> None:
        """Unshard ahead of use, showing ``training_state`` meanwhile (it picks streams and events)."""
        if training_state is _PRE_BACKWARD and not self.unshard_in_backward:
            return
        previous = self.training_state
        self.training_state = training_state
        try:
            self.unshard(self.unshard_async_op)
        finally:
            self.training_state = previous

    # ---- forward ---------------------------------------------------------------------------------

    def pre_forward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        entering = self.training_state is not _FORWARD
        self.training_state = _FORWARD
        self.unshard(self.unshard_async_op)
        self.wait_for_unshard()
        if entering and torch.is_grad_enabled():
            return register_post_backward(self, args, kwargs)
        return args, kwargs

    def post_forward(self) -> None:
        if in_backward_task_id() != -1:  # a forward re-run inside backward (checkpoint recompute)
            self.training_state = TrainingState.IDLE
            return
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            self.reshard()  # in FORWARD: follows reshard_after_forward
            order = self.comm_ctx.post_forward_order
            self._post_forward_indices.append(len(order))
            order.append(self)
        self.training_state = TrainingState.IDLE
        if not grad_enabled:
            # No backward can follow a no-grad forward: a full reshard (now IDLE), so model.parameters()
            # (an optimizer built now, a state dict) never sees unsharded tensors.
            self.reshard()

    # ---- backward --------------------------------------------------------------------------------

    def pre_backward(self, default_prefetch: bool) -> None:
        if self.training_state is _PRE_BACKWARD:
            return
        self.training_state = _PRE_BACKWARD
        if self.unshard_in_backward:
            self.unshard(self.unshard_async_op)
        self.wait_for_unshard()
        if default_prefetch and self._post_forward_indices:
            index = self._post_forward_indices.pop()
            if index > 0:
                self.comm_ctx.post_forward_order[index - 1].prefetch(_PRE_BACKWARD)

    def post_backward(self) -> None:
        """Reshard and reduce-scatter the gradients autograd left on the unsharded parameters."""
        self.training_state = TrainingState.POST_BACKWARD
        if not self.reduce_grads:
            # No-sync step: gradients stay unsharded (in reduce_dtype where one is set) and keep
            # accumulating until a step with gradient sync reduces their sum.
            for fsdp_param in self.fsdp_params:
                fsdp_param.stash_unsharded_grad()
            if self.reshard_after_backward:
                self.reshard()
            _events.record("post_backward", self.module_fqn, self.training_state)
            return
        reduced: list[FSDPParam] = []
        grads: list[torch.Tensor] = []
        for fsdp_param in self.fsdp_params:
            grad = fsdp_param.take_unsharded_grad()
            if grad is not None:
                reduced.append(fsdp_param)
                grads.append(grad)
        if self.reshard_after_backward:
            self.reshard()
        if grads:
            self._reduce(reduced, grads)
        _events.record("post_backward", self.module_fqn, self.training_state)

    def _reduce(self, params: list[FSDPParam], grads: list[torch.Tensor]) -> None:
        """One reduce-scatter per reduce dtype (normally exactly one), then assign sharded grads."""
        ctx = self.comm_ctx
        ctx.retire_reduce_scatters()
        buckets: dict[torch.dtype, tuple[list[FSDPParam], list[torch.Tensor]]] = {}
        for fsdp_param, grad in zip(params, grads, strict=True):
            dtype = fsdp_param.reduce_dtype or grad.dtype
            if fsdp_param.shard_dim != 0:
                grad = fsdp_param.dim0_grad(grad)
            bucket = buckets.get(dtype)
            if bucket is None:
                bucket = buckets[dtype] = ([], [])
            bucket[0].append(fsdp_param)
            bucket[1].append(grad)
        grads.clear()
        for dtype, (bucket_params, bucket_grads) in buckets.items():
            shard_numel = sum(p.padded_shard_numel for p in bucket_params)
            buffer = reduce_scatter_copy_in(bucket_grads, self.mesh_info.shard_size, dtype, shard_numel)
            bucket_grads.clear()  # free the unsharded gradients as soon as they are packed
            stream = ctx.reduce_scatter_stream if ctx.use_streams else None
            if stream is None:
                self._reduce_and_assign(buffer, bucket_params)
                continue
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._reduce_and_assign(buffer, bucket_params)
                event = stream.record_event()
            ctx.pending_reduce_scatters.append((buffer, event))
            self._post_reduce_event = event

    def _reduce_and_assign(self, buffer: torch.Tensor, params: list[FSDPParam]) -> None:
        info = self.mesh_info
        factors = self._factors(buffer.dtype)
        output = reduce_scatter(buffer, info.shard_group, info.shard_size, factors.op, factors.predivide)
        if info.replicate_group is not None:
            partial = self._partial_reduce_outputs.pop(buffer.dtype, None)
            if not self.all_reduce_grads:
                # HSDP without all-reduce: keep summing shard-reduced gradients until one that syncs.
                self._partial_reduce_outputs[buffer.dtype] = (
                    output if partial is None else partial.add_(output)
                )
                return
            if partial is not None:
                output.add_(partial)
            if info.replicate_size > 1:
                dist.all_reduce(output, op=factors.op, group=info.replicate_group)
        if self.all_reduce_hook is not None:
            self.all_reduce_hook(output)
        if factors.postdivide is not None:
            output.div_(factors.postdivide)
        views = view_out_shards(
            output,
            [p.padded_shard_numel for p in params],
            [p.local_numel for p in params],
            [p.local_shard_size for p in params],
        )
        for fsdp_param, view in zip(params, views, strict=True):
            if fsdp_param.accumulate_sharded_grad(view):
                self._offload_copies_in_flight = True

    def finalize_backward(self) -> None:
        """End of the last backward: drain a mis-targeted prefetch and forget forward indices."""
        result = self._all_gather_result
        if result is not None:
            wait_all_gather(result)
            self._all_gather_result = None
        if self._post_reduce_event is not None:
            if self._offload_copies_in_flight:
                # Non-blocking copies of offloaded gradients: the CPU optimizer reads them next.
                self._post_reduce_event.synchronize()
            torch.cuda.current_stream().wait_event(self._post_reduce_event)
            self._post_reduce_event = None
        self._offload_copies_in_flight = False
        self._post_forward_indices.clear()

    def reset(self) -> None:
        """Forget in-flight work after an aborted iteration and return to ``SHARDED``/``IDLE``.

        Unlike torch's, this also drops the unsharded gradients of groups whose post-backward never
        ran, so they cannot leak into the next step's reduction.
        """
        self.finalize_backward()
        for fsdp_param in self.fsdp_params:
            fsdp_param.take_unsharded_grad()
        self._partial_reduce_outputs.clear()
        self.training_state = TrainingState.IDLE
        self.reshard()

    def invalidate_divide_factors(self) -> None:
        """Recompute reduce ops and factors at the next reduction (after a setter changed them)."""
        self._divide_factors.clear()


def _as_bytes(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype``, viewed as bytes (for a group that gathers several dtypes at once)."""
    return (tensor if tensor.dtype == dtype else tensor.to(dtype)).view(torch.uint8)
