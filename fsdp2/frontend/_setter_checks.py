"""The argument checks of ``FSDPModule``'s setters, each raising before any change.

Owns: ``describe`` (a value in an error message), the errors whose types are torch's and fsdp2's
earlier ones at once (``ArgumentTypeError``, ...), and the checks of a divide factor, a custom
collective, and what a tree-ordered reduction or a custom collective rules out. Does not own: the
setters (``_module.py``).
"""

from __future__ import annotations

import math
from typing import Any

from ..comm import (
    check_comm,
)
from ..group import FSDPParamGroup


def describe(value: Any) -> str:
    """A short description of a bad argument for error messages: its type, and value if simple."""
    if isinstance(value, list):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a list of {', '.join(kinds)}" if value else "an empty list"
    return (
        f"{type(value).__name__} {value!r}" if isinstance(value, (int, float, str)) else type(value).__name__
    )


# ---- setter argument errors ---------------------------------------------------------------------
# A setter refuses a bad argument when it is called, before any change, with the exception type torch
# 2.13 raises for it (often only at the next forward or backward). Where fsdp2 raised another type
# before, the error derives from both, so code catching either keeps working.


class ArgumentTypeError(TypeError, ValueError):
    """A setter argument of the wrong type (torch: ``TypeError``; fsdp2 raised ``ValueError`` before)."""


class CommTypeError(TypeError, AttributeError):
    """Not a collective object (torch: ``AttributeError`` at the first collective; fsdp2: ``TypeError``)."""


class ZeroDivideFactorError(ValueError, ZeroDivisionError):
    """``set_gradient_divide_factor(0)`` (torch: ``ZeroDivisionError`` in backward)."""


class UnknownBackendError(ValueError, RuntimeError):
    """A symmetric-memory backend other than NCCL (torch: ``RuntimeError``)."""


class NotShardedError(ValueError, AssertionError):
    """A sharding setter on a module whose parameters are replicated only (torch: ``AssertionError``)."""


def checked_divide_factor(factor: object) -> float:
    """``set_gradient_divide_factor``'s argument as a float; refused unless positive and finite."""
    if not isinstance(factor, (int, float)) or isinstance(factor, bool):
        raise ArgumentTypeError(
            f"gradient divide factor must be a positive number (int or float), got {describe(factor)}."
        )
    if factor == 0:
        raise ZeroDivideFactorError("gradient divide factor must be a positive number, got 0.")
    if not factor > 0 or not math.isfinite(factor):
        raise ValueError(f"gradient divide factor must be a positive, finite number, got {describe(factor)}.")
    return float(factor)


def refuse_ordered_conflicts(
    groups: list[FSDPParamGroup],
    method: str,
    *,
    deterministic: bool | None = None,
    all_reduce: bool | None = None,
    custom: bool = False,
) -> None:
    """Refuse, before any change, what a tree-ordered reduction (wire dtype, deterministic) cannot do."""
    for group in groups:
        controls = group.controls
        wire = group.config.mp_policy.wire_dtype
        ordered = wire is not None or (
            controls.deterministic_reduction if deterministic is None else deterministic
        )
        if not ordered:
            continue
        why = (
            f"MixedPrecisionPolicy(wire_dtype={wire})" if wire is not None else "set_deterministic_reduction"
        )
        syncs = controls.all_reduce_grads if all_reduce is None else all_reduce
        if group.mesh_info.replicate_group is not None and not syncs:
            raise RuntimeError(
                f"{method}: {group} reduces gradients in a fixed tree order ({why}), which sums every "
                "replica's contribution in each backward, so HSDP's set_requires_all_reduce(False) "
                "cannot hold partial sums. Use set_requires_gradient_sync(False) to accumulate, or turn "
                "the ordered reduction off."
            )
        if custom or group.comms.custom:
            raise RuntimeError(
                f"{method}: {group} reduces gradients in a fixed tree order ({why}) with an all-to-all, so a "
                "custom reduce-scatter (set_custom_reduce_scatter) would never run. Use one or the other."
            )


def refuse_custom(group: FSDPParamGroup, method: str) -> None:
    if group.comms.custom:
        raise RuntimeError(
            f"{method} cannot be combined with set_custom_all_gather / set_custom_reduce_scatter: the custom "
            "collectives allocate their own buffers. Use one or the other."
        )


def check_comm_type(comm: object, kind: str) -> None:
    try:
        check_comm(comm, kind)
    except TypeError as error:
        raise CommTypeError(str(error)) from None
