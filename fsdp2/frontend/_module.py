"""``FSDPModule``: the class mixed into every module passed to ``fully_shard`` (or ``replicate``).

Owns: the dynamic ``FSDP<Name>`` and ``Replicate<Name>`` classes (cached per original class), the
``FSDPModule`` methods (unshard/reshard and every setter), ``ReplicateModule`` and ``UnshardHandle``;
the setters' argument checks are ``_setter_checks.py``'s. Most methods translate the call into
``FSDPState``/``FSDPParamGroup`` fields or calls; two setters also communicate:
``set_separate_reduce_scatter_group`` creates a process group per shard group, and
``set_bucket_cap_mb("auto")`` measures collectives to choose the caps (``_autocap``). Does not own:
hooks, or the collectives of a step.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import ReplicateModule as TorchReplicateModule
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from ..base import KeptBuffers, TrainingState
from ..comm import (
    AllGather,
    DefaultAllGather,
    DefaultReduceScatter,
    ProcessGroupAllocAllGather,
    ProcessGroupAllocReduceScatter,
    ReduceScatter,
    SymmMemAllGather,
    SymmMemReduceScatter,
    check_symmetric_memory,
)
from ..group import FSDPParamGroup
from ..runtime import (
    BucketCaps,
    CapMB,
    CapMBOrUnset,
    FSDPState,
    choose_caps,
    drop_held_gradients,
    get_state,
    read_caps,
)
from ._setter_checks import (
    ArgumentTypeError,
    NotShardedError,
    UnknownBackendError,
    check_comm_type,
    checked_divide_factor,
    describe,
    refuse_custom,
    refuse_ordered_conflicts,
)

_class_cache: dict[tuple[type, type], type] = {}  # the dynamic classes, per (mixin, original class)
_class_lock = threading.Lock()


def fsdp_class(cls: type) -> type:
    """The cached ``FSDP<Name>`` subclass of ``(FSDPModule, cls)``."""
    return _mixed_class(FSDPModule, "FSDP", cls)


def replicate_class(cls: type) -> type:
    """The cached ``Replicate<Name>`` subclass of ``(ReplicateModule, cls)``."""
    return _mixed_class(ReplicateModule, "Replicate", cls)


def _mixed_class(mixin: type, prefix: str, cls: type) -> type:
    key = (mixin, cls)
    mixed = _class_cache.get(key)
    if mixed is None:
        with _class_lock:
            mixed = _class_cache.get(key)
            if mixed is None:
                mixed = type(f"{prefix}{cls.__name__}", (mixin, cls), {"__deepcopy__": _deepcopy})
                _class_cache[key] = mixed
    return mixed


_deepcopy_impl: Callable[[nn.Module, dict[int, Any]], nn.Module] | None = None


def set_deepcopy_impl(impl: Callable[[nn.Module, dict[int, Any]], nn.Module]) -> None:
    """Install how ``copy.deepcopy`` copies an FSDP module (``_copy.py`` does, at package import)."""
    global _deepcopy_impl
    _deepcopy_impl = impl


def _deepcopy(self: nn.Module, memo: dict[int, Any]) -> nn.Module:
    if _deepcopy_impl is None:
        raise RuntimeError(f"copy.deepcopy of {type(self).__name__} needs the fsdp2 package imported.")
    return _deepcopy_impl(self, memo)


class UnshardHandle:
    """Handle for ``FSDPModule.unshard(async_op=True)``; ``wait()`` makes the parameters usable."""

    def wait(self) -> None:
        """Nothing to wait for (a module with no parameters)."""


class _GroupUnshardHandle(UnshardHandle):
    def __init__(self, groups: list[FSDPParamGroup]) -> None:
        self._groups = groups

    def wait(self) -> None:
        """Finish the all-gathers and register the unsharded parameters (idempotent)."""
        for group in self._groups:
            group.wait_for_unshard()
        self._groups = []


if TYPE_CHECKING:
    _ModuleBase = nn.Module
    _ReplicateBase = nn.Module
else:
    # torch's class is a base so that code testing isinstance(m, torch.distributed.fsdp.FSDPModule)
    # (pipelining, torchtitan, accelerate, transformers) sees fsdp2 modules as FSDP modules. Every
    # method of torch's class is overridden below: none of torch's engine runs.
    _ModuleBase = TorchFSDPModule
    # The same for replicate(): torch's ReplicateModule (a subclass of its FSDPModule that adds no
    # method) comes after fsdp2's FSDPModule in the MRO, so fsdp2's methods win.
    _ReplicateBase = TorchReplicateModule


def is_torch_fsdp_module(module: nn.Module) -> bool:
    """Whether ``module`` is an instance of torch's ``FSDPModule`` (fsdp2's modules are too)."""
    return isinstance(module, TorchFSDPModule)


def original_class(cls: type) -> type:
    """The user's class under ``FSDP<Name>``: the first base that is not an FSDP mixin."""
    return next(c for c in cls.__mro__ if not issubclass(c, TorchFSDPModule))


class FSDPModule(_ModuleBase):
    """Mixin added to every module passed to ``fully_shard`` (as ``FSDP<Name>``).

    A subclass of ``torch.distributed.fsdp.FSDPModule``, so libraries that recognise FSDP modules by
    torch's class treat fsdp2 modules as such; every public method is fsdp2's own.
    """

    # Where torch's code looks for the original class in the MRO: FSDP<Name>, this, torch's, <Name>.
    _orig_cls_mro_index = 3

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Constructing FSDP<Name> (e.g. Sequential slicing calls type(self)(...)) builds the original
        # class: the new module has not been through fully_shard.
        instance: Any = object.__new__(original_class(cls))
        instance.__init__(*args, **kwargs)
        return instance

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickle / torch.save(model) / copy.copy: a sharded module holds shards bound to process groups.
        raise TypeError(
            f"A fully_shard module ({type(self).__name__}) cannot be pickled (torch.save(model), pickle, "
            "copy.copy): its parameters are shards bound to this job's process groups. Save its "
            "state_dict() (or use torch.distributed.checkpoint, or fsdp2.save_full_state_dict for one "
            "file of full weights) and rebuild, fully_shard and load it; copy.deepcopy(model) makes a "
            "sharded copy in this job."
        )

    def _get_fsdp_state(self) -> FSDPState:
        return require_state(self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, and also drop gradients held by no-sync backwards (not yet reduced).

        On the unsharded model they would be cleared too; otherwise the next synced backward would
        still sum them in. ``optimizer.zero_grad()`` does the same for the groups of its parameters.
        """
        super().zero_grad(set_to_none)
        for module in self._fsdp_modules(True):
            drop_held_gradients(list(require_state(module).groups))  # what optimizer.zero_grad does

    def _single_group(self, method: str) -> FSDPParamGroup | None:
        """This module's only group (``None`` without parameters); ambiguous with per-parameter meshes."""
        groups = self._get_fsdp_state().groups
        if len(groups) > 1:
            raise ValueError(
                f"{method} is ambiguous for {type(self).__name__}: shard_placement_fn put its parameters on "
                f"{len(groups)} meshes, each with its own collectives. Use one mesh for this module, or "
                "fully_shard the parameters of each mesh in a submodule of their own."
            )
        return groups[0] if groups else None

    def _set_controls(self, recurse: bool, **values: Any) -> None:
        """Set group controls on this module's groups (and its FSDP descendants' with ``recurse``)."""
        for module in self._fsdp_modules(recurse):
            require_state(module).set_controls(**values)

    def _fsdp_modules(self, recurse: bool) -> list[FSDPModule]:
        if not recurse:
            return [self]
        return [m for m in self.modules() if isinstance(m, FSDPModule)]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters (not its FSDP children's) ahead of use.

        Args:
            async_op: return a handle at once; its ``wait()`` (or the next forward) finishes the unshard.

        Returns:
            An :class:`UnshardHandle` if ``async_op``, else ``None`` once the parameters are registered.
        """
        state = self._get_fsdp_state()
        groups = state.groups
        if not groups:
            return UnshardHandle() if async_op else None
        schedule = state.ctx.schedule if state.ctx is not None else None  # None before the first forward
        for group in groups:  # each lazy-initializes first if it is not
            if schedule is not None:
                schedule.unshard(group, async_op)
            else:
                group.unshard(async_op)
        handle = _GroupUnshardHandle(groups)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's unsharded parameters and register the sharded ones.

        On the root, also the copies ``fsdp2.keep_frozen_gathered`` kept of any group under it.
        """
        self._get_fsdp_state().release()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward ends the step (waits for reductions, drops prefetch state)."""
        self._get_fsdp_state().shared_context().is_last_backward = is_last_backward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Reduce-scatter gradients after backward (``True``) or accumulate them unsharded locally."""
        self._set_controls(recurse, reduce_grads=requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` (bool only); also stops the root's automatic choice."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"reshard_after_forward should be a bool, got {describe(reshard_after_forward)}."
            )
        modules = self._fsdp_modules(recurse)
        for module in modules:
            if any(group.mesh_info.replicate_only for group in require_state(module).groups):
                raise NotShardedError(
                    f"set_reshard_after_forward: {type(module).__name__} replicates its parameters without "
                    "sharding them (DataParallelMeshDims(replicate=...) only), so there is nothing to "
                    "reshard after forward. Call it with recurse=False on the sharded modules instead."
                )
        for module in modules:
            state = require_state(module)
            state.auto_reshard = False
            for group in state.groups:
                group.set_post_forward_mesh(group.mesh_info if reshard_after_forward else None)
            state.set_controls(reshard_after_no_grad_forward=reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Keep parameters unsharded after backward (``False``), e.g. across accumulation steps."""
        self._set_controls(recurse, reshard_after_backward=reshard_after_backward)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: all-reduce across replicas after the reduce-scatter (``False`` accumulates locally)."""
        groups = [g for m in self._fsdp_modules(recurse) for g in require_state(m).groups]
        refuse_ordered_conflicts(groups, "set_requires_all_reduce", all_reduce=requires_all_reduce)
        self._set_controls(recurse, all_reduce_grads=requires_all_reduce)

    def set_deterministic_reduction(self, enabled: bool = True, *, recurse: bool = True) -> None:
        """Sum each sharded gradient over every rank by a pairwise tree fixed by global rank order.

        Bit-for-bit reproducible: the result no longer depends on bucketing, prefetch or reshard
        settings, the backend or the run; FSDP on N ranks and HSDP on R x N/R agree when N/R is a power
        of two. Costs an all-to-all instead of the reduce-scatter (and, for HSDP, an all-to-all and an
        all-gather of shard-sized chunks across replicas instead of the all-reduce) and
        ``ceil(log2 N)`` local adds; see docs/precision.md, "Reproducible reductions".
        """
        if not isinstance(enabled, bool):
            raise TypeError(f"set_deterministic_reduction expects a bool, got {describe(enabled)}.")
        groups = [g for m in self._fsdp_modules(recurse) for g in require_state(m).groups]
        refuse_ordered_conflicts(groups, "set_deterministic_reduction", deterministic=enabled)
        self._set_controls(recurse, deterministic_reduction=enabled)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's summed gradients by ``factor`` instead of the number of ranks.

        Not recursive. Works on every backend: gradients are pre-scaled by ``1/factor`` and summed.
        """
        self._set_controls(False, gradient_divide_factor=checked_divide_factor(factor))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated alias of :meth:`set_gradient_divide_factor`."""
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor.",
            FutureWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Use only SUM collectives, dividing explicitly afterwards (not recursive)."""
        self._set_controls(False, force_sum_reduction=enable)

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: torch.Stream | None = None
    ) -> None:
        """Run ``hook(reduced_output)`` on each reduced gradient buffer of this module.

        The hook runs after the reduce-scatter (and the HSDP all-reduce), before the post-division
        and the cast back to the parameter dtype. It runs on the reduce-scatter stream, or on
        ``stream`` where given (CUDA): that stream first waits for the reduction, and the
        post-division waits for the hook's work on it.
        """
        value: object = hook
        if value is not None and not callable(value):
            raise TypeError(
                f"set_all_reduce_hook expects a callable hook(reduced_output) (or None for no hook), got "
                f"{describe(hook)}."
            )
        group = self._single_group("set_all_reduce_hook")
        if group is None:
            return
        if stream is not None and group.mesh_info.is_hsdp:
            raise ValueError("set_all_reduce_hook: stream cannot be set when using native HSDP.")
        if stream is not None and not isinstance(stream, (torch.Stream, torch.cpu.Stream)):
            raise TypeError(
                f"set_all_reduce_hook: stream must be a torch.Stream (e.g. a torch.cuda.Stream), got "
                f"{type(stream).__name__}; leave it None to run the hook where the gradients are reduced."
            )
        group.controls.update(all_reduce_hook=hook, all_reduce_hook_stream=stream)

    def set_post_optim_event(self, event: torch.Event) -> None:
        """Root only: the next forward's all-gathers wait on ``event`` instead of the whole stream.

        ``None`` goes back to waiting on the stream.
        """
        value: object = event
        if value is not None and not isinstance(value, (torch.Event, torch.cuda.Event)):
            raise TypeError(
                "set_post_optim_event expects a torch.Event recorded after the optimizer step (or None), "
                f"got {describe(event)}."
            )
        self._get_fsdp_state().shared_context().post_optim_event = event

    # ---- collectives -----------------------------------------------------------------------------

    def set_custom_all_gather(self, comm: AllGather) -> None:
        """Run this module's all-gathers through ``comm`` (not recursive).

        ``comm.allocate`` provides the output buffer and ``comm(output, input, group, async_op)`` runs the
        collective; see :class:`AllGather`. Not used when the shard group has a single rank.
        """
        check_comm_type(comm, "all_gather")
        group = self._single_group("set_custom_all_gather")
        if group is not None:
            group.comms.all_gather = comm
            group.comms.custom = True

    def set_custom_reduce_scatter(self, comm: ReduceScatter) -> None:
        """Run this module's gradient reduce-scatters through ``comm`` (not recursive).

        ``comm.allocate`` provides the input and output buffers and ``comm(output, input, group, op)``
        runs the collective; see :class:`ReduceScatter`. Not used when the shard group has one rank.
        """
        check_comm_type(comm, "reduce_scatter")
        group = self._single_group("set_custom_reduce_scatter")
        if group is not None:
            refuse_ordered_conflicts([group], "set_custom_reduce_scatter", custom=True)
            group.comms.reduce_scatter = comm
            group.comms.custom = True

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Take collective buffers from the process group's own allocator where it has one (not recursive).

        With NCCL this allows zero-copy transfers (e.g. SHARP); backends without an allocator (gloo)
        fall back to ordinary buffers. Cannot be combined with ``set_custom_all_gather`` /
        ``set_custom_reduce_scatter``.
        """
        groups = self._get_fsdp_state().groups
        for group in groups:
            refuse_custom(group, "set_allocate_memory_from_process_group_for_comm")
        for group in groups:
            if enable:
                shard_group = group.mesh_info.shard_group
                group.comms.all_gather = ProcessGroupAllocAllGather(shard_group)
                group.comms.reduce_scatter = ProcessGroupAllocReduceScatter(shard_group)
            else:
                group.comms.all_gather = DefaultAllGather()
                group.comms.reduce_scatter = DefaultReduceScatter()

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> None:
        """Take collective buffers from CUDA symmetric memory, so NCCL can use its optimized kernels.

        Needs CUDA and NCCL (a ``RuntimeError`` elsewhere); cannot be combined with custom collectives.
        Not recursive.
        """
        value: object = backend
        if not isinstance(value, str):
            raise ArgumentTypeError(
                f"set_symm_mem_for_comm: backend must be the str 'NCCL', got {describe(value)}."
            )
        if value != "NCCL":
            raise UnknownBackendError(f"set_symm_mem_for_comm supports backend='NCCL' only, got {value!r}.")
        groups = self._get_fsdp_state().groups
        for group in groups:
            refuse_custom(group, "set_symm_mem_for_comm")
            check_symmetric_memory(group.device, backend)
        for group in groups:
            shard_group = group.mesh_info.shard_group
            group.comms.all_gather = SymmMemAllGather(shard_group, backend)
            group.comms.reduce_scatter = SymmMemReduceScatter(shard_group, backend)

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Reduce zero gradients for parameters that got no gradient in this backward.

        Needed when ranks use different parameters (conditional control flow, mixture of experts): every
        rank then issues the same reduce-scatter instead of mismatched ones.
        """
        self._set_controls(recurse, reduce_scatter_unused_params=reduce_scatter_unused_params)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many reduce-scatter input buffers may be in flight at once (CUDA; default 1).

        More buffers let the next copy-in proceed while an exposed reduce-scatter is still running, at
        the cost of the retained buffers' memory. No effect without side streams (CPU).
        """
        value: object = max_input_buffers
        if isinstance(value, bool) or not isinstance(value, int):
            raise ArgumentTypeError(
                f"max_input_buffers must be a positive int (a bool is not one), got {describe(value)}."
            )
        if value < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {describe(max_input_buffers)}.")
        self._set_controls(recurse, reduce_scatter_max_input_buffers=max_input_buffers)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Give gradient reduce-scatters a process group of their own (``False`` goes back to sharing).

        With its own communicator a reduce-scatter can progress while a backward all-gather runs. Creating
        the group is collective: call this on every rank of the mesh, in the same order.
        """
        created: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for module in self._fsdp_modules(recurse):
            for group in require_state(module).groups:
                if not enable:
                    group.comms.reduce_scatter_group = None
                    continue
                ranks = tuple(dist.get_process_group_ranks(group.mesh_info.shard_group))
                if ranks not in created:
                    created[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
                group.comms.reduce_scatter_group = created[ranks]

    def set_bucket_cap_mb(self, all_gather: CapMB = None, reduce_scatter: CapMBOrUnset = ...) -> BucketCaps:
        """Root only: let consecutive small groups share one all-gather / one reduce-scatter.

        Applies to every group under this root (the ``reduce_scatter`` cap also lets consecutive
        ``replicate`` groups share one all-reduce); ``None`` (the default) keeps one collective per
        group. Consecutive groups in execution order whose all-gather outputs fit in
        ``all_gather`` MiB together are gathered by one collective when the first of them unshards (from
        the second iteration on: the first one records the order). Post-backwards pack their gradients
        and wait until the packed bytes reach ``reduce_scatter`` MiB, or backward ends, then one
        reduce-scatter serves them all. Each element is reduced as without bucketing (bit-identical
        unless the backend's summation order depends on the buffer, as gloo's does beyond 2 ranks:
        last-bit differences). Groups that cannot share a collective (another process group or dtype,
        HSDP for reduce-scatters, custom collectives, all-gather extensions, tensor parallelism, an int
        ``reshard_after_forward``) keep their own. See docs/performance.md, "Bucketing small groups".

        ``"auto"`` measures the process group the groups all-gather and reduce-scatter on (the shard
        group) with their own collectives, fits ``seconds = latency + bytes / bandwidth``, takes the
        slowest rank's fit and sets the cap to 4 latencies' worth of bytes, within [1, 256] MiB. The
        measurement is collective: with ``"auto"``, call this on every rank of the mesh at the same
        point, as ``fully_shard`` itself. See docs/performance.md, "Automatic caps".

        Args:
            all_gather: cap in MiB of one bucketed all-gather's output, ``None`` or ``"auto"``.
            reduce_scatter: cap in MiB of one bucketed reduce-scatter's input, ``None`` or ``"auto"``.
                Not given: ``"auto"`` if ``all_gather`` is ``"auto"`` (``set_bucket_cap_mb("auto")``
                sets both), else ``None``.

        Returns:
            The caps now in effect, in bytes, with the measurement each ``"auto"`` cap came from.

        Raises:
            ValueError: a cap that is not ``None``, ``"auto"`` or a positive finite number.
            RuntimeError: called on a module that is not the root, or during a forward or backward.
        """
        requests = read_caps(all_gather, reduce_scatter)
        state = self._get_fsdp_state()
        if state.is_root is False or len(state.modules) > 1:
            raise RuntimeError(
                f"set_bucket_cap_mb must be called on the root fully_shard module (the one whose forward "
                f"runs first), not on {type(self).__name__}: the caps apply to every group under the root."
            )
        ctx = state.shared_context()
        busy = ctx.iteration_root is not None or ctx.callback_queued
        if busy or state.training_state is not TrainingState.IDLE:
            raise RuntimeError(
                "set_bucket_cap_mb cannot change the caps during a forward or backward; call it between "
                "training steps (e.g. after optimizer.step())."
            )
        caps = choose_caps(requests, [g for m in self._fsdp_modules(True) for g in require_state(m).groups])
        ctx.schedule.set_caps(caps.all_gather, caps.reduce_scatter)
        return caps

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Skip this module's all-gather in backward when its parameters are not needed there."""
        self._set_controls(False, unshard_in_backward=unshard_in_backward)

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """Issue the pre-forward / pre-backward all-gathers as async ops on the current stream.

        Recursive. Allocations then stay on the compute stream; overlap needs explicit prefetching
        (:meth:`unshard`). No effect without side streams (CPU).
        """
        if not isinstance(async_op, bool):
            raise TypeError(f"_set_unshard_async_op expects a bool, got {describe(async_op)}.")
        self._set_controls(True, unshard_async_op=async_op)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Unshard ``modules`` right after this module's own unshard in forward (replaces the list)."""
        self._get_fsdp_state().forward_prefetch = _prefetch_states(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Unshard ``modules`` right after this module's own unshard in backward.

        A non-empty list replaces this module's default backward prefetch.
        """
        self._get_fsdp_state().backward_prefetch = _prefetch_states(
            modules, "set_modules_to_backward_prefetch"
        )

    def reset_iter_state(self) -> None:
        """Root only: clear per-iteration state after an exception in forward or backward."""
        state = self._get_fsdp_state()
        if state.is_root is False:
            raise RuntimeError(
                f"reset_iter_state must be called on the root module, not on {type(self).__name__}."
            )
        state.reset_iteration()

    def to_empty(self, *, device: torch.device | str | int | None, recurse: bool = True) -> Any:
        """``nn.Module.to_empty``; non-persistent buffers keep their values or are marked unset.

        See [Note: Non-persistent buffers and to_empty] in ``base/_buffers.py``.
        """
        return KeptBuffers(self, recurse).around(
            lambda: super(FSDPModule, self).to_empty(device=device, recurse=recurse)
        )

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # Conversions (.to, to_empty, .double()) act on the sharded parameters, then re-pad them.
        self.reshard()
        result = super()._apply(*args, **kwargs)  # type: ignore[no-untyped-call]  # reason: untyped in torch
        with torch.no_grad():
            for group in self._get_fsdp_state().groups:
                group.readopt_sharded_params()
        return result


class ReplicateModule(FSDPModule, _ReplicateBase):
    """Mixin added to every module passed to ``replicate`` (as ``Replicate<Name>``).

    fsdp2's :class:`FSDPModule` (its methods act on the module's replicated parameters) and torch's
    ``ReplicateModule`` from ``torch.distributed._composable.replicate_with_fsdp``, so ``isinstance``
    checks for either of torch's classes (pipelining's among them) see fsdp2's replicated modules.
    """

    # Replicate<Name>, this, fsdp2's FSDPModule, torch's ReplicateModule, torch's FSDPModule, <Name>.
    _orig_cls_mro_index = 5


def require_state(module: Any) -> FSDPState:
    state = get_state(module)
    if state is None:
        raise RuntimeError(f"{type(module).__name__} has no fully_shard state")
    return state


def _prefetch_states(modules: Any, method: str) -> list[FSDPState]:
    if not isinstance(modules, (list, tuple)):
        # torch iterates what it is given: not iterable is a TypeError there, an iterable of other
        # things (a str) a ValueError.
        error = ValueError if hasattr(modules, "__iter__") else ArgumentTypeError
        raise error(f"{method} expects a list of FSDPModule, got {describe(modules)}.")
    states = []
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(
                f"{method} expects FSDPModule entries (modules passed to fully_shard), got "
                f"{type(module).__name__}. Call fully_shard on it first, or drop it from the list."
            )
        states.append(require_state(module))
    return states
