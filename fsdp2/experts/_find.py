"""Which modules hold stacked expert weights, and how their forward is called.

Owns: ``experts_modules`` (the experts modules under a root, by the documented convention) and
``convention_of`` (``"counts"`` or ``"routed"``, from the forward's signature). Does not own: what is
done to them (``_declare``).

[Note: What an experts module is]
A module with an integer ``num_experts`` whose own parameters all have ``num_experts`` rows (dim 0),
at least one of them a 3-D stack ``[E, m, n]``: torchtitan's ``GroupedExperts``, transformers 5's
``*Experts`` modules, and a user's module written the same way. Its forward is either
``forward(x, num_tokens_per_expert)`` (``"counts"``) or ``forward(hidden_states, top_k_index,
top_k_weights)`` (``"routed"``); see [Note: The two conventions]. A router (``[E, D]``, 2-D) is not one.
"""

from __future__ import annotations

import inspect

from torch import nn

__all__ = ["CONVENTIONS", "convention_of", "experts_modules", "is_experts_module"]

CONVENTIONS = ("counts", "routed")


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` holds stacked expert weights (see [Note: What an experts module is])."""
    experts = getattr(module, "num_experts", None)
    params = list(module.parameters(recurse=False))
    return (
        isinstance(experts, int)
        and experts > 0
        and bool(params)
        and all(p.ndim >= 1 and p.shape[0] == experts for p in params)
        and any(p.ndim == 3 for p in params)
    )


def experts_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules at or under ``root``, with their names, in module order."""
    return [(name, module) for name, module in root.named_modules() if is_experts_module(module)]


def convention_of(module: nn.Module, name: str, given: str | None) -> str:
    """``given``, or the convention the forward's positional parameters show; a ``ValueError`` if neither."""
    if given is not None:
        if given not in CONVENTIONS:
            raise ValueError(f"shard_experts: convention must be one of {CONVENTIONS}, got {given!r}.")
        return given
    signature = inspect.signature(type(module).forward)
    positional = [
        p
        for p in list(signature.parameters.values())[1:]
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    if len(positional) == 2:
        return "counts"
    if len(positional) == 3:
        return "routed"
    raise ValueError(
        f"shard_experts: cannot tell how {name or 'the module'} ({type(module).__name__}) is called: its "
        f"forward takes {len(positional)} required arguments; an experts module's forward is forward(x, "
        "num_tokens_per_expert) or forward(hidden_states, top_k_index, top_k_weights) (pass "
        "convention='counts' or 'routed')."
    )
