"""Interop with torch's composable-API registry (``replicate``, ``checkpoint``).

Owns: reading and writing the per-module registry through which torch's composable APIs see each
other, so torch's ``replicate`` refuses a module fsdp2 manages and fsdp2 refuses (or skips) a module
``replicate`` manages, and the state torch's ``fully_shard.state`` / ``replicate.state`` answer for
fsdp2's modules. This is the only module that touches that registry.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from torch import nn

try:  # the registry is private to torch; degrade to "no registry" if it moves
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY, RegistryItem, _get_registry
    from torch.distributed._composable.replicate_with_fsdp import replicate as _torch_replicate
    from torch.distributed.fsdp import fully_shard as _torch_fully_shard
except ImportError:  # pragma: no cover - depends on the torch version
    REGISTRY_KEY = None

# The keys under which torch's ``fully_shard.state(module)`` and ``replicate.state(module)`` look a
# module's state up: the functions their ``@contract`` decorators wrapped.
_TORCH_STATE_KEY = getattr(_torch_fully_shard, "__wrapped__", None) if REGISTRY_KEY is not None else None
_TORCH_REPLICATE_KEY = getattr(_torch_replicate, "__wrapped__", None) if REGISTRY_KEY is not None else None


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


def register_replicate(module: nn.Module, state: object) -> None:
    """Mark ``module`` as managed by ``replicate`` for torch's composable APIs.

    torch's ``fully_shard`` (and fsdp2's) then skip its subtree, and torch's
    ``replicate_with_fsdp.replicate.state(module)`` answers ``state`` (pipelining reads it that way).
    """
    if REGISTRY_KEY is None:
        return
    module.__dict__.setdefault(REGISTRY_KEY, OrderedDict())["replicate"] = RegistryItem()
    if _TORCH_REPLICATE_KEY is not None:
        module.__dict__.setdefault(STATE_KEY, OrderedDict())[_TORCH_REPLICATE_KEY] = state


def torch_state(module: nn.Module) -> Any:
    """What torch's ``fully_shard.state(module)`` answers: torch's state for a module torch sharded.

    Read without torch's lookup, which inserts an empty registry into every module it is asked about.
    """
    if REGISTRY_KEY is None or _TORCH_STATE_KEY is None:
        return None
    return module.__dict__.get(STATE_KEY, {}).get(_TORCH_STATE_KEY)


def pop_torch_state(module: nn.Module) -> Any:
    """Remove and return what ``register_fully_shard`` / ``register_replicate`` stored for torch."""
    if REGISTRY_KEY is None or _TORCH_STATE_KEY is None:
        return None
    states = module.__dict__.get(STATE_KEY, {})
    fully_shard_state = states.pop(_TORCH_STATE_KEY, None)
    replicate_state = states.pop(_TORCH_REPLICATE_KEY, None)
    replicate_item = None
    if replicate_state is not None:  # a plain copy must not look replicated
        replicate_item = module.__dict__.get(REGISTRY_KEY, {}).pop("replicate", None)
    return fully_shard_state, replicate_state, replicate_item


def restore_torch_state(module: nn.Module, popped: Any) -> None:
    """Put back what ``pop_torch_state`` removed."""
    if popped is None:
        return
    fully_shard_state, replicate_state, replicate_item = popped
    states = module.__dict__.setdefault(STATE_KEY, OrderedDict())
    if fully_shard_state is not None:
        states[_TORCH_STATE_KEY] = fully_shard_state
    if replicate_state is not None:
        states[_TORCH_REPLICATE_KEY] = replicate_state
    if replicate_item is not None:
        module.__dict__.setdefault(REGISTRY_KEY, OrderedDict())["replicate"] = replicate_item
