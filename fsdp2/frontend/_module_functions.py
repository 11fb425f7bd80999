"""Functions over modules ``fully_shard`` manages: extra forward methods, shared streams across roots.

Owns: ``register_fsdp_forward_method`` (a method that gathers and reshards like ``forward``) and
``share_comm_ctx`` (pipeline stages sharing one root's streams and in-flight buffers). Does not own:
the ``FSDPModule`` methods (``_module.py``).
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from ..base import eager
from ._module import FSDPModule, require_state


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>()`` gather and reshard like ``forward`` does (e.g. ``generate``).

    A no-op for modules that are not :class:`FSDPModule`, so code runs with and without sharding.

    Raises:
        ValueError: the module has no attribute ``method_name``.
    """
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module).__name__} does not have a method {method_name!r} to register.")
    method = getattr(module, method_name)
    state = require_state(module)
    pre_forward = eager(state.pre_forward)
    post_forward = eager(state.post_forward)

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = pre_forward(module, args, kwargs)
        output = method(*args, **kwargs)
        return post_forward(module, args, output)

    module.__dict__[method_name] = wrapped


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Make several roots (pipeline stages) share the first one's streams and in-flight buffers.

    Call it before the first forward. Raises ``ValueError`` for a non-``FSDPModule`` entry.
    """
    if not modules:
        return
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(
                f"share_comm_ctx expects a list of FSDPModules, got a {type(module).__name__}. Call "
                "fully_shard on every stage first."
            )
    shared = require_state(modules[0]).shared_comm_context()
    for module in modules[1:]:
        require_state(module).shared_context().comm_ctx = shared
