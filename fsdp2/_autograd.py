"""Autograd plumbing: the node that triggers a group's post-backward.

Owns: ``register_post_backward``, which routes a module's inputs that require grad through one
identity autograd node whose backward runs the group's post-backward. The node runs once gradients
for all of those inputs are computed, i.e. after the module's own parameter gradients.
Does not own: pre-backward hooks (tensor hooks on outputs, registered by ``FSDPState``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._param_group import FSDPParamGroup

# Autograd engine entry points that torch exposes only privately; used nowhere else in fsdp2.
in_backward_task_id = torch._C._current_graph_task_id  # noqa: SLF001 - returns -1 outside backward


def queue_end_of_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current backward pass has finished all its nodes."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # noqa: SLF001 - no public API


_Fn = TypeVar("_Fn", bound="Callable[..., Any]")


def eager(fn: _Fn) -> _Fn:
    """``fn`` marked so torch.compile never traces it (FSDP hooks mutate storages and modules)."""
    return cast(_Fn, torch.compiler.disable(fn))


def is_view(tensor: torch.Tensor) -> bool:
    return tensor._base is not None  # noqa: SLF001 - no public API for "is a view"


class _PostBackwardNode(torch.autograd.Function):
    """Identity in forward; calls ``group.post_backward()`` in backward."""

    @staticmethod
    def forward(ctx: Any, group: FSDPParamGroup, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        _run_post_backward(ctx.group)
        return (None, *grads)


def _post_backward(group: FSDPParamGroup) -> None:
    # Dispatch through the instance so class-level instrumentation sees every call.
    group.post_backward()


_run_post_backward = eager(_post_backward)


def register_post_backward(
    group: FSDPParamGroup, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Return ``(args, kwargs)`` with their grad-requiring tensors routed through a post-backward node."""
    if not kwargs and all(type(a) is torch.Tensor for a in args):
        # Hot path: positional tensors only (the common block call), no pytree walk.
        picks = [i for i, a in enumerate(args) if a.requires_grad]
        if not picks:
            return args, kwargs
        outs = _PostBackwardNode.apply(group, *(args[i] for i in picks))  # type: ignore[no-untyped-call]  # reason: torch leaves apply untyped
        new_args = list(args)
        for i, out in zip(picks, outs, strict=True):
            new_args[i] = out
        return tuple(new_args), kwargs
    flat, spec = tree_flatten((args, kwargs))
    picks = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor) and a.requires_grad]
    if not picks:
        return args, kwargs
    outs = _PostBackwardNode.apply(group, *(flat[i] for i in picks))  # type: ignore[no-untyped-call]  # reason: torch leaves apply untyped
    for i, out in zip(picks, outs, strict=True):
        flat[i] = out
    new_args, new_kwargs = tree_unflatten(flat, spec)
    return new_args, new_kwargs
