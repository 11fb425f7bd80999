"""The tensor-subclass all-gather extension (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``).

Owns: detecting the two hooks on a sharded parameter's local tensor (and refusing a change of them
after the first forward), calling them with fsdp2's arguments (both signatures of the pre hook),
checking what the pre hook returns, and the per-parameter record of one all-gather (input sizes,
metadata, inner tensors to free). Does not own: issuing the all-gather (``FSDPParamGroup``) or the
unsharded parameter's storage (``FSDPParam``).

[Note: All-gather extension]
A parameter whose local tensor (e.g. a float8 or int8 weight subclass) defines both hooks is gathered
through them. ``fsdp_pre_all_gather(mesh, orig_size, contiguous_orig_stride, module, mp_policy)`` (or
the legacy ``fsdp_pre_all_gather(mesh)``) returns ``(inputs, metadata)``: tensors of any dtypes that
are all-gathered in place of the shard (one collective for the group; bytes when dtypes differ).
When the parameter is unevenly sharded, every input must have the padded shard's dim-0 size, and
fsdp2 checks that on every rank together before the first all-gather of the group, so a wrong hook
raises on all ranks instead of hanging. ``fsdp_post_all_gather(outputs, metadata, param_dtype,
out=None)`` receives the gathered tensors (``(-1, *input_size[1:])``); the first time it returns
``(unsharded, inner_tensors)`` and fsdp2 keeps an original-size view of ``unsharded`` as the unsharded
parameter; later calls pass ``out=`` that parameter, after re-allocating the inner tensors, and the
hook fills it in place. Resharding frees the gathered outputs and the inner tensors.

The hooks are looked up on the local tensor, so a weight class may gain them after ``fully_shard``:
as in torch, each group looks again at its first forward (lazy init, also after a conversion or
``load_state_dict(assign=True)``). A local tensor of a tensor subclass therefore keeps a tensor of its
own (of its class) even without hooks, never a slot of the group's packed buffer. Hooks that appear
or disappear after that are refused at the next all-gather, before anything is gathered (torch 2.13
fails there too: ``AttributeError`` for hooks that appeared, a failed or stale gather for hooks that
went away).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

_PRE = "fsdp_pre_all_gather"
_POST = "fsdp_post_all_gather"
_TORCH_SUBCLASSES = "torch._subclasses"  # fake and functional tensors (tracing, memory estimates)


def has_extension(local: torch.Tensor, param_name: str) -> bool:
    """Whether ``local`` is, or may become by the first forward, an all-gather extension tensor.

    It defines both hooks, or it is a tensor subclass whose class may still gain them; either way its
    shard keeps a tensor of its own (the group does not pack it). :func:`defines_hooks` tells which.

    Raises:
        ValueError: only one of the two hooks is defined.
    """
    return defines_hooks(local, param_name) or may_gain_hooks(local)


def may_gain_hooks(local: torch.Tensor) -> bool:
    """Whether ``local`` is of a tensor subclass (a weight type).

    Not a plain tensor or parameter (of any ``nn.Parameter`` class: its data is plain), nor one of
    torch's tracing tensors (fake or functional).
    """
    cls = type(local)
    return (
        cls is not torch.Tensor
        and not issubclass(cls, nn.Parameter)
        and not cls.__module__.startswith(_TORCH_SUBCLASSES)
    )


def defines_hooks(local: torch.Tensor, param_name: str) -> bool:
    """Whether ``local`` defines the all-gather hooks; both or neither.

    Raises:
        ValueError: only one of the two hooks is defined.
    """
    pre, post = hasattr(local, _PRE), hasattr(local, _POST)
    if pre != post:
        missing = _POST if pre else _PRE
        raise ValueError(
            f"Parameter {param_name}: its local tensor ({type(local).__name__}) defines "
            f"{_PRE if pre else _POST} but not {missing}; the all-gather extension needs both."
        )
    return pre


def check_hooks_unchanged(local: torch.Tensor, param_name: str, had_hooks: bool) -> None:
    """Refuse hooks that appeared on (or went from) ``local``'s class since the first forward decided.

    Raises:
        AttributeError: the hooks appeared (torch 2.13 raises ``AttributeError`` there too).
        RuntimeError: the hooks went away.
    """
    has_hooks = defines_hooks(local, param_name)
    if has_hooks == had_hooks:
        return
    cls = type(local).__name__
    when = (
        "FSDP decides at the first forward (lazy init) whether a parameter all-gathers through them; "
        "nothing was gathered"
    )
    if has_hooks:
        raise AttributeError(
            f"Parameter {param_name}: its local tensor's class {cls} gained {_PRE} and {_POST} after the "
            f"first forward. {when}. Define the hooks on the class before the first forward (before or "
            "after fully_shard)."
        )
    raise RuntimeError(
        f"Parameter {param_name}: its local tensor ({cls}) no longer defines {_PRE} and {_POST}, which it "
        f"had at the first forward. {when}. Keep the hooks for the life of the model."
    )


@dataclass
class ExtensionRecord:
    """What one all-gather of an extension parameter needs between the pre and the post hook."""

    input_sizes: list[torch.Size] = field(default_factory=list)
    input_dtypes: list[torch.dtype] = field(default_factory=list)
    metadata: Any = None
    inner_tensors: Sequence[torch.Tensor] = ()


def call_pre_all_gather(
    local: torch.Tensor,
    mesh: Any,
    orig_size: torch.Size,
    contiguous_stride: tuple[int, ...],
    module: nn.Module,
    mp_policy: Any,
    param_name: str,
) -> tuple[list[torch.Tensor], Any]:
    """Call ``local.fsdp_pre_all_gather`` with the arguments its signature takes."""
    hook = getattr(local, _PRE)
    n_params = len(inspect.signature(hook).parameters)
    if n_params == 1:  # the legacy form
        result = hook(mesh)
    elif n_params == 5:
        result = hook(mesh, orig_size, contiguous_stride, module, mp_policy)
    else:
        raise TypeError(
            f"Parameter {param_name}: {type(local).__name__}.{_PRE} takes {n_params} arguments; expected "
            f"{_PRE}(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy) or the legacy "
            f"{_PRE}(self, mesh)."
        )
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(f"Parameter {param_name}: {_PRE} must return (all_gather_inputs, metadata).")
    inputs, metadata = result
    inputs = list(inputs)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise TypeError(f"Parameter {param_name}: {_PRE} must return a non-empty sequence of tensors.")
    return inputs, metadata


def padded_rule_holds(inputs: list[torch.Tensor], padded_rows: int) -> bool:
    """Every input has ``padded_rows`` rows (the rule for unevenly sharded parameters)."""
    return all(t.dim() > 0 and t.size(0) == padded_rows for t in inputs)


def padded_rule_error(param_names: list[str]) -> ValueError:
    return ValueError(
        f"fsdp_pre_all_gather returned all-gather inputs without the padded shard size for the unevenly "
        f"sharded parameter(s) {param_names} on at least one rank. Every input must have the padded "
        "shard's dim-0 size, ceil(orig_size[0] / mesh.size()) rows, on every rank (pad the last shards "
        "with zeros); nothing was all-gathered."
    )


def call_post_all_gather(
    local: torch.Tensor,
    outputs: list[torch.Tensor],
    record: ExtensionRecord,
    param_dtype: torch.dtype,
    out: torch.Tensor | None,
) -> tuple[torch.Tensor, Sequence[torch.Tensor]] | None:
    """Call ``local.fsdp_post_all_gather`` on the gathered outputs, reshaped to the inputs' trailing dims."""
    shaped = tuple(o.view(-1, *size[1:]) for o, size in zip(outputs, record.input_sizes, strict=True))
    hook = getattr(local, _POST)
    metadata, record.metadata = record.metadata, None
    if out is not None:
        hook(shaped, metadata, param_dtype, out=out)
        return None
    result = hook(shaped, metadata, param_dtype)
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor)):
        raise TypeError(
            f"{type(local).__name__}.{_POST} must return (unsharded_tensor, inner_tensors_to_free) when "
            "called without out=."
        )
    unsharded, inner = result
    return unsharded, tuple(inner)
