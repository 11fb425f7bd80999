"""What one root shares with every state under it, and where each iteration begins and ends.

Owns: ``RootContext``, one per root module (created by the root's lazy init, or earlier on demand by a
setter or ``share_comm_ctx`` on the root): the list of states under the root, the communication
context, the event scope, the ``Schedule`` of work across groups, the usage agreement, and the
iteration's flags. Its methods are the root's lazy init (``init_root``: validate with
``_root_init``, then ``adopt``) and the iteration's boundaries: beginning an iteration, finishing the
root's forward, a group's post-backward (skip, take, then the schedule reduces), queueing and running
the end-of-backward callback, and resetting after an error. Every state under the root holds one
reference to it (``ctx``); each group is handed the comm context and event scope (``attach``).
Every list of groups under the root is held here or in the schedule.
Does not own: hooks, casting, grouped passes (``FSDPState``), a group's own work (``FSDPParamGroup``).
States are described by a protocol here: ``_state`` builds on this module, not the reverse.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
from torch import nn

from ..base import MeshInfo, TrainingState, in_backward_task_id, queue_end_of_backward_callback
from ..comm import CommContext
from ..group import FSDPParamGroup, split_group
from ..param import LATE, check_late_parameters
from ..trace import RECORDING, EventScope, debug_enabled, record, run_root_init_hooks
from ._agreement import UseAgreement
from ._root_init import TreeState, state_device, validate_tree
from ._schedule import Schedule
from ._step_guard import groups_changed, watch_root

__all__ = ["RootContext"]

_IDLE = TrainingState.IDLE
_POST_BACKWARD = TrainingState.POST_BACKWARD


class _State(TreeState, Protocol):
    """What the root context asks of a ``fully_shard`` state (``_state.FSDPState``)."""

    modules_to_run: set[nn.Module]
    post_forward_indices: list[int]
    auto_reshard: bool
    eager_finish_backward: Any  # finish_backward, run eagerly (the end-of-backward callback)

    def set_state(self, new: TrainingState) -> None: ...
    def group_post_forward(self) -> None: ...
    def register_pre_backward_hooks(self, output: Any) -> Any: ...
    def cast_output(self, output: Any) -> Any: ...


class RootContext:
    """The shared objects and iteration flags of one root.

    Fields:
    - ``all_states``: every state under the root, in module order (the root first); set at its lazy init.
    - ``comm_ctx``: the side streams and in-flight buffers (shared by several roots after
      ``share_comm_ctx``); ``event_scope``: where ``record_events`` writes; ``schedule``: the
      execution orders, bucket plan and reduce-scatter queue.
    - ``iteration_root``: the state whose forward began the running iteration (``None`` between).
    - ``callback_queued``: the end-of-backward callback is queued (a backward is running).
    - ``is_last_backward``: the next backward ends the step (``set_is_last_backward``).
    - ``post_optim_event``: recorded after the optimizer step; the next all-gathers wait on it.
    - ``iterations``: how many iterations (forwards of the root) have begun; the debug mode names them.
    - ``use_agreement``: which parameters no rank used, agreed once per backward (``_agreement.py``).
    - ``kept``: the groups kept gathered (``keep_gathered``), each with the post-forward mesh it had.
    """

    def __init__(self) -> None:
        self.all_states: list[Any] = []
        self.comm_ctx = CommContext()
        self.event_scope = EventScope()
        self.schedule: Schedule[Any] = Schedule()
        self.iteration_root: Any = None
        self.callback_queued = False
        self.is_last_backward = True
        self.post_optim_event: torch.Event | None = None
        self.iterations = 0
        self.use_agreement = UseAgreement([])  # built at adoption (see _agreement.py)
        self.kept: dict[FSDPParamGroup, MeshInfo | None] = {}
        # optimizer -> which of this root's groups it steps (the step guard's cache, ``_step_guard``)
        self.stepped_groups: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = (
            weakref.WeakKeyDictionary()
        )

    def groups(self) -> list[FSDPParamGroup]:
        """Every group under the root, in module order (the root's first)."""
        return [group for state in self.all_states for group in state.groups]

    def init_root(self, root: _State) -> torch.device:
        """The root's lazy init (its first forward): validate everything, then adopt the states.

        Returns the device the root's groups compute on (CPU without groups).
        """
        states = validate_tree(root)  # raises before any change
        if root.auto_reshard:
            for group in root.groups:
                group.set_post_forward_mesh(None)  # the root keeps its parameters after forward
        device = state_device(states)
        self.adopt(root, states, device)
        if debug_enabled():
            run_root_init_hooks(root.modules[0], states)  # the divergence guard (``_guard``)
        return device

    def adopt(self, root: _State, states: list[Any], device: torch.device) -> None:
        """Root's lazy init, after validation: every state and group under ``root`` refers here."""
        for state in states:
            state.is_root = state is root
            state.ctx = self
            for group in state.groups:
                group.attach(self.comm_ctx, self.event_scope)
        self.comm_ctx.lazy_init(device)
        self.all_states = states
        self.use_agreement = UseAgreement(self.groups())
        watch_root(self)

    def keep_gathered(self, state: Any, group: FSDPParamGroup, params: list[Any]) -> FSDPParamGroup:
        """Keep ``params`` (frozen, some or all of ``group``'s) unsharded once gathered.

        All of them: ``group`` itself is kept. Some: they move into a group of their own over the same
        modules (``split_group``), which ``state`` takes in. The kept group keeps its parameters from
        forward to backward and its gathered storage after resharding; it gathers again when a shard
        changed (see [Note: A kept copy] in ``group/_unshard_buffer.py``).
        """
        group.release()  # idle: a full reshard (the split needs sharded parameters)
        kept = group
        if len(params) < len(group.fsdp_params):
            kept = split_group(group, params)
            state.add_group(kept)
            kept.attach(self.comm_ctx, self.event_scope)
            self.use_agreement = UseAgreement(self.groups())
            groups_changed()
        self.kept[kept] = kept.post_forward_mesh_info
        kept.set_post_forward_mesh(None)
        kept.controls.update(keep_gathered=True)
        return kept

    def release_kept(self) -> None:
        """Free every kept group's gathered copy (``model.reshard()`` on the root); kept from the next use."""
        for group in self.kept:
            group.release()

    def stop_keeping(self) -> None:
        """Free every kept group's gathered copy; they gather and reshard as any group from now on."""
        for group, post_forward_mesh in self.kept.items():
            group.controls.update(keep_gathered=False)
            group.release()
            group.set_post_forward_mesh(post_forward_mesh)
        self.kept.clear()

    # ---- forward ---------------------------------------------------------------------------------

    def begin_iteration(self, state: _State) -> None:
        """A state's first pre-forward of an iteration; raises (before any change) if the last one broke."""
        if self.callback_queued and in_backward_task_id() == -1:
            raise RuntimeError(
                "fsdp2: a forward started, but the previous backward never finished (an exception was "
                "raised during it?). FSDP is still mid-iteration: parameters may be left unsharded and "
                "the optimizer would silently stop updating them. Call reset_iter_state() on the root "
                "module (e.g. in the except block that caught the error) before the next forward."
            )
        if self.iteration_root is None:
            if LATE.pending:  # parameters registered since fully_shard (this or another thread)
                check_late_parameters()  # before any state changes
            self.iteration_root = state
            self.iterations += 1
            if RECORDING.on:  # else every recorder is closed: a stale capture records nothing
                self.event_scope.capture()
            self.schedule.begin_iteration()
            if self.comm_ctx.use_streams:  # the side streams wait for the optimizer step
                self.comm_ctx.wait_for_current_stream(self.post_optim_event)
            self.post_optim_event = None

    def finish_forward(self, root: _State, output: Any) -> Any:
        """The iteration root's post-forward: close grouped passes some member never ran, plan buckets."""
        for state in reversed(self.all_states):
            if state is root or not state.modules_to_run:
                continue
            state.group_post_forward()
            if torch.is_grad_enabled():
                output = state.register_pre_backward_hooks(output)
            state.set_state(_IDLE)
            state.modules_to_run.clear()
            output = state.cast_output(output)
        if self.comm_ctx.use_streams:
            self.comm_ctx.release_deferred_all_gather()
        self.iteration_root = None
        self.schedule.plan(backward=torch.is_grad_enabled())
        return output

    def abandon_forward(self) -> None:
        """The iteration root's forward raised: every group sharded again, every state ``IDLE``.

        Without this, ``state_dict()`` and ``named_parameters()`` would show the plain gathered tensors
        of the groups that forward had unsharded. Unlike ``reset``, gradients held from earlier
        micro-batches and the graphs of earlier forwards are kept: a group such a graph still needs
        gathers again in its backward. The forward's own entries in the post-forward order go.
        """
        start = self.schedule.abandon_iteration()
        for state in self.all_states:
            state.modules_to_run.clear()
            state.post_forward_indices[:] = [i for i in state.post_forward_indices if i < start]
            state.set_state(_IDLE)
            for group in state.groups:  # a pending (prefetched) all-gather is finished first
                group.wait_for_unshard()
                group.set_state(_IDLE)
                group.reshard()
        self.comm_ctx.release_deferred_all_gather()
        self.iteration_root = None

    # ---- backward --------------------------------------------------------------------------------

    def queue_end_of_backward(self, fallback: _State) -> None:
        """Queue the end-of-backward callback once per backward (on the root's state)."""
        if not self.callback_queued:
            self.callback_queued = True
            root = self.all_states[0] if self.all_states else fallback
            queue_end_of_backward_callback(root.eager_finish_backward)
            if self.use_agreement.members:
                self.use_agreement.begin_backward()

    def post_backward(self, group: FSDPParamGroup) -> None:
        """``group``'s post-backward: reshard, then the schedule reduces its gradients."""
        agreement = self.use_agreement
        skip = agreement.skip(group) if agreement.members and group.controls.reduce_grads else None
        taken = group.post_backward(skip)
        if taken is not None:
            self.schedule.reduce(group, *taken)
        if RECORDING.on:
            record("post_backward", group.module_fqn, group.training_state, group.event_scope)

    def finish_backward(self) -> None:
        """End of backward: post-backward for groups autograd never reached, then end the iteration."""
        self.iteration_root = None
        last = self.is_last_backward
        queue = self.schedule.bucketing.queue
        if self.schedule.bucketing.reduce_scatter_cap is not None or queue.pending:
            # Every post-backward first (those autograd never reached queue their gradients too), then
            # the queued reduce-scatters, and only then the waits of finalize_backward.
            for state in self.all_states:
                for group in state.groups:
                    if group.training_state is not _POST_BACKWARD:
                        self.post_backward(group)
            queue.flush(self.comm_ctx)
        for state in self.all_states:
            state.modules_to_run.clear()
            for group in state.groups:
                if group.training_state is not _POST_BACKWARD:
                    self.post_backward(group)  # autograd never reached it (inputs without gradients)
                group.finish_backward(last)
            if last:
                state.post_forward_indices.clear()
            state.set_state(_IDLE)
        if last:
            self.schedule.end_step()
            if self.comm_ctx.use_streams:
                self.comm_ctx.retire_reduce_scatters()
        self.callback_queued = False

    def reset(self, fallback: _State) -> None:
        """Recover from an exception in forward or backward (``reset_iter_state``)."""
        for state in self.all_states or [fallback]:
            state.modules_to_run.clear()
            state.post_forward_indices.clear()
            state.set_state(_IDLE)
            for group in state.groups:
                group.reset()
        self.comm_ctx.reset()
        self.schedule.reset()
        self.use_agreement.reset()
        self.iteration_root = None
        self.callback_queued = False
