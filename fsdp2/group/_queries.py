"""The queries of one group for the rooms above the engine: gradient accumulation's per-group switches.

Owns: ``group_name``, ``kept_grad_bytes``, ``held_grad_bytes`` and ``set_gradient_sync``, which
``fsdp2.accumulate`` (``optim/_accumulate.py``) calls on each group of ``runtime``'s ``groups_under``
instead of reading the group's fields. Does not own: the reduction of what was kept (the group's
``FSDPParamGroup.reduce_held_grads``).
"""

from __future__ import annotations

from ._param_group import FSDPParamGroup

__all__ = ["group_name", "held_grad_bytes", "kept_grad_bytes", "set_gradient_sync"]


def group_name(group: FSDPParamGroup) -> str:
    """The group's module name (``""``: the root; known from the root's first forward on)."""
    return group.module_fqn


def kept_grad_bytes(group: FSDPParamGroup) -> int:
    """Bytes of the unsharded gradients ``group`` holds when it skips a reduction.

    Kept in ``reduce_dtype`` where the policy sets one, else in the compute dtype; only trainable
    parameters count.
    """
    policy = group.config.mp_policy
    total = 0
    for fsdp_param in group.fsdp_params:
        if not fsdp_param.sharded_param.requires_grad:
            continue
        dtype = policy.reduce_dtype or policy.param_dtype or fsdp_param.orig_dtype
        total += fsdp_param.layout.orig_size.numel() * dtype.itemsize
    return total


def held_grad_bytes(group: FSDPParamGroup) -> int:
    """Bytes of the unsharded gradients ``group`` holds now (waiting for a reduction)."""
    return sum(t.numel() * t.element_size() for p in group.fsdp_params for t in p.unsharded.held_grads())


def set_gradient_sync(group: FSDPParamGroup, enabled: bool) -> bool:
    """Reduce ``group``'s gradients in each backward (``True``) or keep them; returns the old value."""
    previous = group.controls.reduce_grads
    group.controls.update(reduce_grads=enabled)
    return previous
