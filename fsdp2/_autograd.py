"""Autograd plumbing: the node that triggers a group's post-backward.

Owns: ``register_post_backward``, which routes a module's inputs that require grad through one
identity autograd node whose backward calls a given callback (a group's post-backward). The node runs
once gradients for all of those inputs are computed, i.e. after the module's own parameter gradients.
Also the few private autograd-engine entry points fsdp2 needs. Does not own: pre-backward hooks
(tensor hooks on outputs, registered by ``FSDPState``). A leaf: it imports nothing from fsdp2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

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
    """Identity in forward; calls the given callback in backward."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


def register_post_backward(
    callback: Callable[[], None], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Return ``(args, kwargs)`` with their grad-requiring tensors routed through a node calling ``callback``.

    ``callback`` must already be excluded from compilation (see :func:`eager`).
    """
    if not kwargs and all(type(a) is torch.Tensor for a in args):
        # Hot path: positional tensors only (the common block call), no pytree walk.
        picks = [i for i, a in enumerate(args) if a.requires_grad]
        if not picks:
            return args, kwargs
        outs = _PostBackwardNode.apply(callback, *(args[i] for i in picks))  # type: ignore[no-untyped-call]  # reason: torch leaves apply untyped
        new_args = list(args)
        for i, out in zip(picks, outs, strict=True):
            new_args[i] = out
        return tuple(new_args), kwargs
    flat, spec = tree_flatten((args, kwargs))
    picks = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor) and a.requires_grad]
    if not picks:
        return args, kwargs
    outs = _PostBackwardNode.apply(callback, *(flat[i] for i in picks))  # type: ignore[no-untyped-call]  # reason: torch leaves apply untyped
    for i, out in zip(picks, outs, strict=True):
        flat[i] = out
    new_args, new_kwargs = tree_unflatten(flat, spec)
    return new_args, new_kwargs
