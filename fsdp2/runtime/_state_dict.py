"""State-dict hooks of fully_shard modules.

Owns: the hooks ``FSDPState`` registers on each module it manages: before ``state_dict()`` and
``load_state_dict()`` the group is resharded (both always see the sharded DTensor parameters); after
``state_dict()`` its DTensors share the parameters' version counters (writes into them are seen); before
a load, plain full-size tensors in the state dict are turned into this rank's DTensor shards (so the
unsharded model's ``state_dict()`` loads directly, also with ``assign=True``); after an
``assign=True`` load the new DTensors are re-padded into local shards. Does not own: the chunk math
(``FSDPParam.shard_full_tensor``) or DCP's helpers, which need none of this.
Invariants: a load pre-hook either converts every plain entry it is responsible for or raises before
any parameter is written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..group import FSDPParamGroup

StateOf = Callable[[nn.Module], Any]  # module -> its FSDPState (or None); passed in, no import cycle


def register_state_dict_hooks(module: nn.Module, group: FSDPParamGroup, state_of: StateOf) -> list[Any]:
    """Register the save/load hooks of ``group`` on ``module`` (one of its modules); return the handles."""

    def reshard_for_save(mod: nn.Module, prefix: str, keep_vars: bool) -> None:
        group.reshard()

    def prepare_load(mod: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        group.release()
        shard_full_tensors(mod, state_dict, prefix, state_of)

    def adopt_loaded(mod: nn.Module, incompatible_keys: Any) -> None:
        # load_state_dict(assign=True) installs new DTensors: re-pad them into local shards.
        with torch.no_grad():
            group.readopt_sharded_params()

    def share_versions(mod: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # In-place writes into the returned tensors (fsdp2's loads, DCP's in-place load) must bump the
        # parameters' version counters, which a kept copy checks (see [Note: A kept copy]).
        names = {id(module): name for name, module in mod.named_modules()}
        for fsdp_param in group.fsdp_params:
            for owner, attr in fsdp_param.owners:
                name = names.get(id(owner))
                key = f"{prefix}{name}.{attr}" if name else f"{prefix}{attr}"
                value = state_dict.get(key) if name is not None else None
                if isinstance(value, DTensor) and not isinstance(
                    value, nn.Parameter
                ):  # keep_vars: the parameter
                    state_dict[key] = fsdp_param.detached_sharded()

    return [
        module.register_state_dict_pre_hook(reshard_for_save),
        module.register_state_dict_post_hook(share_versions),
        module.register_load_state_dict_pre_hook(prepare_load),
        module.register_load_state_dict_post_hook(adopt_loaded),
    ]


def shard_full_tensors(root: nn.Module, state_dict: dict[str, Any], prefix: str, state_of: StateOf) -> None:
    """Replace plain tensors for fsdp2 parameters under ``root`` by this rank's DTensor shards.

    Plain tensors of the full parameter shape are sharded (no communication: each rank keeps its
    chunk). Any other plain tensor for a sharded parameter makes it raise before anything changes.

    Raises:
        RuntimeError: a plain tensor whose shape is not the parameter's full shape (e.g. a local shard
            saved without its DTensor wrapper).
    """
    names = {module: name for name, module in root.named_modules()}
    conversions: dict[str, DTensor] = {}
    wrong: list[str] = []
    seen: set[int] = set()
    for module in names:
        state = state_of(module)
        for group in getattr(state, "groups", ()):
            if id(group) in seen:
                continue
            seen.add(id(group))
            _convert_group(group, names, state_dict, prefix, conversions, wrong)
    if wrong:
        raise RuntimeError(
            "load_state_dict got plain tensors for sharded fsdp2 parameters that are neither DTensors nor "
            f"the full parameter: {'; '.join(wrong)}. Nothing was loaded. Load the full (unsharded) tensors "
            "or the DTensors of state_dict(), or use torch.distributed.checkpoint.state_dict."
            "set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True))."
        )
    state_dict.update(conversions)


def _convert_group(
    group: FSDPParamGroup,
    names: dict[nn.Module, str],
    state_dict: dict[str, Any],
    prefix: str,
    conversions: dict[str, DTensor],
    wrong: list[str],
) -> None:
    for fsdp_param in group.fsdp_params:
        for owner, attr in fsdp_param.owners:
            owner_name = names.get(owner)
            if owner_name is None:
                continue
            key = f"{prefix}{owner_name}.{attr}" if owner_name else f"{prefix}{attr}"
            value = state_dict.get(key)
            if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
                continue
            if value.size() != fsdp_param.global_size:
                wrong.append(f"{key}: got {tuple(value.shape)}, full shape {tuple(fsdp_param.global_size)}")
                continue
            conversions[key] = fsdp_param.shard_full_tensor(value)
