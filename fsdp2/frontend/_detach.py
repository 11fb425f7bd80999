"""A module tree of ``fully_shard`` modules as plain modules for a while: what deep copy copies.

Owns: ``detached`` (original classes, no fsdp2 hooks or state, sharded parameters replaced by meta
placeholders; everything restored on exit). It spans rooms: the class swap and torch's composable
state are ``frontend``'s (``_module.py``, ``_composable.py``), the hooks, modules and parameters are
the states' (``runtime``). Does not own: the copy itself (``weights/_copy.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from ..runtime import FSDPState
from ._composable import pop_torch_state, restore_torch_state
from ._module import original_class

__all__ = ["detached"]


@contextmanager
def detached(states: list[FSDPState]) -> Iterator[None]:
    """The states' modules as plain modules for the duration, everything restored on exit.

    Plain: original classes, no fsdp2 hooks or state, each sharded parameter replaced by a meta
    placeholder of its full shape (what a copy rebuilds with ``fully_shard``).
    """
    undo: list[Callable[[], None]] = []
    hook_dicts: dict[int, tuple[dict[Any, Any], list[tuple[Any, Any]]]] = {}
    try:
        for state in states:
            for handle in state.hook_handles:
                for ref in (handle.hooks_dict_ref, *getattr(handle, "extra_dict_ref", ())):
                    hooks = ref()
                    if hooks is not None and handle.id in hooks:
                        hook_dicts.setdefault(id(hooks), (hooks, list(hooks.items())))
                        del hooks[handle.id]
            for module in state.modules:
                undo.append(_restorer(module, "__class__", module.__class__))
                module.__class__ = original_class(module.__class__)  # FSDP<Name> -> <Name>
                undo.append(_restorer(module, "state", module.__dict__.pop("_fsdp2_state")))
                undo.append(_restorer(module, "torch_state", pop_torch_state(module)))
            for group in state.groups:
                for fsdp_param in group.fsdp_params:
                    placeholder = fsdp_param.placeholder()
                    for owner, attr in fsdp_param.owners:
                        undo.append(_restorer(owner, f"param:{attr}", owner._parameters[attr]))  # noqa: SLF001
                        owner._parameters[attr] = placeholder  # noqa: SLF001 - swapped back on exit
        yield
    finally:
        for restore in reversed(undo):
            restore()
        for hooks, items in hook_dicts.values():
            hooks.clear()
            hooks.update(items)


def _restorer(module: nn.Module, what: str, value: Any) -> Callable[[], None]:
    def restore() -> None:
        if what == "__class__":
            module.__class__ = value
        elif what == "state":
            module.__dict__["_fsdp2_state"] = value
        elif what == "torch_state":
            restore_torch_state(module, value)
        else:
            module._parameters[what[len("param:") :]] = value  # noqa: SLF001 - restoring

    return restore
