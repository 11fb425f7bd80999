"""``replicate()``: data parallelism on fsdp2's engine, each parameter whole on every rank.

Owns: ``replicate``'s own checks (the module, the 1-D mesh or the replicate-only ``dp_mesh_dims``) and
its errors, with torch's exception types where torch refuses the same thing. The rest is
``fully_shard``'s (``apply_call`` in ``_fully_shard.py``): one group per call over a replicas-only mesh
info (``MeshInfo.replicated``: a "shard" that is the whole tensor, no all-gather, gradients averaged by
one all-reduce per group, queued as the reduce-scatters are; under ``set_bucket_cap_mb`` consecutive
groups share one), the state and the class swap to ``Replicate<Name>`` (``ReplicateModule``,
``_module.py``). Does not own: hooks or collectives.
Invariants: a failed ``replicate`` leaves the module exactly as it was.
"""

from __future__ import annotations

from typing import Any, overload

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..base import (
    DataParallelMeshDims,
    MeshInfo,
    MixedPrecisionPolicy,
    OffloadPolicy,
    as_fsdp2_policy,
    default_mesh,
)
from ..runtime import get_state
from ._composable import registered_apis
from ._fully_shard import Call, apply_call
from ._module import ReplicateModule
from ._setter_checks import describe
from ._validate import (
    is_replicated,
    refuse_torch_engine,
    validate_mesh_device,
    validate_modules,
    validate_spmd_mesh,
)


class AppliedTwiceError(ValueError, AssertionError):
    """``replicate`` on a module it manages (torch: ``AssertionError``; fsdp2's calls: ``ValueError``)."""


class ManagedByFullyShardError(ValueError, RuntimeError):
    """``replicate`` on a module ``fully_shard`` manages (torch: ``RuntimeError``)."""


@overload
def replicate(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ...,
) -> ReplicateModule: ...
@overload
def replicate(
    module: list[nn.Module],
    *,
    mesh: DeviceMesh | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ...,
) -> list[ReplicateModule]: ...


def replicate(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 - frozen, shared safely
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 - frozen, shared safely
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> ReplicateModule | list[ReplicateModule]:
    """Replicate ``module``'s parameters on every rank of ``mesh`` and average gradients, in place.

    torch 2.13's ``torch.distributed._composable.replicate_with_fsdp.replicate`` on fsdp2's engine.
    Each managed parameter becomes an ``nn.Parameter`` DTensor with placement ``Replicate()`` on the
    1-D ``mesh``; the module's class becomes ``Replicate<Name>``, a subclass of
    :class:`ReplicateModule` (an :class:`FSDPModule`, and torch's ``ReplicateModule`` and
    ``FSDPModule``) and of the original class. Call it bottom-up like ``fully_shard``: each call is one
    group, whose gradients are averaged over the mesh by one all-reduce after its backward (queued
    like ``fully_shard``'s reduce-scatters; with ``set_bucket_cap_mb(reduce_scatter=...)`` on the
    root, consecutive groups share one all-reduce). Parameters are never resharded after
    forward. It mixes with ``fully_shard`` in one model: each call skips the modules the other
    manages.

    Args:
        module: the module, or a list of modules replicated as one group.
        mesh: 1-D mesh of the replicas. Default: every rank of the default process group.
        mp_policy: mixed-precision dtypes.
        offload_policy: where the parameters live between uses (``CPUOffloadPolicy``: on the CPU).
        ignored_params: parameters left alone (plain tensors, gradients not averaged).
        dp_mesh_dims: with a full SPMD ``mesh`` whose parameters are already DTensors on it, the
            replicate dims (``DataParallelMeshDims(replicate=...)``; no shard dims).

    Returns:
        ``module`` itself (the same list for a list).

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` or a list of them.
        ValueError: a mesh that is not 1-D, shard dims in ``dp_mesh_dims``, a module already managed
            by ``replicate`` (also an ``AssertionError``, as torch's) or by ``fully_shard`` (also a
            ``RuntimeError``, as torch's), a scalar parameter.
        NotImplementedError: a non-contiguous parameter, a DTensor parameter without ``dp_mesh_dims``.

    Example:
        >>> for block in model.layers:  # doctest: +SKIP
        ...     replicate(block)
        >>> replicate(model)  # doctest: +SKIP
    """
    modules = validate_modules(module, "replicate")
    for m in modules:
        _refuse_managed(m)
    if mesh is None:
        mesh = default_mesh(("replicate",))
    dp_mesh_dims = as_fsdp2_policy(dp_mesh_dims)
    dp_dims = None
    if dp_mesh_dims is None:
        mesh_info = _validate_mesh(mesh)
    else:
        dp_dims = validate_spmd_mesh(mesh, dp_mesh_dims, None)
        if not dp_dims.mesh_info.replicate_only:
            raise ValueError(
                f"replicate() with dp_mesh_dims needs replicate dims only, got shard={dp_mesh_dims.shard!r}. "
                "Use fully_shard() to shard, or DataParallelMeshDims(replicate=...)."
            )
        mesh_info = dp_dims.mesh_info
    args: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": mp_policy,
        "offload_policy": offload_policy,
        "ignored_params": ignored_params,
        "dp_mesh_dims": dp_mesh_dims,
    }
    apply_call(Call("replicate", modules, mesh_info, dp_dims, args))
    return module  # type: ignore[return-value]  # reason: the class swap made it a ReplicateModule


def _state_of(module: nn.Module) -> Any:
    """``replicate.state(module)``: the state of a replicated module (``None`` if it is not)."""
    state = get_state(module)
    return state if state is not None and state.api == "replicate" else None


replicate.state = _state_of  # type: ignore[attr-defined]  # reason: torch's replicate has .state


def _refuse_managed(module: nn.Module) -> None:
    state = get_state(module)
    name = type(module).__name__
    if state is not None and state.api == "replicate":
        raise AppliedTwiceError(
            f"replicate was already applied to this {name}; apply it once per module (bottom-up: each "
            "block first, then the root)."
        )
    if state is not None or "fully_shard" in registered_apis(module):
        raise ManagedByFullyShardError(
            f"Cannot apply replicate() to this {name}: it is already managed by fully_shard. A module is "
            "either replicated or sharded: apply replicate to the modules fully_shard does not manage "
            "(its children before it, or the parent after it)."
        )
    if is_replicated(module):
        raise ValueError(
            f"This {name} is already managed by torch's replicate(); one model cannot mix torch's and "
            "fsdp2's implementations. Use fsdp2.replicate for every module."
        )
    refuse_torch_engine(module, "replicate")


def _validate_mesh(mesh: Any) -> MeshInfo:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"replicate mesh must be a DeviceMesh, got {describe(mesh)}.")
    if mesh.ndim != 1:
        raise ValueError(
            f"replicate expects a 1-D DeviceMesh, got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}. "
            "Pass the replicate dim's slice (mesh['dp']), or the full mesh with "
            "dp_mesh_dims=DataParallelMeshDims(replicate=...)."
        )
    validate_mesh_device(mesh)
    return MeshInfo.replicated(mesh)
