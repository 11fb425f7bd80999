"""Optimizer steps on local shards: ``fsdp2.local_step(optimizer)``.

Owns: running a torch optimizer's ``step()`` on the plain local tensors of DTensor parameters (and of
their gradients and optimizer state), so the elementwise update pays no DTensor dispatch, while the
optimizer keeps DTensors in its ``param_groups`` and ``state`` the rest of the time: ``state_dict()``,
DCP's ``get_optimizer_state_dict`` and checkpoints see exactly what they would without it. Does not
own: the update rule (the optimizer's) or any collective (an elementwise optimizer needs none).
Invariants: outside ``step()`` the optimizer's parameters and state are the user's DTensors; only
elementwise optimizers are correct on shards (``torch.optim.Adam``, ``AdamW``, ``SGD`` and the like:
no norms or reshapes across the whole parameter).
"""

from __future__ import annotations

import functools
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from itertools import chain, compress, repeat
from operator import attrgetter, eq, is_, is_not
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor

from ..base import eager
from ..param import is_managed, local_of, locals_of, make_spec, spec_of, specs_of, wrap_local
from ..runtime import take_part

_GRAD = attrgetter("grad")
_PATCHED = "_fsdp2_local_step"
_UNPATCHED = "_fsdp2_step_before_local_step"


def local_step(optimizer: torch.optim.Optimizer, *, enabled: bool = True) -> torch.optim.Optimizer:
    """Make ``optimizer.step()`` run on the local shards of its DTensor parameters; returns it.

    torch's elementwise optimizers (Adam, AdamW, SGD, RMSprop, Adagrad, Adamax, NAdam, RAdam,
    Adadelta, ASGD; not subclasses) already do so from their second step on once ``fully_shard``
    has been called; this applies it from the first step, and to other elementwise optimizers::

        optimizer = fsdp2.local_step(MyAdam(model.parameters(), lr=3e-4))

    ``enabled=False`` keeps (or puts back) the DTensor path for this optimizer.

    The numbers are those of the DTensor path (the same elementwise update on the same values); only
    the DTensor dispatch per tensor and per op is saved. ``model.parameters()``, ``state_dict()``,
    ``optimizer.state_dict()`` and DCP are unchanged. Use it with elementwise optimizers only (Adam,
    AdamW, SGD, RMSprop, ...); an optimizer that needs whole-parameter quantities (a norm per
    parameter, as in LAMB or Shampoo) would compute them per shard.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"local_step expects a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    _seen.add(optimizer)  # the user decided: the automatic path leaves it alone
    if enabled:
        _patch(optimizer, strict=True)
    elif getattr(optimizer, _PATCHED, False):
        optimizer.__dict__[_PATCHED].remove_hooks()
        before = optimizer.__dict__.pop(_UNPATCHED)
        if before is None:  # the class's own step again
            del optimizer.__dict__["step"]
        else:
            optimizer.step = before  # type: ignore[method-assign]
        delattr(optimizer, _PATCHED)
    return optimizer


def _patch(optimizer: torch.optim.Optimizer, strict: bool) -> None:
    """Wrap ``optimizer.step`` (the instance attribute: LR schedulers' wrappers stay in the chain)."""
    if getattr(optimizer, _PATCHED, False):
        return
    optimizer.__dict__[_UNPATCHED] = optimizer.__dict__.get("step")  # None: the class's own
    step = _LocalStep(optimizer.step, _on_local_shards(optimizer), strict)
    optimizer.step = step  # type: ignore[method-assign]
    setattr(optimizer, _PATCHED, step)  # (an LR scheduler built later replaces optimizer.step)


class _LocalStep:
    """``optimizer.step`` on local shards.

    An object, not a closure: ``copy.deepcopy(optimizer)`` copies it along with the optimizer, so the
    copy steps itself, not the original (the hooks below are its bound methods: they are copied with it).

    [Note: Local shards inside the step hooks]
    The shards are swapped in by an optimizer step pre-hook that runs after every other pre-hook and
    swapped out by a post-hook that runs before every other post-hook (both are moved into place
    before each step), so torch's hooks around the update, global or the optimizer's own, see the
    DTensor parameters and state as they would without local steps. torchft's DiLoCo and LocalSGD
    sync in an inner optimizer's post-hook: the sync reads ``optimizer.state_dict()`` (to send it to
    a recovering replica) and steps an outer optimizer; with the shards still swapped in, the state
    dict raised ``KeyError`` (its state was keyed by DTensors its param groups no longer held).
    """

    def __init__(self, original: Callable[..., Any], swap: _on_local_shards, strict: bool) -> None:
        self.original = original  # the bound step (or an LR scheduler's wrapper of it)
        self.swap = swap
        self.strict = strict
        self.armed = False  # this call steps on local shards: the pre-hook swaps them in
        self.entered = False  # the shards are swapped in
        optimizer = swap.optimizer
        self.pre = optimizer.register_step_pre_hook(self._swap_in)
        self.post = optimizer.register_step_post_hook(self._swap_out)
        functools.update_wrapper(self, original)

    @property
    def __func__(self) -> Callable[..., Any]:
        """What an LR scheduler built after the patch wraps: a function that runs this local step.

        torch's ``LRScheduler`` counts steps by rebinding ``optimizer.step.__func__`` to the optimizer.
        """

        def step(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            return self(*args, **kwargs)

        return step

    def remove_hooks(self) -> None:
        """Leave the optimizer's step hooks as they were before the patch (``local_step(enabled=False)``)."""
        self.pre.remove()
        self.post.remove()

    @eager  # swaps the optimizer's lists and dicts: never traced (runs eagerly)
    def __call__(self, closure: Callable[[], Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        if closure is not None or args or kwargs:  # a closure re-runs forward and backward
            if self.strict and closure is not None:
                raise ValueError("fsdp2.local_step does not support a closure; call step() without one.")
            return self.original(closure, *args, **kwargs)
        optimizer = self.swap.optimizer
        # torch keeps each optimizer's step hooks in OrderedDicts (typed as dicts), called in order
        pre_hooks = optimizer._optimizer_step_pre_hooks  # noqa: SLF001 - no public way to order hooks
        post_hooks = optimizer._optimizer_step_post_hooks  # noqa: SLF001
        cast("OrderedDict[int, Any]", pre_hooks).move_to_end(self.pre.id)  # ours last
        cast("OrderedDict[int, Any]", post_hooks).move_to_end(self.post.id, last=False)  # ours first
        self.armed = True
        try:
            return self.original()
        finally:
            self.armed = False
            self._swap_out()  # the step raised: the post-hooks did not run

    def _swap_in(self, *hook_args: Any) -> None:
        if not self.armed:  # a step of the original (a closure), or one that bypassed this object
            return
        self.armed = False
        try:
            self.swap.__enter__()
        except _NotLocal:
            return  # e.g. a Partial gradient: the DTensor path reduces it
        self.entered = True

    def _swap_out(self, *hook_args: Any) -> None:
        if self.entered:
            self.entered = False
            self.swap.__exit__()


# Optimizers whose update is elementwise on each parameter (the same on a shard as on the whole):
# fsdp2 runs them on local shards by default. Anything else (LBFGS, subclasses, other libraries'
# optimizers) keeps the DTensor path unless the user calls local_step.
_ELEMENTWISE = {
    torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.RMSprop, torch.optim.Adagrad,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta, torch.optim.ASGD,
}  # fmt: skip
_seen: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_auto_hook: Any = None


def declare_elementwise(cls: type) -> None:
    """Step instances of ``cls`` on local shards from their second step on (``fsdp2.declare_optimizer``)."""
    _ELEMENTWISE.add(cls)


def is_elementwise(cls: type) -> bool:
    """Whether instances of exactly ``cls`` step on local shards automatically."""
    return cls in _ELEMENTWISE


def enable_automatic_local_steps() -> None:
    """Run torch's elementwise optimizers over DTensors on local shards from their second step on.

    Called by ``fully_shard``. ``FSDP2_LOCAL_STEP=0`` in the environment turns it off for every
    optimizer whose first step runs while it is set.
    """
    global _auto_hook
    if _auto_hook is None:
        _auto_hook = take_part(before=_first_step)


_other_kinds: list[Callable[[torch.optim.Optimizer, Any, Any], None]] = []


def decide_others_with(decide: Callable[[torch.optim.Optimizer, Any, Any], None]) -> None:
    """At the first step of an optimizer of another class than the elementwise ones, call ``decide``.

    How the whole-tensor path (``_whole_tensor``) takes its optimizers without a step hook of its own:
    a plain step enters no more files than before.
    """
    if decide not in _other_kinds:
        _other_kinds.append(decide)


def mark_decided(optimizer: torch.optim.Optimizer) -> None:
    """Take ``optimizer`` out of the automatic choice (the user's, or a shadow optimizer's)."""
    _seen.add(optimizer)


def _first_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # Runs before every step of every optimizer in the process: one set lookup once decided.
    if optimizer in _seen:
        return
    _seen.add(optimizer)
    if type(optimizer) not in _ELEMENTWISE:
        for decide in _other_kinds:
            decide(optimizer, args, kwargs)
        return
    if os.environ.get("FSDP2_LOCAL_STEP", "1") == "0":
        return
    if type(optimizer) not in _ELEMENTWISE or any(g.get("differentiable") for g in optimizer.param_groups):
        return
    dtensors = [p for g in optimizer.param_groups for p in g["params"] if _is_dtensor(p)]
    if dtensors and all(is_managed(p) for p in dtensors):  # only what fully_shard sharded
        _patch(optimizer, strict=False)  # this step runs as it began; the next ones on local shards


class _on_local_shards:  # noqa: N801 - used as a context manager
    """Swap DTensor params, grads and state of ``optimizer`` for their local tensors, then back.

    One instance per optimizer, entered once per step. The DTensor-keyed state stays in
    ``optimizer.state`` during the step, next to the local-keyed dicts the optimizer updates; on
    exit only what the step added or replaced is wrapped back.

    What does not change between steps is kept (see ``_GroupPlan`` and ``_Slot``): each group's list
    of local parameters and each parameter's local state dict. A kept item is reused only after
    identity checks against what the optimizer holds now (the params list, the parameter's local
    tensor, the gradient's spec, the state dict and each of its values), so a re-packed parameter,
    ``load_state_dict`` or a state value the user replaced between steps is picked up. Optimizers
    update their state in place, so after the first steps a group passes these checks as whole
    lists (``_GroupPlan.enter``, C-level loops) and only the gradients are handed over one by one;
    anything else takes the per-parameter path, which brings the plan up to date again.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.groups: list[list[Any]] = []  # each group's own params list, restored on exit
        self.entered: list[_GroupPlan] = []  # groups entered as a whole (fast path)
        self.swapped: list[_Slot] = []  # parameters entered one by one (slow path)
        self.plans: dict[int, _GroupPlan] = {}  # param_groups index -> what was built for it

    def __getstate__(self) -> dict[str, Any]:  # deepcopy / pickle: the copy rebuilds its plans
        return {"optimizer": self.optimizer, "groups": [], "entered": [], "swapped": [], "plans": {}}

    def __enter__(self) -> None:
        opt = self.optimizer
        self.groups = []
        self.entered = []
        self.swapped = []
        try:
            self._swap_in(opt)
        except _NotLocal:
            self.groups += [g["params"] for g in opt.param_groups[len(self.groups) :]]
            self.__exit__()
            raise

    def _swap_in(self, opt: torch.optim.Optimizer) -> None:
        state = opt.state
        for index, group in enumerate(opt.param_groups):
            params = group["params"]
            plan = self.plans.get(index)
            if plan is None or plan.params is not params or len(plan.slots) != len(params):
                plan = self.plans[index] = _GroupPlan(params)
            self.groups.append(params)
            if plan.enter(params, state):
                self.entered.append(plan)
            else:
                self._swap_in_one_by_one(plan, params, state)
            group["params"] = plan.locals

    def _swap_in_one_by_one(self, plan: _GroupPlan, params: list[Any], state: dict[Any, Any]) -> None:
        swapped = self.swapped.append
        found: list[Any] = []  # per DTensor parameter: its state dict as found (or None)
        has_grad: list[bool] = []
        for position, (param, slot) in enumerate(zip(params, plan.slots, strict=True)):
            if slot is None:
                continue  # a plain tensor: the optimizer steps it as it is
            local = slot.local
            if slot.param is not param or local_of(param) is not local:  # re-packed, replaced
                slot = plan.slots[position] = _Slot(param)
                local = plan.locals[position] = slot.local
            grad = param.grad
            if grad is not None and (type(grad) is DTensor or isinstance(grad, DTensor)):
                grad_spec, param_spec = spec_of(grad), spec_of(param)
                if grad_spec is not param_spec and grad_spec.placements != param_spec.placements:
                    raise _NotLocal  # e.g. a Partial (unreduced) gradient: its local is not the update
                grad = local_of(grad)
            local.grad = grad
            swapped(slot)
            has_grad.append(grad is not None)
            saved = state.get(param)
            found.append(saved)
            if saved is not None:  # an empty dict too: what the step adds to it is seen on exit
                values = slot.saved_values  # still mirrored: the same dict with the same values
                same = len(saved) == len(values) and saved is slot.saved
                if not (same and all(map(is_, saved.values(), values))):
                    slot.mirror(saved)
                state[local] = slot.local_state
        plan.snapshot(found, has_grad)

    def __exit__(self, *exc: object) -> None:
        opt = self.optimizer
        state = opt.state
        for plan in self.entered:
            if not plan.exit(state):
                _fold_back(plan.dslots, state)  # the step added or replaced state: wrap it back
        _fold_back(self.swapped, state)
        for group, params in zip(opt.param_groups, self.groups, strict=True):
            group["params"] = params


def _fold_back(slots: Iterable[_Slot], state: dict[Any, Any]) -> None:
    """Clear the local gradients and move the local-keyed state of ``slots`` back to their params."""
    pop = state.pop
    for slot in slots:
        local = slot.local
        local.grad = None
        updated = pop(local, None)
        if not updated:
            continue
        values = slot.local_values
        if (
            updated is slot.local_state
            and slot.saved is not None
            and len(updated) == len(values)
            and all(map(is_, updated.values(), values))
        ):
            continue  # the usual step: state updated in place, nothing to wrap back
        param = slot.param
        kept = state[param]
        for key, value in updated.items():
            current = kept.get(key)
            if current is value or (type(current) is DTensor and local_of(current) is value):
                continue  # updated in place: the DTensor already wraps it
            kept[key] = _wrapped(value, param, local)
        slot.saved = None  # the next step mirrors the folded-back state afresh


class _GroupPlan:
    """One param group: its local parameters list, as handed to the optimizer during a step.

    After a per-parameter pass (``snapshot``) it also records, as flat tuples, everything the next
    step checks by identity: the params, their local tensors and specs, which of them had a
    gradient, and the DTensor-keyed and local state dicts with their values (``None`` where a
    parameter has no state: SGD without momentum, a parameter not stepped yet). While all of these
    still hold, ``enter`` and ``exit`` swap the whole group with C-level loops over the tuples.
    """

    __slots__ = (
        "dlocals", "dparams", "dslots", "expected", "fast", "grad_mask", "local_states", "local_values",
        "locals", "params", "saved", "saved_values", "slots", "specs", "state_lens", "state_mask", "taken",
    )  # fmt: skip

    def __init__(self, params: list[Any]) -> None:
        self.params = params  # the user's list: the plan stands while it is this list
        self.slots = [_Slot(p) if _is_dtensor(p) else None for p in params]
        self.locals = [p if slot is None else slot.local for p, slot in zip(params, self.slots, strict=True)]
        self.fast = False
        self.taken: tuple[Any, ...] = ()

    def snapshot(self, found: list[Any], has_grad: list[bool]) -> None:
        """Record the group as the per-parameter pass left it: the fast path's reference.

        ``found``: each DTensor parameter's state dict as the pass found it (``None`` if absent);
        ``has_grad``: whether it had a gradient.
        """
        dslots = tuple(slot for slot in self.slots if slot is not None)
        self.taken = tuple(self.params)
        self.dslots = dslots
        self.dparams = tuple(slot.param for slot in dslots)
        self.dlocals = tuple(slot.local for slot in dslots)
        self.specs = tuple(specs_of(self.dparams))
        self.grad_mask = tuple(has_grad)
        self.saved = tuple(found)  # compared by identity: None, an empty dict, a mirrored dict
        self.state_mask = tuple(saved is not None for saved in found)  # mirrored into local state
        with_state = tuple(compress(dslots, self.state_mask))
        # Entries per mirrored state dict: the DTensor-keyed dict and its local mirror have the same keys.
        self.state_lens = tuple(len(slot.saved_values) for slot in with_state)
        self.saved_values = tuple(chain.from_iterable(slot.saved_values for slot in with_state))
        self.local_states = tuple(slot.local_state for slot in with_state)
        self.local_values = tuple(chain.from_iterable(slot.local_values for slot in with_state))
        # What exit expects to take out under each local key: the mirror, or nothing at all.
        self.expected = tuple(
            slot.local_state if mirrored else None
            for slot, mirrored in zip(dslots, self.state_mask, strict=True)
        )
        self.fast = True

    def enter(self, params: list[Any], state: dict[Any, Any]) -> bool:
        """Swap the whole group in if nothing changed since ``snapshot``; ``False``: nothing done."""
        if not (self.fast and len(params) == len(self.taken) and all(map(is_, params, self.taken))):
            return False
        dparams, dlocals = self.dparams, self.dlocals
        if not all(map(is_, locals_of(dparams), dlocals)):
            return False  # re-packed or re-loaded shards
        all_grads = tuple(map(_GRAD, dparams))
        mask = self.grad_mask
        if tuple(map(is_not, all_grads, repeat(None))) != mask:
            return False  # a parameter gained or lost its gradient
        grads = tuple(compress(all_grads, mask))
        # Every gradient is a DTensor laid out like its parameter (fsdp2 builds it on the same spec).
        if not all(map(is_, map(type, grads), repeat(DTensor))):
            return False
        if not all(map(is_, specs_of(grads), compress(self.specs, mask))):
            return False
        saved: tuple[Any, ...] = tuple(map(state.get, dparams))
        if not all(map(is_, saved, self.saved)):
            return False  # state loaded, created, replaced or deleted between steps
        with_state = tuple(compress(saved, self.state_mask))
        if not (
            all(map(eq, map(len, with_state), self.state_lens))
            and all(map(is_, chain.from_iterable(map(dict.values, with_state)), self.saved_values))
        ):
            return False  # a state value replaced, added or removed between steps
        for local, grad in zip(compress(dlocals, mask), locals_of(grads), strict=True):
            local.grad = grad
        state.update(zip(compress(dlocals, self.state_mask), self.local_states, strict=True))
        return True

    def exit(self, state: dict[Any, Any]) -> bool:
        """Clear the local gradients and take the local state out; ``False``: it changed shape."""
        dlocals = self.dlocals
        for local in dlocals:
            local.grad = None
        pop = state.pop
        updated: tuple[Any, ...] = tuple(pop(local, None) for local in dlocals)
        if all(map(is_, updated, self.expected)):  # no state created for a parameter without one
            with_state = tuple(compress(updated, self.state_mask))
            if all(map(eq, map(len, with_state), self.state_lens)) and all(
                map(is_, chain.from_iterable(map(dict.values, with_state)), self.local_values)
            ):
                return True  # updated in place, as optimizers do: the DTensors already wrap it
        state.update((key, value) for key, value in zip(dlocals, updated, strict=True) if value is not None)
        self.fast = False  # _fold_back wraps the new values; the next step mirrors them afresh
        return False


class _Slot:
    """One DTensor parameter: its local tensor and the local mirror of its optimizer state."""

    __slots__ = ("local", "local_state", "local_values", "param", "saved", "saved_values")

    def __init__(self, param: DTensor) -> None:
        self.param = param
        self.local = local = local_of(param)
        grad_dtype = param.grad_dtype  # e.g. fp32 gradients of bf16 weights: the local takes them too
        if grad_dtype != local.grad_dtype:
            local.grad_dtype = grad_dtype
        self.saved: dict[str, Any] | None = None  # the DTensor-keyed state dict last mirrored
        self.saved_values: tuple[Any, ...] = ()
        self.local_state: dict[str, Any] = {}
        self.local_values: tuple[Any, ...] = ()

    def mirror(self, saved: dict[str, Any]) -> None:
        """Take ``saved`` (the DTensor-keyed state) as the state to mirror with local tensors.

        Raises ``_NotLocal`` (nothing changed) for a state DTensor not laid out like the parameter,
        e.g. a ``Partial`` buffer the DTensor path made from a ``Partial`` gradient: its local tensor
        is not this shard's state.
        """
        param_spec = spec_of(self.param)
        for value in saved.values():
            if _is_dtensor(value):
                spec = spec_of(value)
                if spec is not param_spec and not _same_layout(spec, param_spec):
                    raise _NotLocal
        self.saved = saved
        self.saved_values = tuple(saved.values())
        self.local_state = {k: local_of(v) if _is_dtensor(v) else v for k, v in saved.items()}
        self.local_values = tuple(self.local_state.values())


def _same_layout(spec: Any, param_spec: Any) -> bool:
    """Whether a state DTensor's local tensor is the parameter's shard (same mesh, placements, shape)."""
    return bool(
        spec.placements == param_spec.placements
        and spec.tensor_meta.shape == param_spec.tensor_meta.shape
        and spec.mesh == param_spec.mesh
    )


def _wrapped(value: Any, param: DTensor, local: torch.Tensor) -> Any:
    """A state value the step added or replaced, as the DTensor-keyed state holds it."""
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == local.shape:
        return wrap_local(value, _like(spec_of(param), value))  # shaped like the shard: exp_avg, ...
    return value  # a scalar step count, a Python number


class _NotLocal(Exception):  # noqa: N818 - control flow, never escapes this module
    """This step cannot run on local shards."""


def _is_dtensor(value: Any) -> bool:
    return type(value) is DTensor or isinstance(value, DTensor)  # the first test is the fast path


def _like(spec: Any, value: torch.Tensor) -> Any:
    """``spec`` (the parameter's sharding) for a state tensor of ``value``'s dtype."""
    meta = spec.tensor_meta
    return make_spec(spec.mesh, spec.placements, meta.shape, meta.stride, value.dtype)
