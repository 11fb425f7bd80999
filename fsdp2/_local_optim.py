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
    ``optimizer.state`` during the step, next to the local-keyed views the optimizer updates; on
    exit only what the step added or replaced is wrapped back. Optimizers update their state in
    place, so after the first step a parameter costs a few dict operations, no DTensor construction.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.groups: list[list[Any]] = []  # each group's own params list, restored on exit
        self.swapped: list[tuple[DTensor, torch.Tensor]] = []  # (DTensor param, its local tensor)

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
        state = opt.state
        swapped = self.swapped
        for group in opt.param_groups:
            params = group["params"]
            self.groups.append(params)
            local_params = []
            for param in params:
                if not _is_dtensor(param):
                    local_params.append(param)
                    continue
                local = local_of(param)
                grad = param.grad
                if grad is not None and _is_dtensor(grad):
                    grad_spec, param_spec = spec_of(grad), spec_of(param)
                    if grad_spec is not param_spec and grad_spec.placements != param_spec.placements:
                        group["params"] = local_params + params[len(local_params) :]
                        raise _NotLocal  # e.g. a Partial (unreduced) gradient: its local is not the update
                    grad = local_of(grad)
                local.grad = grad
                swapped.append((param, local))
                saved = state.get(param)
                if saved:
                    state[local] = {k: local_of(v) if _is_dtensor(v) else v for k, v in saved.items()}
                local_params.append(local)
            group["params"] = local_params

    def __exit__(self, *exc: object) -> None:
        opt = self.optimizer
        state = opt.state
        for param, local in self.swapped:
            local.grad = None
            updated = state.pop(local, None)
            if updated:
                _write_back(state[param], updated, param, local)
        for group, params in zip(opt.param_groups, self.groups, strict=True):
            group["params"] = params


def _write_back(kept: dict[str, Any], updated: dict[str, Any], param: DTensor, local: torch.Tensor) -> None:
    """Fold the step's local state into the DTensor-keyed state: only new or replaced entries."""
    for key, value in updated.items():
        current = kept.get(key)
        if current is value or (type(current) is DTensor and local_of(current) is value):
            continue  # updated in place: the DTensor already wraps it
        kept[key] = (
            wrap_local(value, _like(spec_of(param), value)) if _is_shard_state(value, local) else value
        )


class _NotLocal(Exception):  # noqa: N818 - control flow, never escapes this module
    """This step cannot run on local shards."""


def _is_dtensor(value: Any) -> bool:
    return type(value) is DTensor or isinstance(value, DTensor)  # the first test is the fast path


def _is_shard_state(value: Any, local: torch.Tensor) -> bool:
    """A state tensor shaped like the parameter's shard (exp_avg, momentum, ...), not a scalar step."""
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == local.shape


def _like(spec: Any, value: torch.Tensor) -> Any:
    """``spec`` (the parameter's sharding) for a state tensor of ``value``'s dtype."""
    meta = spec.tensor_meta
    return make_spec(spec.mesh, spec.placements, meta.shape, meta.stride, value.dtype)
