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
from collections.abc import Callable
from operator import is_
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ._autograd import eager
from ._dtensor import local_of, make_spec, spec_of, wrap_local
from ._param import is_managed

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
    optimizer.step = _LocalStep(optimizer.step, _on_local_shards(optimizer), strict)  # type: ignore[method-assign]
    setattr(optimizer, _PATCHED, True)


class _LocalStep:
    """``optimizer.step`` on local shards.

    An object, not a closure: ``copy.deepcopy(optimizer)`` copies it along with the optimizer, so the
    copy steps itself, not the original.
    """

    def __init__(self, original: Callable[..., Any], swap: _on_local_shards, strict: bool) -> None:
        self.original = original  # the bound step (or an LR scheduler's wrapper of it)
        self.swap = swap
        self.strict = strict
        functools.update_wrapper(self, original)

    @eager  # swaps the optimizer's lists and dicts: never traced (runs eagerly)
    def __call__(self, closure: Callable[[], Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        if closure is not None or args or kwargs:  # a closure re-runs forward and backward
            if self.strict and closure is not None:
                raise ValueError("fsdp2.local_step does not support a closure; call step() without one.")
            return self.original(closure, *args, **kwargs)
        try:
            self.swap.__enter__()
        except _NotLocal:
            return self.original()  # e.g. a Partial gradient: the DTensor path reduces it
        try:
            return self.original()
        finally:
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


def enable_automatic_local_steps() -> None:
    """Run torch's elementwise optimizers over DTensors on local shards from their second step on.

    Called by ``fully_shard``; ``FSDP2_LOCAL_STEP=0`` in the environment turns it off.
    """
    global _auto_hook
    if _auto_hook is not None or os.environ.get("FSDP2_LOCAL_STEP", "1") == "0":
        return
    _auto_hook = register_optimizer_step_pre_hook(_first_step)


@eager  # reads the optimizer's lists and patches it: never traced
def _first_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # Runs before every step of every optimizer in the process: one set lookup once decided.
    if optimizer in _seen:
        return
    _seen.add(optimizer)
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

    What does not change between steps is kept (see ``_Slot``): each group's list of local
    parameters and each parameter's local state dict. A kept item is reused only after identity
    checks against what the optimizer holds now (the params list, the parameter's local tensor, the
    state dict and each of its values), so a re-packed parameter, ``load_state_dict`` or a state
    value the user replaced between steps is picked up. Optimizers update their state in place, so
    after the first step a parameter costs a few identity checks and dict operations.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.groups: list[list[Any]] = []  # each group's own params list, restored on exit
        self.swapped: list[_Slot] = []  # the DTensor parameters of this step
        self.plans: dict[int, _GroupPlan] = {}  # param_groups index -> what was built for it

    def __getstate__(self) -> dict[str, Any]:  # deepcopy / pickle: the copy rebuilds its plans
        return {"optimizer": self.optimizer, "groups": [], "swapped": [], "plans": {}}

    def __enter__(self) -> None:
        opt = self.optimizer
        self.groups = []
        self.swapped = []
        try:
            self._swap_in(opt)
        except _NotLocal:
            self.groups += [g["params"] for g in opt.param_groups[len(self.groups) :]]
            self.__exit__()
            raise

    def _swap_in(self, opt: torch.optim.Optimizer) -> None:
        # The hot loop of every step: identity checks and dict writes per parameter.
        state = opt.state
        swapped = self.swapped.append
        for index, group in enumerate(opt.param_groups):
            params = group["params"]
            self.groups.append(params)
            plan = self.plans.get(index)
            if plan is None or plan.params is not params or len(plan.slots) != len(params):
                plan = self.plans[index] = _GroupPlan(params)
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
                saved = state.get(param)
                if saved:
                    values = slot.saved_values  # still mirrored: the same dict with the same values
                    if not (
                        len(saved) == len(values)
                        and all(map(is_, saved.values(), values))
                        and saved is slot.saved
                    ):
                        slot.mirror(saved)
                    state[local] = slot.local_state
            group["params"] = plan.locals

    def __exit__(self, *exc: object) -> None:
        opt = self.optimizer
        state = opt.state
        pop = state.pop
        for slot in self.swapped:
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
        for group, params in zip(opt.param_groups, self.groups, strict=True):
            group["params"] = params


class _GroupPlan:
    """One param group's local parameters list, as handed to the optimizer during a step."""

    __slots__ = ("locals", "params", "slots")

    def __init__(self, params: list[Any]) -> None:
        self.params = params  # the user's list: the plan stands while it is this list
        self.slots = [_Slot(p) if _is_dtensor(p) else None for p in params]
        self.locals = [p if slot is None else slot.local for p, slot in zip(params, self.slots, strict=True)]


class _Slot:
    """One DTensor parameter: its local tensor and the local mirror of its optimizer state."""

    __slots__ = ("local", "local_state", "local_values", "param", "saved", "saved_values")

    def __init__(self, param: DTensor) -> None:
        self.param = param
        self.local = local_of(param)
        self.saved: dict[str, Any] | None = None  # the DTensor-keyed state dict last mirrored
        self.saved_values: tuple[Any, ...] = ()
        self.local_state: dict[str, Any] = {}
        self.local_values: tuple[Any, ...] = ()

    def mirror(self, saved: dict[str, Any]) -> None:
        self.saved = saved
        self.saved_values = tuple(saved.values())
        self.local_state = {k: local_of(v) if _is_dtensor(v) else v for k, v in saved.items()}
        self.local_values = tuple(self.local_state.values())


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
