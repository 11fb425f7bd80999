"""Per-call state: the hooks, and the forward and backward of one ``fully_shard`` call.

Owns: ``FSDPState`` (one per ``fully_shard`` call, attached to each of its root modules), its forward
pre/post hooks (and their dispatch to ``compile/``'s traced side while dynamo traces), input and
output casts, the pre-backward tensor hooks on outputs, post-backward registration, explicit and
default prefetch targets, and grouped passes over several modules. Its hooks ask the root's context
and its ``Schedule`` for every gather and reduction; they never call a group's collectives.
Does not own: parameters or collectives (its groups), the root's lazy init, what the states under one
root share and the iteration's begin and end (``RootContext``, ``_root.py``, ``_root_init.py``), the
execution orders and bucket plan (``Schedule``, ``_schedule.py``).
Invariants: the root's lazy init validates everything before it changes anything, then makes every
state under it refer to the root's one ``RootContext`` (none exists before, except one a setter or
``share_comm_ctx`` asked for on the root); the final callback runs once per backward that reached an
FSDP pre-backward hook; every training-state change is checked against ``_lifecycle.ALLOWED``.

[Note: Prefetch order]
Every post-forward of a state with a group (that a backward may use) appends the state to the
schedule's post-forward order and remembers its index (one per forward use). A pre-backward without
an explicit prefetch list pops its latest index ``i`` and unshards the state at ``i - 1``: the module
that ran just before it in forward runs just after it in backward. Explicit lists replace that
default.

[Note: Bucket plan]
With an all-gather cap (``set_bucket_cap_mb``), the iteration root's post-forward splits this
iteration's execution order into buckets (``Schedule.plan``, kept by the schedule per group): forward
uses the order in which pre-forwards ran (the order of the forward all-gathers); backward uses the
reversed post-forward order restricted to groups that all-gather again in backward
(``reshard_after_forward=True`` and ``unshard_in_backward``). The plan made at the end of one forward
serves that iteration's backward and the next forward, so the first forward runs unbucketed (a
forward without gradients replans forward only). A state that ran more than once in a forward stands
alone. Reduce-scatters need no plan: the root's queue takes post-backwards as they come and is
flushed by the end-of-backward callback.

[Note: Partial grouped pass]
A state over several modules (``fully_shard([norm, head])``) opens a pass at the first member's
pre-forward and closes it (reshard, pre-backward hooks on the output) when every member has run.
Some passes never close: a chunked loss runs ``norm`` inside the model's forward (that pass is closed
by the iteration root's post-forward) and then calls ``head`` alone once per chunk. The first such
call opens a pass and becomes the iteration root; the later calls find the group still unsharded and
gather nothing. The pass ends in backward: its post-backward node (on the first call's input) moves
the state through ``PRE_BACKWARD`` without prefetching, then reduces the gradients of all the chunks
at once. The end-of-backward callback clears the unfinished member set and the iteration root.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from ..base import (
    ALLOWED,
    MixedPrecisionPolicy,
    ShardedState,
    TrainingState,
    cast_floating,
    eager,
    in_backward_task_id,
    move_to_device,
    register_post_backward,
    register_pre_backward,
    route_untracked_outputs,
    transition,
    warn_user,
)
from ..comm import CommContext
from ..compile import TRACING, recover, traced_post_forward, traced_pre_forward
from ..group import FSDPParamGroup
from ._root import RootContext
from ._root_init import STATE_ATTR
from ._state_dict import register_state_dict_hooks
from ._torch_protocol import TorchStateNames

_FORWARD = TrainingState.FORWARD
_PRE_BACKWARD = TrainingState.PRE_BACKWARD
_IDLE = TrainingState.IDLE


def get_state(module: nn.Module) -> FSDPState | None:
    """The ``FSDPState`` attached to ``module`` by ``fully_shard``, if any."""
    state: FSDPState | None = module.__dict__.get(STATE_ATTR)
    return state


def states_under(root: nn.Module) -> list[FSDPState]:
    """The fully_shard states of ``root``'s tree, deepest first (the order they were applied)."""
    depth = {module: name.count(".") + (1 if name else 0) for name, module in root.named_modules()}
    seen: dict[int, FSDPState] = {}
    for module in root.modules():
        state = get_state(module)
        if state is not None and id(state) not in seen:
            seen[id(state)] = state
    return sorted(seen.values(), key=lambda s: -max(depth.get(m, 0) for m in s.modules))


def busy(states: list[FSDPState]) -> bool:
    """Whether any of ``states`` (or their groups) is inside a forward or backward."""
    idle = TrainingState.IDLE
    return any(
        s.training_state is not idle or any(g.training_state is not idle for g in s.groups) for s in states
    )


class FSDPState(TorchStateNames):
    """Hooks and lifecycle of one ``fully_shard`` call (also answers torch's private state names)."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        groups: list[FSDPParamGroup],
        auto_reshard: bool,
        mp_policy: MixedPrecisionPolicy,
    ) -> None:
        self.modules = modules
        # One group per distinct mesh (normally one; several with per-parameter meshes), none without
        # parameters. All of them unshard, reshard and reduce together for this state's modules.
        self.groups = groups
        # dtypes forward inputs / outputs are cast to (None: leave them)
        self._input_dtype = mp_policy.param_dtype if mp_policy.cast_forward_inputs else None
        self.output_dtype = mp_policy.output_dtype
        self._input_device: torch.device | None = None  # set at lazy init for accelerator roots
        self.auto_reshard = auto_reshard  # reshard_after_forward=None: the root keeps its parameters
        self.training_state = _IDLE
        self.is_root: bool | None = None  # None until the root's lazy init decides
        # The root's context, handed down by its lazy init; before it only a root may hold its own
        # (created on demand by a setter or share_comm_ctx), which its lazy init then shares.
        self.ctx: RootContext | None = None
        self.post_forward_indices: list[int] = []  # positions in the schedule's post-forward order
        self._post_backward = eager(self._run_group_post_backward)
        self.forward_prefetch: list[FSDPState] = []
        self.backward_prefetch: list[FSDPState] = []
        self.modules_to_run: set[nn.Module] = set()  # grouped calls: members yet to finish this pass
        self.foreign_ignored: list[torch.Tensor] = []  # ignored_params outside this call's modules
        self.hook_handles: list[Any] = []  # every hook fsdp2 registered (hidden while deep-copying)
        self.api = "fully_shard"  # the call that built it: "fully_shard" or "replicate"
        self.shard_args: dict[str, Any] = {}  # that call's keyword arguments, to rebuild a deep copy
        self.nested = False  # a later fully_shard call's modules contain this one's (see _compiled.py)
        self.descendants: list[FSDPState] = []  # the states under this one's modules, if it is top-level
        self.recover_handles: list[Any] = []  # a top-level module's hook for a compiled forward that raised
        self._pre_backward_hook = self._make_pre_backward_hook()
        self._pre_backward_node_hook = eager(self._pre_backward_on_node)
        self.eager_finish_backward = eager(self.finish_backward)
        for module in modules:
            module.__dict__[STATE_ATTR] = self
            if len(modules) == 1:
                pre, post = self.pre_forward, self.post_forward
            else:
                pre, post = self._grouped_pre_forward(module), self._grouped_post_forward(module)
            # FSDP hooks mutate storages and module registrations: torch.compile runs them eagerly
            # (a graph break at each FSDP module), except under a compiled root (see _compiled.py).
            pre, post = _forward_hooks(self, pre, post)
            self.hook_handles.append(module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True))
            self.hook_handles.append(module.register_forward_hook(post, always_call=len(modules) > 1))
            self.recover_handles.append(module.register_forward_hook(_recovery(self), always_call=True))
            self.hook_handles.append(self.recover_handles[-1])
            for group in groups:
                # state_dict / load_state_dict always see (and write) the sharded parameters.
                self.hook_handles.extend(register_state_dict_hooks(module, group, get_state))

    def mark_nested(self) -> None:
        """Mark this state as under a later ``fully_shard`` call's modules, dropping its recovery hook.

        Its hooks are traced inside that module's forward frame, whose edits are all or nothing.
        """
        self.nested = True
        for handle in self.recover_handles:
            handle.remove()
        self.recover_handles.clear()

    def __str__(self) -> str:
        return f"{self.api} state of {', '.join(type(m).__name__ for m in self.modules)}"

    def set_state(self, new: TrainingState) -> None:
        if new not in ALLOWED[self.training_state]:
            transition(self.training_state, new, self)  # raises
        self.training_state = new

    def set_controls(self, **values: Any) -> None:
        """Set run-time controls (``GroupControls`` fields) on each of this state's groups."""
        for group in self.groups:
            group.controls.update(**values)

    def add_group(self, group: FSDPParamGroup) -> None:
        """Take in ``group`` (split from one of this state's by the root context)."""
        self.groups.append(group)
        for module in self.modules:
            self.hook_handles.extend(register_state_dict_hooks(module, group, get_state))

    def shared_context(self) -> RootContext:
        """The context shared under this state's root; a not-yet-initialized root creates its own."""
        if self.ctx is None:
            self.ctx = RootContext()
        return self.ctx

    @property
    def comm_ctx(self) -> CommContext | None:
        return self.ctx.comm_ctx if self.ctx is not None else None

    def shared_comm_context(self) -> CommContext:
        """The communication context under this state's root (created on demand, see ``shared_context``)."""
        return self.shared_context().comm_ctx

    # ---- lazy init -------------------------------------------------------------------------------

    def release(self) -> None:
        """``reshard()``: free its groups' unsharded parameters; on the root also every kept copy."""
        for group in self.groups:
            group.release()
        if self.is_root:
            self.shared_context().release_kept()

    def lazy_init(self) -> None:
        """Make this state the root of its module tree (first forward only; see ``RootContext.init_root``)."""
        if self.is_root is not None:
            return
        device = self.shared_context().init_root(self)
        if device.type != "cpu":
            self._input_device = device

    # ---- forward hooks ---------------------------------------------------------------------------

    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, Any]:
        groups = self.groups
        if self.training_state is _PRE_BACKWARD and in_backward_task_id() != -1:
            # Activation-checkpoint recompute inside backward: parameters must be unsharded, nothing else.
            schedule = self.shared_context().schedule
            for group in groups:
                schedule.unshard(group)
            for group in groups:
                group.wait_for_unshard()
            args, kwargs = self.cast_inputs(args, kwargs)
            return args, kwargs
        first = self.training_state is not _FORWARD
        if first:
            ctx = self._root_pre_forward()  # may raise (first-forward validation): no state set before it
            if ctx.iteration_root is self and self._input_device is not None and (args or kwargs):
                args, kwargs = move_to_device((args, kwargs), self._input_device)
        self.set_state(_FORWARD)
        args, kwargs = self.cast_inputs(args, kwargs)
        schedule = self.shared_context().schedule
        if groups:
            entering = groups[0].training_state is not _FORWARD
            if entering and schedule.bucket_gathers:
                schedule.record_pre_forward(self)
            for group in groups:
                if group.controls.keep_gathered:
                    schedule.refresh(group)
                group.pre_forward()
                schedule.use(group)
            if entering and torch.is_grad_enabled():
                args, kwargs = register_post_backward(self._post_backward, args, kwargs)
        if first:
            for target in self.forward_prefetch:
                for target_group in target.groups:
                    schedule.prefetch(target_group, _FORWARD)
        return args, kwargs

    def _root_pre_forward(self) -> RootContext:
        if self.is_root is None:
            self.lazy_init()
        ctx = self.shared_context()
        if ctx.iteration_root is None or ctx.callback_queued:
            ctx.begin_iteration(self)
        return ctx

    def post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if self.training_state is _PRE_BACKWARD:
            return self.cast_output(output)
        self.group_post_forward()
        if torch.is_grad_enabled():
            output = self.register_pre_backward_hooks(output, args)
        self.set_state(_IDLE)
        ctx = self.ctx
        if ctx is not None and ctx.iteration_root is self:
            output = ctx.finish_forward(self, output)
        return self.cast_output(output)

    def group_post_forward(self) -> None:
        """The group's post-forward; a forward that backward may use is appended to the shared order."""
        ctx = self.ctx
        recorded = [group.post_forward() for group in self.groups]
        if any(recorded) and ctx is not None:
            self.post_forward_indices.append(ctx.schedule.record_post_forward(self))

    def cast_inputs(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """Forward inputs cast per the policy (``cast_forward_inputs``)."""
        if self._input_dtype is None:
            return args, kwargs
        cast: tuple[Any, Any] = cast_floating((args, kwargs), self._input_dtype)
        return cast

    def cast_output(self, output: Any) -> Any:
        return output if self.output_dtype is None else cast_floating(output, self.output_dtype)

    def _grouped_pre_forward(self, module: nn.Module) -> Any:
        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
            if not self.modules_to_run and self.training_state is not _PRE_BACKWARD:
                self.modules_to_run.update(self.modules)
            return self.pre_forward(mod, args, kwargs)

        return hook

    def _grouped_post_forward(self, module: nn.Module) -> Any:
        def hook(mod: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if self.training_state is _PRE_BACKWARD or mod not in self.modules_to_run:
                return self.cast_output(output)
            self.modules_to_run.discard(mod)
            if self.modules_to_run:
                return self.cast_output(output)
            return self.post_forward(mod, args, output)

        return hook

    # ---- backward --------------------------------------------------------------------------------

    def register_pre_backward_hooks(self, output: Any, inputs: Any = None) -> Any:
        """Hook ``output``'s tensors that require grad; returns ``output`` (rerouted under torch.func).

        ``inputs``: the forward's arguments (``None``: unknown), read only for an output that is a view.
        """
        hook = self._pre_backward_hook
        bases = None if inputs is None else functools.partial(_input_bases, inputs)
        for tensor in _tensors_requiring_grad(output):
            if not register_pre_backward(tensor, hook, self._pre_backward_node_hook, bases):
                warn_user(_fragile_view_message(self))
        return route_untracked_outputs(hook, output)

    def _pre_backward_on_node(self, grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        self.pre_backward()

    def _make_pre_backward_hook(self) -> Any:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            self.pre_backward()
            return grad

        return eager(hook)

    def _run_group_post_backward(self) -> None:
        # Called by the post-backward autograd node; dispatches through the group instances.
        if self.modules_to_run and self.training_state is _FORWARD:
            # A grouped pass some members never ran (see [Note: Partial grouped pass]): it ends here.
            self.modules_to_run.clear()
            self.pre_backward(prefetch=False)
        ctx = self.shared_context()
        for group in self.groups:
            ctx.post_backward(group)

    def pre_backward(self, prefetch: bool = True) -> None:
        self.set_state(_PRE_BACKWARD)
        ctx = self.shared_context()
        if not ctx.callback_queued:
            ctx.queue_end_of_backward(self)
        schedule = ctx.schedule
        entered = False
        for group in self.groups:
            if group.pre_backward():
                entered = True
                schedule.use(group)
        if not prefetch:
            return
        if entered and not self.backward_prefetch:
            self._default_backward_prefetch(ctx)
        for target in self.backward_prefetch:
            for target_group in target.groups:
                schedule.prefetch(target_group, _PRE_BACKWARD)

    def _default_backward_prefetch(self, ctx: RootContext) -> None:
        """Unshard the group whose forward ran just before this one's latest (see [Note: Prefetch order])."""
        if not self.post_forward_indices:
            return
        before = ctx.schedule.ran_before(self.post_forward_indices.pop())
        if before is not None:
            for target in before.groups:
                ctx.schedule.prefetch(target, _PRE_BACKWARD)

    def finish_backward(self) -> None:
        """Final callback (on the root's state): see ``RootContext.finish_backward``."""
        self.shared_context().finish_backward()

    def reset_iteration(self) -> None:
        """Root only: recover from an exception in forward or backward."""
        self.shared_context().reset(self)


def _input_bases(inputs: Any) -> set[int]:
    """Ids of the forward's input tensors and of their bases.

    An input routed through the post-backward node is a view of the caller's tensor.
    """
    found: set[int] = set()
    for tensor in _tensors_requiring_grad(inputs):
        found.add(id(tensor))
        if tensor._base is not None:  # noqa: SLF001 - no public API for a view's base
            found.add(id(tensor._base))  # noqa: SLF001
    return found


def _fragile_view_message(state: FSDPState) -> str:
    names = ", ".join(f"{g.module_fqn or '<root>'!r}" for g in state.groups) or "?"
    # fully_shard's class swap makes X an FSDPX(FSDPModule, X): name the user's class
    user_classes = (
        c.__bases__[-1] if c.__name__ == f"FSDP{c.__bases__[-1].__name__}" else c
        for c in map(type, state.modules)
    )
    classes = ", ".join(c.__name__ for c in user_classes)
    return (
        f"The fully_shard module {names} ({classes}) returned a view of a tensor without an autograd "
        "node (a parameter or another leaf, or under a torch.func transform). Out-of-place use of it is "
        "harmless (out = out + y, a loss, .float()), but an in-place op on it before backward (out += y, "
        "out.mul_(y)) would drop FSDP's pre-backward hook, so backward would run without gathering the "
        "module's parameters. Return a non-view tensor (e.g. .clone()) from its forward."
    )


def _forward_hooks(state: FSDPState, pre: Any, post: Any) -> tuple[Any, Any]:
    """The forward hooks of ``state``'s module: eager ``pre`` / ``post``, or their traced side.

    While dynamo traces a top-level module (a whole model compiled), the traced side puts the
    collectives in the graph (``compile/``); eagerly, and for a block compiled alone, the eager hooks
    run, excluded from tracing (a graph break at each FSDP module, as with torch's ``fully_shard``).
    """
    eager_pre, eager_post = eager(pre), eager(post)

    def pre_hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():
            traced = traced_pre_forward(state, args, kwargs)
            if traced is not None:
                return traced
        return eager_pre(module, args, kwargs)

    def post_hook(module: nn.Module, args: Any, output: Any) -> Any:
        if TRACING.top and torch.compiler.is_dynamo_compiling():
            return traced_post_forward(state, output)
        return eager_post(module, args, output)

    return pre_hook, post_hook


def _recovery(state: FSDPState) -> Any:
    """A top-level module's ``always_call`` forward hook: after a forward that raised, reshard.

    Traced (compiled) forwards and eager ones leave different things behind; after a forward that
    succeeded both checks find nothing to do. An eager forward that raised (outside backward) leaves
    ``state`` the root of an iteration that never finished: the root context shards every group again.
    """

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_dynamo_compiling():
            return
        if TRACING.top:  # a compiled forward raised after its traced pre-forward (see compile/)
            recover(state)
        ctx = state.ctx
        if ctx is not None and ctx.iteration_root is state and in_backward_task_id() == -1:
            ctx.abandon_forward()

    return hook


def _tensors_requiring_grad(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    found: list[torch.Tensor] = []
    stack = [output]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.requires_grad:
                found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            stack.extend(reversed([getattr(item, f.name) for f in dataclasses.fields(item)]))
    return found


__all__ = ["FSDPState", "ShardedState", "get_state"]
