"""Whole-tensor optimizer steps over shards: each parameter's update computed once, on one owner rank.

Owns: which optimizers need whole tensors (``torch.optim.Muon`` and ``torch.optim.Adafactor``, and
classes declared with ``declare_optimizer``; Adafactor itself steps on rows, see ``_adafactor``),
``whole_tensor_step`` (one optimizer instance), the one-time warning for an optimizer fsdp2 does not
know to be right on shards, and the owner step ([Note: The owner step]). Does not own: the update
rule (the optimizer's own ``step``, run on whole plain tensors), the local-shard step
(``_local_optim``), the step guard (``runtime``), the bytes layout of one exchange
(``_owner_exchange``).

[Note: The owner step]
At an optimizer's first step, fsdp2's automatic choice (``_local_optim``) hands a class that is not
elementwise to ``_first_step`` here, which gives a whole-tensor optimizer its own step hooks (torch
runs them after the global ones, so after fsdp2's step guard). Before each of its steps, for the
parameters ``fully_shard`` sharded that have a gradient, per shard process group:

1. owners: each parameter goes to one rank of its shard group, the most work first to the least
   loaded rank (work: ``m * n * min(m, n)`` for a matrix, the cost of a Newton-Schulz iteration;
   the element count otherwise), the same choice on every rank;
2. to the owners: one all-to-all moves each rank's rows of the gradient, the parameter and every
   parameter-shaped state tensor to the owner, which concatenates them into whole tensors;
3. the owner runs the optimizer's own ``step`` on those whole plain tensors, through a shadow
   instance of the same class with the same hyperparameters: the operations of the unsharded model;
4. back: one all-to-all gives each rank its rows of the parameter and of each parameter-shaped state
   tensor (only the ranks holding rows are sent any), and one all-gather a copy of every other state
   tensor (a step count, a Gram matrix). Where the state's keys, kinds, shapes or plain values
   change (the first step), the owners first tell the other ranks with one object all-gather;
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

from ..base import warn_user
from ..param import is_managed
from ._adafactor import factored_step
from ._local_optim import decide_others_with, declare_elementwise, is_elementwise, mark_decided
from ._muon import ROWS_AVAILABLE, muon_step
from ._owner_exchange import ExchangePlan, shard_group_of
from ._stacked_muon import StackedMuon
from ._step_rows import shard_rows

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
    mark_decided(optimizer)  # the automatic choice leaves it alone
    if enabled:
        _attach(optimizer)
    else:
        _detach(optimizer)
    return optimizer


def enable_whole_tensor_steps() -> None:
    """Let the automatic choice at an optimizer's first step (``_local_optim``) hand over the others."""
    decide_others_with(_first_step)


def _first_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The first step of an optimizer that is not elementwise: the owner path, a warning, or nothing."""
    if optimizer in _shadows or _instances.get(optimizer) is not None:
        return
    kind = kind_of(type(optimizer))
    if kind in ("elementwise", "dtensor"):
        return
    if not any(is_managed(p) for group in optimizer.param_groups for p in group["params"]):
        return
    if kind is None:
        _warn_unknown(type(optimizer))
        return
    _attach(optimizer)  # its hooks run in this step too: after the global ones, which are running


def _attach(optimizer: torch.optim.Optimizer) -> None:
    """Run the owner step before each of ``optimizer``'s steps (its own step hooks, after fsdp2's)."""
    if "_fsdp2_whole_tensor_hooks" not in optimizer.__dict__:
        handles = (
            optimizer.register_step_pre_hook(_before_step),
            optimizer.register_step_post_hook(_after_step),
        )
        optimizer.__dict__["_fsdp2_whole_tensor_hooks"] = handles


def _detach(optimizer: torch.optim.Optimizer) -> None:
    for handle in optimizer.__dict__.pop("_fsdp2_whole_tensor_hooks", ()):
        handle.remove()


def kind_of(cls: type) -> str | None:
    """What ``cls`` needs on shards: its nearest declared base's kind, else elementwise torch classes'."""
    for base in cls.__mro__:
        kind = _declared.get(base)
        if kind is not None:
            return kind
        if is_elementwise(base):
            return "elementwise"
    return None


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step pre-hook of a whole-tensor optimizer: the owner step, then its gradients hidden."""
    if (len(args) > 1 and args[1] is not None) or kwargs.get("closure") is not None:  # args[0]: self
        raise ValueError(
            f"{type(optimizer).__name__}.step(closure) over sharded parameters: the whole-tensor step "
            "(each parameter's update on one owner rank) cannot re-run the closure on owners; call "
            "the forward and backward yourself, then step() without a closure."
        )
    managed = [p for group in optimizer.param_groups for p in group["params"] if is_managed(p)]
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
    if type(optimizer) is torch.optim.Adafactor:  # factored: small all-reduces, no matrix moved
        for group, params in _by_shard_group(stepped):
            factored_step(optimizer, [shard_rows(p, group) for p in params], group)
    elif type(optimizer) in (torch.optim.Muon, StackedMuon) and ROWS_AVAILABLE:  # only NS's input moves
        muon_step(optimizer, stepped)
    else:
        for plan in _plans_of(optimizer, stepped):
            plan.run(optimizer, _shadow_of(optimizer))
    _hidden[optimizer] = [(p, p.grad) for p in stepped]
    for param in stepped:
        param.grad = None  # the optimizer's own step skips what the owners stepped


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step post-hook of a whole-tensor optimizer: give back the gradients the owner step hid."""
    hidden = _hidden.pop(optimizer, None)
    if hidden:
        for param, grad in hidden:
            param.grad = grad


def _sharded(param: torch.Tensor) -> bool:
    return isinstance(param, DTensor) and any(p.is_shard() for p in param.placements)


def _by_shard_group(params: list[torch.Tensor]) -> list[tuple[Any, list[torch.Tensor]]]:
    by_group: dict[Any, list[torch.Tensor]] = {}
    for param in params:
        group, _ = shard_group_of(param)  # raises for layouts neither path serves
        by_group.setdefault(group, []).append(param)
    return list(by_group.items())


def _plans_of(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[ExchangePlan]:
    """The exchange plans of ``params`` (one per shard group), built once per set of parameters."""
    key = tuple(map(id, params))
    cached = _plans.get(optimizer)
    if cached is not None and cached[0] == key:
        return cached[1]
    index = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    plans = [
        ExchangePlan(group, [(p, index[id(p)]) for p in members])
        for group, members in _by_shard_group(params)
    ]
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
        skip = ("step", "_fsdp2_shadow", "_fsdp2_whole_tensor_hooks")
        shadow.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k not in skip})
        for name in _OWN_HOOKS:
            if hasattr(optimizer, name):
                setattr(shadow, name, type(getattr(optimizer, name))())
        optimizer.__dict__["_fsdp2_shadow"] = shadow
        _shadows.add(shadow)
        mark_decided(shadow)
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
