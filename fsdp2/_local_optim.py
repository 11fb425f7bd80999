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
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ._dtensor import local_of, make_spec, spec_of, wrap_local

_PATCHED = "_fsdp2_local_step"


def local_step(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``optimizer.step()`` run on the local shards of its DTensor parameters; returns it.

    One line after building the optimizer::

        optimizer = fsdp2.local_step(torch.optim.AdamW(model.parameters(), lr=3e-4))

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
    if getattr(optimizer, _PATCHED, False):
        return optimizer
    original: Callable[..., Any] = optimizer.step
    swap = _on_local_shards(optimizer)

    @functools.wraps(original)
    def step(closure: Callable[[], Any] | None = None) -> Any:
        if closure is not None:
            raise ValueError("fsdp2.local_step does not support a closure; call step() without one.")
        with swap:
            return original()

    optimizer.step = step  # type: ignore[method-assign]  # reason: the documented wrapping
    setattr(optimizer, _PATCHED, True)
    return optimizer


class _on_local_shards:  # noqa: N801 - used as a context manager
    """Swap DTensor params, grads and state of ``optimizer`` for their local tensors, then back.

    One instance per optimizer, entered once per step. The DTensors wrapping state tensors are kept
    from step to step: optimizers update their state in place, so the same local tensor comes back
    and its wrapper is reused instead of rebuilding a DTensor (and its spec) per tensor per step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.groups: list[list[Any]] = []
        self.to_dtensor: dict[int, DTensor] = {}  # id(local param) -> DTensor param
        self.wrappers: dict[int, DTensor] = {}  # id(local state tensor) -> its DTensor, last step

    def __enter__(self) -> None:
        opt = self.optimizer
        state = opt.state
        self.groups = []
        self.to_dtensor = {}
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
                local.grad = local_of(grad) if _is_dtensor(grad) else grad
                self.to_dtensor[id(local)] = param
                saved = state.pop(param, None)
                if saved is not None:
                    state[local] = {k: local_of(v) if _is_dtensor(v) else v for k, v in saved.items()}
                local_params.append(local)
            group["params"] = local_params

    def __exit__(self, *exc: object) -> None:
        opt = self.optimizer
        state = opt.state
        previous, self.wrappers = self.wrappers, {}
        for group, params in zip(opt.param_groups, self.groups, strict=True):
            for local in group["params"]:
                param = self.to_dtensor.get(id(local))
                if param is None:
                    continue
                local.grad = None
                if local in state:
                    state[param] = {
                        k: self._wrap(v, param, local, previous) for k, v in state.pop(local).items()
                    }
            group["params"] = params

    def _wrap(self, value: Any, param: DTensor, local: torch.Tensor, previous: dict[int, DTensor]) -> Any:
        key = id(value)
        wrapper = previous.get(key)  # alive (and its id unique) while the wrapper holds it
        if wrapper is None or local_of(wrapper) is not value:
            if not _is_shard_state(value, local):
                return value
            wrapper = wrap_local(value, _like(spec_of(param), value))
        self.wrappers[key] = wrapper
        return wrapper


def _is_dtensor(value: Any) -> bool:
    return type(value) is DTensor or isinstance(value, DTensor)  # the first test is the fast path


def _is_shard_state(value: Any, local: torch.Tensor) -> bool:
    """A state tensor shaped like the parameter's shard (exp_avg, momentum, ...), not a scalar step."""
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == local.shape


def _like(spec: Any, value: torch.Tensor) -> Any:
    """``spec`` (the parameter's sharding) for a state tensor of ``value``'s dtype."""
    meta = spec.tensor_meta
    return make_spec(spec.mesh, spec.placements, meta.shape, meta.stride, value.dtype)
