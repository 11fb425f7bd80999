"""Interop with torch's composable-API registry (``replicate``, ``checkpoint``).

Owns: reading and writing the per-module registry through which torch's composable APIs see each
other, so torch's ``replicate`` refuses a module fsdp2 manages and fsdp2 refuses (or skips) a module
``replicate`` manages. This is the only module that touches that registry.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

try:  # the registry is private to torch; degrade to "no registry" if it moves
    from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem, _get_registry
except ImportError:  # pragma: no cover - depends on the torch version
    REGISTRY_KEY = None


def registered_apis(module: nn.Module) -> set[str]:
    """Names of the composable APIs applied to ``module`` (``"replicate"``, ``"checkpoint"``, ...)."""
    if REGISTRY_KEY is None:
        return set()
    registry = _get_registry(module)
    return set(registry) if registry else set()


def register_fully_shard(module: nn.Module) -> None:
    """Mark ``module`` as managed by ``fully_shard`` for torch's composable APIs."""
    if REGISTRY_KEY is None:
        return
    registry = module.__dict__.setdefault(REGISTRY_KEY, OrderedDict())
    registry["fully_shard"] = RegistryItem()
