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

    @functools.wraps(original)
    def step(closure: Callable[[], Any] | None = None) -> Any:
        if closure is not None:
            raise ValueError("fsdp2.local_step does not support a closure; call step() without one.")
        with _on_local_shards(optimizer):
            return original()

    optimizer.step = step  # type: ignore[method-assign]  # reason: the documented wrapping
    setattr(optimizer, _PATCHED, True)
    return optimizer


class _on_local_shards:  # noqa: N801 - used as a context manager
    """Swap DTensor params, grads and state of ``optimizer`` for their local tensors, then back."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.groups: list[list[Any]] = []
        self.to_dtensor: dict[int, DTensor] = {}  # id(local param) -> DTensor param

    def __enter__(self) -> None:
        opt = self.optimizer
        state = opt.state
        for group in opt.param_groups:
            params = group["params"]
            self.groups.append(params)
            local_params = []
            for param in params:
                if not isinstance(param, DTensor):
                    local_params.append(param)
                    continue
                local = local_of(param)
                grad = param.grad
                local.grad = local_of(grad) if isinstance(grad, DTensor) else grad
                self.to_dtensor[id(local)] = param
                if param in state:
                    saved = state.pop(param)
                    state[local] = {k: local_of(v) if isinstance(v, DTensor) else v for k, v in saved.items()}
                local_params.append(local)
            group["params"] = local_params

    def __exit__(self, *exc: object) -> None:
        opt = self.optimizer
        state = opt.state
        for group, params in zip(opt.param_groups, self.groups, strict=True):
            for local in group["params"]:
                param = self.to_dtensor.get(id(local))
                if param is None:
                    continue
                local.grad = None
                if local in state:
                    spec = spec_of(param)
                    state[param] = {
                        k: wrap_local(v, _like(spec, v)) if _is_shard_state(v, local) else v
                        for k, v in state.pop(local).items()
                    }
            group["params"] = params


def _is_shard_state(value: Any, local: torch.Tensor) -> bool:
    """A state tensor shaped like the parameter's shard (exp_avg, momentum, ...), not a scalar step."""
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == local.shape


def _like(spec: Any, value: torch.Tensor) -> Any:
    """``spec`` (the parameter's sharding) for a state tensor of ``value``'s dtype."""
    meta = spec.tensor_meta
    return make_spec(spec.mesh, spec.placements, meta.shape, meta.stride, value.dtype)
