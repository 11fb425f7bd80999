"""Interop with torch's composable-API registry (``replicate``, ``checkpoint``).

Owns: reading and writing the per-module registry through which torch's composable APIs see each
other, so torch's ``replicate`` refuses a module fsdp2 manages and fsdp2 refuses (or skips) a module
``replicate`` manages. This is the only module that touches that registry.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from torch import nn

try:  # the registry is private to torch; degrade to "no registry" if it moves
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY, RegistryItem, _get_registry
    from torch.distributed.fsdp import fully_shard as _torch_fully_shard
except ImportError:  # pragma: no cover - depends on the torch version
    REGISTRY_KEY = None

# The key under which torch's ``fully_shard.state(module)`` looks a module's state up: the function
# its ``@contract`` decorator wrapped.
_TORCH_STATE_KEY = getattr(_torch_fully_shard, "__wrapped__", None) if REGISTRY_KEY is not None else None


def registered_apis(module: nn.Module) -> set[str]:
    """Names of the composable APIs applied to ``module`` (``"replicate"``, ``"checkpoint"``, ...)."""
    if REGISTRY_KEY is None:
        return set()
    registry = _get_registry(module)
    return set(registry) if registry else set()


def register_fully_shard(module: nn.Module, state: object) -> None:
    """Mark ``module`` as managed by ``fully_shard`` for torch's composable APIs.

    ``state`` is what torch's ``fully_shard.state(module)`` returns for it (pipelining reads the
    state that way; ``FSDPState`` answers the names it reads).
    """
    if REGISTRY_KEY is None:
        return
    registry = module.__dict__.setdefault(REGISTRY_KEY, OrderedDict())
    registry["fully_shard"] = RegistryItem()
    if _TORCH_STATE_KEY is not None:
        module.__dict__.setdefault(STATE_KEY, OrderedDict())[_TORCH_STATE_KEY] = state


def torch_state(module: nn.Module) -> Any:
    """What torch's ``fully_shard.state(module)`` answers: torch's state for a module torch sharded.

    Read without torch's lookup, which inserts an empty registry into every module it is asked about.
    """
    if REGISTRY_KEY is None or _TORCH_STATE_KEY is None:
        return None
    return module.__dict__.get(STATE_KEY, {}).get(_TORCH_STATE_KEY)


def pop_torch_state(module: nn.Module) -> Any:
    """Remove and return what ``register_fully_shard`` stored for torch's ``fully_shard.state``."""
    if REGISTRY_KEY is None or _TORCH_STATE_KEY is None:
        return None
    return module.__dict__.get(STATE_KEY, {}).pop(_TORCH_STATE_KEY, None)


def restore_torch_state(module: nn.Module, state: Any) -> None:
    """Put back what ``pop_torch_state`` removed."""
    if state is not None:
        module.__dict__.setdefault(STATE_KEY, OrderedDict())[_TORCH_STATE_KEY] = state
