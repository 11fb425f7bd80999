"""``apply_fully_shard``: shard every instance of some module classes bottom-up, then the root.

Owns: the traversal (post-order, so inner matches are sharded before the blocks that contain them)
and the validation of ``module_classes``. Does not own: sharding itself (``fully_shard``). The FSDP1
auto-wrap policy users miss, in one call.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

from torch import nn

from ._fully_shard import fully_shard
from ._module import FSDPModule


def apply_fully_shard(
    model: nn.Module, module_classes: Iterable[type[nn.Module]], **fully_shard_kwargs: Any
) -> FSDPModule:
    """``fully_shard`` every instance of ``module_classes`` inside ``model`` (bottom-up), then ``model``.

    The same as writing the calls by hand::

        for block in model.layers:        # every TransformerBlock
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)

    Args:
        model: the root module; it is sharded last, even if it is itself an instance of a class listed.
        module_classes: the module types that become their own groups (e.g. ``{TransformerBlock}``).
        fully_shard_kwargs: passed to every ``fully_shard`` call (``mesh``, ``mp_policy``,
            ``reshard_after_forward``, ...).

    Returns:
        ``model``, now an :class:`FSDPModule`.

    Raises:
        TypeError: ``model`` is not a module, or ``module_classes`` holds something that is not an
            ``nn.Module`` subclass.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_fully_shard expects an nn.Module, got {type(model).__name__}.")
    given: object = module_classes
    classes: tuple[Any, ...] = (given,) if isinstance(given, type) else tuple(module_classes)
    for cls in classes:
        candidate: object = cls
        if not (isinstance(candidate, type) and issubclass(candidate, nn.Module)):
            raise TypeError(
                f"apply_fully_shard: module_classes must hold nn.Module subclasses, got {cls!r}. Pass the "
                "classes themselves, e.g. {TransformerBlock}, not instances or names."
            )
    matches = [m for m in _post_order(model) if m is not model and isinstance(m, classes)]
    if not matches and classes:
        names = ", ".join(c.__name__ for c in classes)
        warnings.warn(
            f"apply_fully_shard: no module of {type(model).__name__} is an instance of {names}; the whole "
            "model becomes one group (one all-gather of every parameter).",
            stacklevel=2,
        )
    for module in matches:
        fully_shard(module, **fully_shard_kwargs)
    return fully_shard(model, **fully_shard_kwargs)


def _post_order(module: nn.Module) -> list[nn.Module]:
    order: list[nn.Module] = []
    seen: set[int] = set()

    def visit(m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        for child in m.children():
            visit(child)
        order.append(m)

    visit(module)
    return order
