"""``apply_fully_shard``: ``fully_shard`` on every instance of some module classes, bottom-up, then the root.

Owns: choosing the modules (post-order over ``model.modules()``, so inner matches come first) and the
argument checks of that choice. Does not own: anything ``fully_shard`` does, or the checks of its
keyword arguments (the first call makes them, before any module changes).
Invariants: the result is the same as the equivalent hand-written ``fully_shard`` calls, in the same order.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

from torch import nn

from ..frontend import FSDPModule, describe, fully_shard
from ..runtime import get_state


def apply_fully_shard(
    model: nn.Module, module_classes: type[nn.Module] | Iterable[type[nn.Module]], **fully_shard_kwargs: Any
) -> FSDPModule:
    """Shard every instance of ``module_classes`` inside ``model`` bottom-up, then ``model`` itself.

    The replacement for FSDP1's ``auto_wrap_policy=ModuleWrapPolicy({Block})``: it makes the calls
    you would write by hand, ``fully_shard(block, **kwargs)`` for each matching submodule in post-order
    (a match nested inside another match is sharded first), then ``fully_shard(model, **kwargs)``, so
    each match is one all-gather / reduce-scatter group and the root takes the remaining parameters.
    Submodules already sharded by an earlier ``fully_shard`` call are left as they are. If nothing
    matches, only the root is sharded (one group for the whole model, with no overlap of communication
    and compute) and a ``UserWarning`` says so.

    Args:
        model: the root module (not yet sharded).
        module_classes: a module class or a collection of them, e.g. ``{TransformerBlock}``; instances of
            subclasses match too.
        **fully_shard_kwargs: passed unchanged to every ``fully_shard`` call (``mesh``, ``mp_policy``,
            ``reshard_after_forward``, ...).

    Returns:
        ``model``, now an :class:`FSDPModule`.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or an entry of ``module_classes`` is not an
            ``nn.Module`` subclass (the error names it).
        ValueError: ``model`` is already sharded; or anything ``fully_shard`` raises for its arguments.

    Example:
        >>> fsdp2.apply_fully_shard(model, {TransformerBlock}, mp_policy=policy)  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_fully_shard expects an nn.Module as model, got {describe(model)}.")
    classes = _validate_classes(module_classes)
    if get_state(model) is not None:
        raise ValueError(
            f"apply_fully_shard: this {type(model).__name__} is already sharded; call it on a model that "
            "fully_shard has not been applied to."
        )
    targets = [
        module
        for module in _post_order(model)
        if module is not model and isinstance(module, classes) and get_state(module) is None
    ]
    if not targets:
        names = ", ".join(cls.__name__ for cls in classes)
        warnings.warn(
            f"apply_fully_shard found no instance of {names} inside this {type(model).__name__}: only the "
            "root is sharded, as one group (no communication overlaps compute). Pass the model's block "
            "classes.",
            stacklevel=2,
        )
    for module in targets:
        fully_shard(module, **fully_shard_kwargs)
    return fully_shard(model, **fully_shard_kwargs)


def _validate_classes(module_classes: Any) -> tuple[type[nn.Module], ...]:
    if isinstance(module_classes, type):
        module_classes = (module_classes,)
    if isinstance(module_classes, (str, bytes)) or not isinstance(module_classes, Iterable):
        raise TypeError(
            "apply_fully_shard expects module_classes to be a module class or a collection of them, got "
            f"{describe(module_classes)}."
        )
    classes = tuple(module_classes)
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(
                f"apply_fully_shard: module_classes holds {cls!r}, which is not an nn.Module subclass. Pass "
                "classes such as {TransformerBlock}, not instances or names."
            )
    if not classes:
        raise TypeError("apply_fully_shard expects at least one module class in module_classes, got none.")
    return classes


def _post_order(root: nn.Module) -> list[nn.Module]:
    """Every module under ``root`` once, children before parents (bottom-up)."""
    seen: set[int] = set()
    order: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child in module.children():
            visit(child)
        order.append(module)

    visit(root)
    return order
