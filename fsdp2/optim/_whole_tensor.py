"""Whole-tensor optimizer steps over shards: each parameter's update computed once, on one owner rank.

Owns: which optimizers need whole tensors (``torch.optim.Muon`` and ``torch.optim.Adafactor``, and
classes declared with ``declare_optimizer``), ``whole_tensor_step`` (one optimizer instance), the
one-time warning for an optimizer fsdp2 does not know to be right on shards, and the owner step
([Note: The owner step]). Does not own: the update rule (the optimizer's own ``step``, run on whole
plain tensors), the local-shard step (``_local_optim``), the step guard (``runtime``), the bytes
layout of one exchange (``_owner_exchange``).

[Note: The owner step]
Before the optimizer's own step (a pre-step participant that joins after the step guard), for the
parameters ``fully_shard`` sharded that have a gradient, per shard process group:

1. owners: each parameter goes to one rank of its shard group, the most work first to the least
   loaded rank (work: ``m * n * min(m, n)`` for a matrix, the cost of a Newton-Schulz iteration;
   the element count otherwise), the same choice on every rank;
2. to the owners: one all-to-all moves each rank's rows of the gradient, the parameter and every
   parameter-shaped state tensor to the owner, which concatenates them into whole tensors;
3. the owner runs the optimizer's own ``step`` on those whole plain tensors, through a shadow
   instance of the same class with the same hyperparameters: the operations of the unsharded model;
4. back: one all-to-all gives each rank its rows of the parameter and of each parameter-shaped state
   tensor, and a copy of every other state tensor (Adafactor's row and column factors, a step
   count). Where the state's keys, kinds or shapes change (the first step), the owners first tell
   the other ranks with one object all-gather;
5. the optimizer's own step then runs with those gradients hidden (it steps only the rest, e.g.
   plain parameters), and they are given back after it.

Between steps the state is laid out as for any fsdp2 parameter: parameter-shaped tensors are DTensors
sharded like the parameter, others plain tensors equal on every rank of the shard group. So
``optimizer.state_dict()``, DCP and a resume on another number of ranks see what they expect.
HSDP: the owners are ranks of the shard group; each replica computes each parameter once, on the
same values, so replicas stay bit-identical.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..base._warn import warn_user
from ..param._param import is_managed
from ..runtime._optimizer_hooks import take_part
from ._local_optim import declare_elementwise, is_elementwise
from ._owner_exchange import ExchangePlan, shard_group_of

__all__ = ["declare_optimizer", "whole_tensor_step"]

_KINDS = ("elementwise", "whole_tensor", "dtensor")
# Classes (and their subclasses) by what they need; the rest warn once when they step shards.
_declared: dict[type, str] = {
    torch.optim.Muon: "whole_tensor",
    torch.optim.Adafactor: "whole_tensor",
    torch.optim.Rprop: "dtensor",  # elementwise; right through DTensor operations
}
_instances: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = weakref.WeakKeyDictionary()
_shadows: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_plans: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[tuple[int, ...], list[ExchangePlan]]] = (
    weakref.WeakKeyDictionary()
)
_hidden: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[tuple[torch.Tensor, Any]]] = (
    weakref.WeakKeyDictionary()
)
_warned: set[type] = set()


def declare_optimizer(cls: Any, kind: str) -> None:
    """Tell fsdp2 how an optimizer class is right on sharded parameters.

    ``"elementwise"``: each element is updated from its own values only (Adam, SGD, Lion): its steps
    run on local shards from the second step on. ``"whole_tensor"``: the update needs each whole
    parameter (Muon, Adafactor, Shampoo, Dion): each parameter's update is computed once, on one
    owner rank, from the whole gradient, parameter and state (``whole_tensor_step`` for every
    instance). ``"dtensor"``: right through DTensor operations as it is (no warning, nothing
    changed). Subclasses follow their nearest declared base.

    Raises:
        TypeError: ``cls`` is not a ``torch.optim.Optimizer`` subclass.
        ValueError: ``kind`` is not one of the three.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"declare_optimizer expects a torch.optim.Optimizer subclass, got {cls!r}.")
    if kind not in _KINDS:
        raise ValueError(f"declare_optimizer: kind must be one of {_KINDS}, got {kind!r}.")
    _declared[cls] = kind
    if kind == "elementwise":
        declare_elementwise(cls)


def whole_tensor_step(optimizer: torch.optim.Optimizer, *, enabled: bool = True) -> torch.optim.Optimizer:
    """Compute each sharded parameter's update of ``optimizer`` on whole tensors, once, on an owner rank.

    For an optimizer whose update needs each whole parameter (a matrix function such as Muon's
    Newton-Schulz orthogonalisation, Shampoo's preconditioners, Adafactor's row and column
    statistics): every step, each parameter ``fully_shard`` sharded is assembled on one rank of its
    shard group (owners balanced by work), stepped there by the optimizer's own ``step`` as on the
    unsharded model, and its rows (and its state's) sent back; see [Note: The owner step]. Muon and
    Adafactor take this path without it; ``enabled=False`` puts this instance back on the DTensor
    path. Every rank of the job must step the optimizer (the exchanges are collectives). Returns
    ``optimizer``.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"whole_tensor_step expects a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    _instances[optimizer] = bool(enabled)
    return optimizer


_participating: list[Any] = []


def enable_whole_tensor_steps() -> None:
    """Join the optimizer-step hooks (at the first ``fully_shard``, after the step guard)."""
    if not _participating:
        _participating.append(take_part(before=before_step, after=after_step))


def kind_of(cls: type) -> str | None:
    """What ``cls`` needs on shards: its nearest declared base's kind, else elementwise torch classes'."""
    for base in cls.__mro__:
        kind = _declared.get(base)
        if kind is not None:
            return kind
        if is_elementwise(base):
            return "elementwise"
    return None


def before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Pre-step participant: the owner step of a whole-tensor optimizer (or the unknown one's warning)."""
    if optimizer in _shadows:
        return
    chosen = _instances.get(optimizer)
    if chosen is False:
        return
    kind = "whole_tensor" if chosen else kind_of(type(optimizer))
    if kind in ("elementwise", "dtensor") or (kind is None and type(optimizer) in _warned):
        return
    managed = [p for group in optimizer.param_groups for p in group["params"] if is_managed(p)]
    if not managed:
        return
    if kind is None:
        _warn_unknown(type(optimizer))
        return
    if (len(args) > 1 and args[1] is not None) or kwargs.get("closure") is not None:  # args[0]: self
        raise ValueError(
            f"{type(optimizer).__name__}.step(closure) over sharded parameters: the whole-tensor step "
            "(each parameter's update on one owner rank) cannot re-run the closure on owners; call "
            "the forward and backward yourself, then step() without a closure."
        )
    stepped = [p for p in managed if p.grad is not None and _sharded(p)]
    for param in stepped:
        grad = param.grad
        if not isinstance(grad, DTensor) or grad.placements != param.placements:
            layout = getattr(grad, "placements", type(grad).__name__)
            raise ValueError(
                f"{type(optimizer).__name__}.step(): a parameter of shape {tuple(param.shape)} has a "
                f"gradient laid out as {layout}, not as the parameter ({tuple(param.placements)}); the "
                "whole-tensor step reads reduced gradient shards. Step after a backward that reduced the "
                "gradients (set_requires_gradient_sync(True))."
            )
    if not stepped:
        return
    for plan in _plans_of(optimizer, stepped):
        plan.run(optimizer, _shadow_of(optimizer))
    _hidden[optimizer] = [(p, p.grad) for p in stepped]
    for param in stepped:
        param.grad = None  # the optimizer's own step skips what the owners stepped


def after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Post-step participant: give back the gradients the owner step hid from the optimizer's step."""
    hidden = _hidden.pop(optimizer, None)
    if hidden:
        for param, grad in hidden:
            param.grad = grad


def _sharded(param: torch.Tensor) -> bool:
    return isinstance(param, DTensor) and any(p.is_shard() for p in param.placements)


def _plans_of(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[ExchangePlan]:
    """The exchange plans of ``params`` (one per shard group), built once per set of parameters."""
    key = tuple(map(id, params))
    cached = _plans.get(optimizer)
    if cached is not None and cached[0] == key:
        return cached[1]
    index = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    by_group: dict[Any, list[tuple[torch.Tensor, int]]] = {}
    for param in params:
        group, shard_dim = shard_group_of(param)  # raises for layouts the owner step cannot serve
        by_group.setdefault((group, shard_dim), []).append((param, index[id(param)]))
    plans = [ExchangePlan(group, entries) for (group, _), entries in by_group.items()]
    _plans[optimizer] = (key, plans)
    return plans


_OWN_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")


def _shadow_of(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """An instance of ``optimizer``'s class sharing its settings, for steps over whole plain tensors.

    Built without ``__init__`` (whose arguments fsdp2 cannot know): the instance's attributes are
    copied, and its parameter groups, state and own step hooks are its own.
    """
    shadow = optimizer.__dict__.get("_fsdp2_shadow")
    if shadow is None:
        shadow = object.__new__(type(optimizer))
        shadow.__dict__.update(
            {k: v for k, v in optimizer.__dict__.items() if k not in ("step", "_fsdp2_shadow")}
        )
        for name in _OWN_HOOKS:
            if hasattr(optimizer, name):
                setattr(shadow, name, type(getattr(optimizer, name))())
        optimizer.__dict__["_fsdp2_shadow"] = shadow
        _shadows.add(shadow)
    return shadow


def _warn_unknown(cls: type) -> None:
    if cls in _warned:
        return
    _warned.add(cls)
    name = cls.__name__
    warn_user(
        f"fsdp2: {name} steps parameters fully_shard sharded, and fsdp2 does not know whether its update "
        "is right on shards. It runs through DTensor operations, which give the unsharded model's "
        "numbers for elementwise updates, and may not for updates of whole matrices (Muon's on "
        "DTensors is silently wrong). Declare it: fsdp2.declare_optimizer("
        f"{name}, 'elementwise') if each element is updated from its own values (as Adam), "
        "'whole_tensor' if the update needs each whole parameter (as Muon or Shampoo: each is then "
        "computed once, on an owner rank), or 'dtensor' if you checked the DTensor path. See "
        "docs/optimizers.md."
    )
