"""What a load does with non-persistent buffers that ``to_empty`` left unset.

Owns: ``rebuild_buffers``: each unset non-persistent buffer (see [Note: Non-persistent buffers and
to_empty] in ``base/_buffers.py``) is rebuilt as ``from_pretrained`` rebuilds it, by the
``transformers`` model's own ``_init_weights`` on the module that holds it, with every other tensor of
that module marked initialised so that ``transformers``' init functions leave it alone. A buffer
nothing can rebuild is named in the problem the load raises, before any parameter changes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..base import unset_buffers

__all__ = ["rebuild_buffers"]

_FLAG = "_is_hf_initialized"  # transformers' init functions skip a tensor that carries it


def rebuild_buffers(model: nn.Module, caller: str) -> str:
    """Rebuild ``model``'s unset non-persistent buffers; the problem with those left, or ``""``."""
    unset = unset_buffers(model)
    if not unset:
        return ""
    init_weights = _hf_init_weights(model)
    if init_weights is not None:
        owners = list({id(owner): owner for _, owner, _ in unset}.values())
        unset_ids = {id(owner._buffers[name]) for _, owner, name in unset}  # noqa: SLF001
        with torch.no_grad():
            for owner in owners:
                _init_buffers_only(owner, unset_ids, init_weights)
        unset = unset_buffers(model)
    if not unset:
        return ""
    names = ", ".join(qualified for qualified, _, _ in unset)
    how = (
        "its _init_weights did not set them"
        if init_weights is not None
        else "it is not a transformers model, whose _init_weights would rebuild them"
    )
    return (
        f"non-persistent buffer(s) {names} hold uninitialised memory: the model was built on the meta "
        f"device and to_empty'd, checkpoints do not hold such buffers, and {how}. Compute them after "
        f"to_empty (as the module's constructor does) and before {caller}."
    )


def _hf_init_weights(model: nn.Module) -> Callable[[nn.Module], None] | None:
    """The ``transformers`` model's ``_init_weights`` (``from_pretrained``'s rebuild), or ``None``."""
    init_weights = getattr(model, "_init_weights", None)
    if callable(init_weights) and getattr(model, "config", None) is not None:
        return init_weights  # type: ignore[no-any-return]
    return None


def _init_buffers_only(
    owner: nn.Module, unset_ids: set[int], init_weights: Callable[[nn.Module], None]
) -> None:
    """``init_weights(owner)`` with every tensor of ``owner`` but its unset buffers marked initialised."""
    flagged = []
    tensors = [*owner.parameters(recurse=False), *owner.buffers(recurse=False)]
    for tensor in tensors:
        if id(tensor) not in unset_ids and not getattr(tensor, _FLAG, False):
            setattr(tensor, _FLAG, True)
            flagged.append(tensor)
    try:
        init_weights(owner)
    finally:
        for tensor in flagged:
            delattr(tensor, _FLAG)
