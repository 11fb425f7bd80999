"""Autograd plumbing: the node that triggers a group's post-backward.

Owns: ``register_post_backward``, which routes a module's inputs that require grad through one
identity autograd node whose backward calls a given callback (a group's post-backward). The node runs
once gradients for all of those inputs are computed, i.e. after the module's own parameter gradients.
Also ``route_untracked_outputs``, the torch.func stand-in for output hooks (see its docstring),
``outside_functorch`` (see [Note: Storage work under torch.func]) and the few private autograd-engine
entry points fsdp2 needs. Does not own: pre-backward hooks (tensor hooks on outputs, registered by
``FSDPState``). A leaf: it imports nothing from fsdp2.

[Note: Storage work under torch.func]
Inside a ``torch.func`` transform (``jvp``, ``vjp``, ``grad``, ...) every op result, factory
functions included, comes back wrapped for the transform's level, and a wrapper has no storage to
resize or alias. Everything that allocates, gathers, copies into, resizes or registers FSDP tensors
(lazy init, unshard, copy-out, reshard) therefore runs through ``outside_functorch``, which switches
the transforms off for its duration: those tensors stay real and outlive the transform. The module's
forward still runs under the transform; it sees the unsharded parameters as constants of that level.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, cast

import torch
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

# Autograd engine entry points that torch exposes only privately; used nowhere else in fsdp2.
in_backward_task_id = torch._C._current_graph_task_id  # noqa: SLF001 - returns -1 outside backward


def queue_end_of_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current backward pass has finished all its nodes."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # noqa: SLF001 - no public API


# torch.func entry points that torch exposes only privately; used nowhere else in fsdp2.
functorch_active = torch._C._are_functorch_transforms_active  # noqa: SLF001 - no public API
_DisableFuncTorch = torch._C._DisableFuncTorch  # noqa: SLF001 - no public API

# Keeps a tensor's version counter across an in-place refill that autograd must not see.
preserve_version_counter = _unsafe_preserve_version_counter

_Fn = TypeVar("_Fn", bound="Callable[..., Any]")
_P = ParamSpec("_P")
_R = TypeVar("_R")


def outside_functorch(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` run with any active torch.func transforms off. See [Note: Storage work under torch.func]."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if not functorch_active():
            return fn(*args, **kwargs)
        with _DisableFuncTorch():
            return fn(*args, **kwargs)

    return wrapper


def eager(fn: _Fn) -> _Fn:
    """``fn`` marked so torch.compile never traces it (FSDP hooks mutate storages and modules)."""
    return cast(_Fn, torch.compiler.disable(fn))


def is_view(tensor: torch.Tensor) -> bool:
    return tensor._base is not None  # noqa: SLF001 - no public API for "is a view"


class _PostBackwardNode(torch.autograd.Function):
    """Identity in forward (tangents pass through); calls the given callback in backward.

    ``forward`` takes no ``ctx`` (a separate ``setup_context``), and ``jvp`` and a generated vmap
    rule exist, because torch.func transforms (``vjp``, ``jvp``, ``vmap``, ...) accept only such
    Functions.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(callback: Callable[[], None], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return inputs

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.callback = inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)

    @staticmethod
    def jvp(ctx: Any, callback_tangent: Any, *tangents: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tangents


class _PostBackwardNodeEager(torch.autograd.Function):
    """``_PostBackwardNode`` for use outside torch.func transforms.

    ``Function.apply`` binds the arguments of a Function with a separate ``setup_context`` through
    ``inspect.signature`` on every call (tens of µs); this one takes ``ctx`` in ``forward``.
    """

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


def _post_backward_node(callback: Callable[[], None], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    node = _PostBackwardNode if functorch_active() else _PostBackwardNodeEager
    outs: tuple[torch.Tensor, ...] = node.apply(callback, *inputs)  # type: ignore[no-untyped-call]  # reason: torch leaves apply untyped
    return outs


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
        if len(picks) == 1 and not functorch_active():
            # One input: an alias whose backward node calls back (a C++ hook, a few µs cheaper
            # than a Python Function; the same node position and timing).
            i = picks[0]
            alias = args[i].view_as(args[i])
            alias.grad_fn.register_hook(lambda grad_inputs, grad_outputs: callback())
            return (*args[:i], alias, *args[i + 1 :]), kwargs
        outs = _post_backward_node(callback, *(args[i] for i in picks))
        new_args = list(args)
        for i, out in zip(picks, outs, strict=True):
            new_args[i] = out
        return tuple(new_args), kwargs
    flat, spec = tree_flatten((args, kwargs))
    picks = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor) and a.requires_grad]
    if not picks:
        return args, kwargs
    outs = _post_backward_node(callback, *(flat[i] for i in picks))
    for i, out in zip(picks, outs, strict=True):
        flat[i] = out
    new_args, new_kwargs = tree_unflatten(flat, spec)
    return new_args, new_kwargs


# The nodes of inputs routed through a post-backward node (keyword inputs, several positional ones).
_ROUTED = frozenset({"_PostBackwardNodeBackward", "_PostBackwardNodeEagerBackward"})


def register_pre_backward(
    tensor: torch.Tensor,
    tensor_hook: Callable[[torch.Tensor], torch.Tensor],
    node_hook: Callable[[tuple[torch.Tensor | None, ...]], None],
    inputs: Callable[[], set[int]] | None = None,
) -> bool:
    """Run a hook when backward reaches ``tensor`` (which requires grad); whether in-place ops keep it.

    On the node that produced it (``node_hook(grad_outputs)``, registered in C++) where there is one;
    on the tensor itself (``tensor_hook(grad)``) for a leaf or under torch.func transforms. For a view
    (an LM head's ``Linear`` on 3-D activations returns one) of a tensor the module computed, the node
    of its base: an in-place op on the view (``out += y``) gives the view a new node but keeps the
    base's, and the view nodes in between compute nothing with parameters, so the hook runs at the
    same point. ``inputs`` gives the ids of the module's input tensors (their bases): a view of one of
    them keeps the hook on its own node, since the base's node runs after the module's post-backward.
    A view autograd refuses in-place ops on (a custom Function's output) keeps it on its own node too.
    Returns ``False`` for a view whose hook an in-place op would drop.
    """
    node = tensor.grad_fn
    if node is None or functorch_active():
        tensor.register_hook(tensor_hook)
        return not is_view(tensor)
    base = tensor._base  # noqa: SLF001 - no public API for a view's base
    # A full backward hook's views (BackwardHookFunctionBackward) must keep the hook on their own node.
    if base is None or type(node).__name__ == "BackwardHookFunctionBackward":
        node.register_prehook(node_hook)
        return True
    if _in_place_refused(tensor):  # autograd raises on an in-place op on it: its own node stays
        node.register_prehook(node_hook)
        return True
    if base.grad_fn is None or inputs is None or id(base) in inputs() or not _computed_here(node, base):
        node.register_prehook(node_hook)
        return False
    base.grad_fn.register_prehook(node_hook)
    return True


def _in_place_refused(view: torch.Tensor) -> bool:
    """Whether autograd refuses in-place ops on ``view``, as on tensor parallelism's ``to_local()``.

    Views made by a custom Function, by a multi-output op, or under no_grad or inference mode.
    """
    meta = torch._C._autograd._get_creation_meta(view)  # noqa: SLF001 - no public API for it
    return bool(meta != torch._C._autograd.CreationMeta.DEFAULT)  # noqa: SLF001


def _computed_here(node: Any, base: torch.Tensor) -> bool:
    """Whether the view chain from ``node`` reaches ``base``'s node without passing a routed input."""
    target, steps = base.grad_fn, 0
    while node is not None and node is not target and steps < 64:
        if type(node).__name__ in _ROUTED or not node.next_functions:
            return False
        node, steps = node.next_functions[0][0], steps + 1
    return node is target


class _PreBackwardNode(torch.autograd.Function):
    """Identity in forward; calls ``hook(grad)`` in backward. The tangent goes through the same node."""

    generate_vmap_rule = True

    @staticmethod
    def forward(hook: Callable[[torch.Tensor], torch.Tensor], output: torch.Tensor) -> torch.Tensor:
        return output

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.hook = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, ctx.hook(grad)

    @staticmethod
    def jvp(ctx: Any, hook_tangent: Any, tangent: torch.Tensor | None) -> torch.Tensor | None:
        # A backward that starts from a jvp's tangent output must unshard first too.
        if tangent is None:
            return None
        out: torch.Tensor = _PreBackwardNode.apply(ctx.hook, tangent)  # type: ignore[no-untyped-call]  # reason: torch leaves apply untyped
        return out


def route_untracked_outputs(hook: Callable[[torch.Tensor], torch.Tensor], output: Any) -> Any:
    """Under torch.func transforms, route ``output``'s floating tensors that need no grad through ``hook``.

    Each floating or complex tensor that reports ``requires_grad=False`` goes through an identity
    node whose backward calls ``hook``. Inside a transform such as ``torch.func.jvp`` an output may
    not require grad at the transform's level and still be part of the outer autograd graph (the
    unsharded parameters require grad): a backward through the returned primal or tangent must run
    pre-backward although no tensor hook could be registered. Outside transforms ``output`` is
    returned as it is.
    """
    if not functorch_active():
        return output

    def route(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and not t.requires_grad and (t.is_floating_point() or t.is_complex()):
            return _PreBackwardNode.apply(hook, t)  # type: ignore[no-untyped-call]  # reason: torch leaves apply untyped
        return t

    return tree_map(route, output)
