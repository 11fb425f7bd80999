"""The checks of a ``fully_shard`` or ``replicate`` call, every one before any state changes.

Owns: the validation of the modules (type, containers, torch's engine already on them), the mesh and
its device, the SPMD mesh and its data-parallel dims, ``reshard_after_forward``, the policies, the
ignored parameters, each parameter (device, dtype, subclass) and each tensor- or expert-parallel
parameter (its joined mesh), and each parameter's placement and mesh info (``shard_placement_fn``,
torch's ``ShardPlacementResult``), grouped by mesh info. Does not own: building the group and state,
the class swap (``_fully_shard.py``).
Invariants: nothing here changes a module, a parameter or any registry; a problem raises with its fix.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..base import (
    DataParallelMeshDims,
    MeshInfo,
    MixedPrecisionPolicy,
    OffloadPolicy,
    SpmdDims,
    data_and_tensor_parallel_mesh,
)
from ..runtime import get_state
from ._composable import registered_apis
from ._module import is_torch_fsdp_module
from ._setter_checks import describe


def validate_modules(module: Any, api: str = "fully_shard") -> tuple[nn.Module, ...]:
    """The root modules of a ``fully_shard`` or ``replicate`` call (``api``), type and container checked."""
    if isinstance(module, nn.Module):
        modules: tuple[nn.Module, ...] = (module,)
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward:
            raise ValueError(
                f"{api} does not support {type(module).__name__} directly: it has no forward, so "
                f"FSDP's hooks would never run. Call {api} on each of its children, or on the parent "
                "module."
            )
    elif isinstance(module, list) and module and all(isinstance(m, nn.Module) for m in module):
        modules = _list_roots(module)
    else:
        raise TypeError(
            f"{api} expects an nn.Module or a non-empty list of nn.Module, got {describe(module)}."
        )
    return modules


def validate_fully_shard_modules(module: Any) -> tuple[nn.Module, ...]:
    modules = validate_modules(module)
    for m in modules:
        if is_replicated(m):  # fsdp2's replicate or torch's (either one)
            raise ValueError(
                f"This {type(m).__name__} is already managed by replicate(); a module is either "
                "replicated or sharded. Apply fully_shard to its children before replicate(), or drop one."
            )
        if get_state(m) is not None:
            raise ValueError(
                f"fully_shard was already applied to this {type(m).__name__}; apply it once per module "
                "(bottom-up: each block first, then the root)."
            )
        refuse_torch_engine(m, "fully_shard")
    return modules


def refuse_torch_engine(module: nn.Module, api: str) -> None:
    """Refuse a tree in which torch's ``fully_shard`` or FSDP-based ``replicate`` manages a module.

    Two engines cannot mix. torch's classic (DDP-based) ``replicate`` is no FSDP module: a call skips
    such a subtree, as torch's ``fully_shard`` does.
    """
    for name, sub in module.named_modules():
        if is_torch_fsdp_module(sub) and get_state(sub) is None:  # torch's class without fsdp2's state
            where = f"its submodule {name!r} ({type(sub).__name__})" if name else f"this {type(sub).__name__}"
            raise ValueError(
                f"fsdp2.{api} was given a {type(module).__name__} of which {where} is managed by torch's "
                "fully_shard or replicate. One model cannot mix the two implementations (each schedules "
                "its own all-gathers and reductions). Use fsdp2.fully_shard and fsdp2.replicate for every "
                "module, or call fsdp2.patch_torch_fsdp() before the code that imports torch's fully_shard."
            )


def _list_roots(modules: list[nn.Module]) -> tuple[nn.Module, ...]:
    """The listed modules that are not inside another listed module, in list order, de-duplicated."""
    descendants: set[nn.Module] = set()
    for m in modules:
        descendants.update(sub for sub in m.modules() if sub is not m)
    roots: list[nn.Module] = []
    for m in modules:
        if m not in descendants and m not in roots:
            roots.append(m)
    return tuple(roots)


def validate_spmd_mesh(mesh: Any, dims: Any, reshard: Any) -> SpmdDims:
    """``DataParallelMeshDims``: check its names against ``mesh``, then resolve them (see ``SpmdDims``).

    Refuses what torch 2.13 refuses, with the same exception types: names not in mesh order
    (``KeyError``), a name given twice or as both shard and replicate, several shard dims that are not
    adjacent, or no dim at all (``RuntimeError``); an int ``reshard_after_forward`` with a shard dim
    (``NotImplementedError``).
    """
    if not isinstance(dims, DataParallelMeshDims):
        raise TypeError(f"dp_mesh_dims must be a DataParallelMeshDims, got {describe(dims)}.")
    if not isinstance(mesh, DeviceMesh) or mesh.mesh_dim_names is None:
        raise ValueError(
            "dp_mesh_dims names dims of the mesh, so fully_shard needs the full SPMD DeviceMesh with dim "
            "names, e.g. init_device_mesh(..., mesh_dim_names=('dp', 'tp')), passed as mesh=."
        )
    names = mesh.mesh_dim_names
    shard_names, replicate_names = dims.shard_names, dims.replicate_names
    for name in (*shard_names, *replicate_names):
        if name not in names:
            raise ValueError(f"dp_mesh_dims names {name!r}, which is not a dim of the mesh {names}.")
    if not shard_names and not replicate_names:
        raise RuntimeError(
            f"{dims} names no mesh dim (empty tuples); name the data-parallel dims of the mesh {names}, "
            "e.g. DataParallelMeshDims(shard='dp')."
        )
    for kind, group in (("shard", shard_names), ("replicate", replicate_names)):
        if len(set(group)) != len(group):
            raise RuntimeError(f"dp_mesh_dims {kind}={group} names a dim twice; name each dim once.")
        indices = [names.index(name) for name in group]
        if indices != sorted(indices):
            raise KeyError(
                f"dp_mesh_dims {kind}={group} does not follow the order of the mesh dims {names}; list "
                f"them in mesh order, {tuple(names[i] for i in sorted(indices))}."
            )
    both = set(shard_names) & set(replicate_names)
    if both:
        raise RuntimeError(
            f"dp_mesh_dims names {sorted(both)} as both shard and replicate dims; a dim is one or the other."
        )
    shard = [names.index(name) for name in shard_names]
    if shard and shard != list(range(shard[0], shard[0] + len(shard))):
        raise RuntimeError(
            f"dp_mesh_dims shard={shard_names}: several shard dims are flattened into one, so they must be "
            f"adjacent in the mesh {names}; reorder the mesh dims or flatten them into one named dim first."
        )
    if shard_names and not (reshard is None or isinstance(reshard, bool)):
        raise NotImplementedError(
            f"reshard_after_forward={reshard} (an int) is not supported with dp_mesh_dims; use True or False."
        )
    validate_mesh_device(mesh)
    return SpmdDims.build(mesh, shard_names, replicate_names)


def validate_spmd_param(
    param: nn.Parameter, name: str, mesh: DeviceMesh, dp_dims: SpmdDims, dim: int, default: bool
) -> None:
    """With ``dp_mesh_dims`` every parameter is a DTensor on exactly ``mesh``, replicated on its DP dims."""
    if not isinstance(param, DTensor) or param.device_mesh != mesh:
        where = f"a DTensor on {param.device_mesh}" if isinstance(param, DTensor) else "a plain tensor"
        raise ValueError(
            f"With dp_mesh_dims every parameter must be a DTensor on fully_shard's mesh {mesh}; {name} is "
            f"{where}. Distribute it on the full mesh (Replicate() on the data-parallel dims) first."
        )
    for index in sorted(dp_dims.dp_indices):
        if not param.placements[index].is_replicate():
            raise ValueError(
                f"With dp_mesh_dims, {name} must be Replicate() on the data-parallel dim "
                f"{mesh.mesh_dim_names[index] if mesh.mesh_dim_names else index}, got {param.placements}."
            )
    if not default:
        raise ValueError(
            f"{name}: with dp_mesh_dims, shard_placement_fn returned a ShardPlacementResult on another mesh; "
            "every parameter is sharded over fully_shard's own mesh (the dims dp_mesh_dims names). Return "
            "None or Shard(0) for it (torch's fully_shard raises ValueError here too)."
        )
    if dim != 0:
        raise NotImplementedError(
            f"{name}: with dp_mesh_dims fsdp2 shards on dim 0 of fully_shard's mesh only (shard_placement_fn "
            "must return None or Shard(0))."
        )


def validate_mesh(mesh: Any) -> MeshInfo:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard mesh must be a DeviceMesh, got {describe(mesh)}.")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard expects a 1-D mesh (FSDP) or a 2-D (replicate, shard) mesh (HSDP), got a "
            f"{mesh.ndim}-D mesh of shape {tuple(mesh.shape)}. Slice the data-parallel dims out of it."
        )
    validate_mesh_device(mesh)
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise ValueError(
            "fully_shard got a 2-D mesh without dim names; HSDP needs them to tell the replicate dim from "
            "the shard dim. Build it with init_device_mesh(..., mesh_dim_names=('replicate', 'shard'))."
        )
    return MeshInfo.from_mesh(mesh)


def validate_mesh_device(mesh: DeviceMesh) -> None:
    device_module = getattr(torch, mesh.device_type, None)
    if mesh.device_type != "cpu" and not (device_module is not None and device_module.is_available()):
        raise ValueError(
            f"The mesh is on device type {mesh.device_type!r}, which this process cannot use. "
            "Build the mesh on an available device type (e.g. 'cpu' with gloo)."
        )


def validate_reshard_after_forward(value: Any, shard_size: int, any_int: bool = False) -> None:
    """``any_int``: nothing is sharded (replicas only), so an int is accepted and has no effect."""
    if value is None or isinstance(value, bool):
        return
    if not isinstance(value, int):
        raise ValueError(f"reshard_after_forward must be a bool, an int or None, got {describe(value)}.")
    if any_int:
        return
    if value < 1 or value > shard_size or shard_size % value:
        raise ValueError(
            f"reshard_after_forward={value} must divide the shard world size {shard_size} (1 <= k <= "
            f"{shard_size}); pass a factor of {shard_size}, or True/False."
        )


def validate_policies(mp_policy: Any, offload_policy: Any) -> None:
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {describe(mp_policy)}.")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"offload_policy must be an OffloadPolicy, got {describe(offload_policy)}.")


def validate_ignored(ignored_params: Any) -> set[int]:
    if ignored_params is None:
        return set()
    if not isinstance(ignored_params, (set, frozenset, list, tuple)) or not all(
        isinstance(p, torch.Tensor) for p in ignored_params
    ):
        raise TypeError(f"ignored_params must be a set of parameters, got {describe(ignored_params)}.")
    return {id(p) for p in ignored_params}


def validate_param(param: nn.Parameter, name: str, device: torch.device, api: str = "fully_shard") -> None:
    verb = "shard" if api == "fully_shard" else "manage"
    if param.ndim == 0:
        raise ValueError(
            f"{api} cannot {verb} the scalar parameter {name}: expected at least 1 dim, got shape (). "
            "Use a 1-D tensor with one element."
        )
    if not param.is_contiguous():
        raise NotImplementedError(
            f"{api} does not support the non-contiguous parameter {name} (stride {param.stride()}); "
            "make it contiguous first, e.g. nn.Parameter(p.contiguous())."
        )
    if param.device.type not in ("meta", "cpu") and param.device != device:
        raise ValueError(
            f"Parameter {name} is on {param.device}, but the mesh communicates on {device}. Move the "
            f"module to {device} (or call torch.{device.type}.set_device) before {api}."
        )


def validate_tp_param(
    param: DTensor,
    name: str,
    mesh: DeviceMesh,
    reshard: Any,
    mesh_info: MeshInfo,
    joined: dict[tuple[int, int], DeviceMesh],
) -> DeviceMesh:
    """Check a tensor-parallel (DTensor) parameter; return its ``(dp..., tp...)`` mesh.

    ``joined``: the meshes joined so far in this call, by the ids of their two parts (a join builds a
    mesh over every rank: once per pair of meshes, not once per parameter).
    """
    placements = param.placements
    if param.device_mesh == mesh:
        raise ValueError(
            f"Parameter {name} is already a DTensor on fully_shard's own mesh: fully_shard was applied to a "
            "parent before this child. Apply it bottom-up: each block first, then the root."
        )
    if len(placements) > 2 or not all(type(p) in (Shard, Replicate) for p in placements):
        raise NotImplementedError(
            f"Parameter {name} is a DTensor with placements {placements}; fully_shard composes with 1-D "
            "tensor (or expert) parallelism and 2-D expert + tensor parallelism whose placements are "
            "Shard or Replicate."
        )
    spmd_mesh = joined.get((id(mesh), id(param.device_mesh)))
    if spmd_mesh is None:
        spmd_mesh = data_and_tensor_parallel_mesh(mesh, param.device_mesh, name)
        joined[id(mesh), id(param.device_mesh)] = spmd_mesh
    if not 2 <= spmd_mesh.ndim <= 4:
        raise NotImplementedError(
            f"Parameter {name}: data-parallel plus tensor-parallel mesh of {spmd_mesh.ndim} dims; fsdp2 "
            "supports 2 to 4 (FSDP or HSDP, times 1-D or 2-D TP/EP)."
        )
    if not (reshard is None or isinstance(reshard, bool) or reshard == mesh_info.shard_size):
        raise NotImplementedError(
            f"reshard_after_forward={reshard} (an int) is not supported with the tensor-parallel parameter "
            f"{name}; use True or False."
        )
    return spmd_mesh


def placement_of(
    param: nn.Parameter,
    name: str,
    placement_fn: Any,
    default_info: MeshInfo,
    reshard: Any,
    converted: dict[int, MeshInfo],
) -> tuple[int, MeshInfo]:
    """The dim ``shard_placement_fn`` asks to shard ``param`` on (0 by default) and its mesh info."""
    result = placement_fn(param) if placement_fn is not None else None
    info = default_info
    if result is not None and not isinstance(result, Shard):
        result, info = _placement_result(result, name, converted)
        validate_reshard_after_forward(reshard, info.shard_size)
    if result is None:
        return 0, info
    if not isinstance(result, Shard):
        raise ValueError(
            f"shard_placement_fn returned {result!r} for {name}: expected a Shard(dim) placement, a "
            "ShardPlacementResult or None."
        )
    dim = result.dim + param.ndim if result.dim < 0 else result.dim
    if not 0 <= dim < param.ndim:
        raise ValueError(
            f"shard_placement_fn returned Shard({result.dim}) for {name} of shape {tuple(param.shape)}: "
            f"expected a dim in [{-param.ndim}, {param.ndim})."
        )
    if dim == 0:
        return 0, info
    # FSDP shards what this rank holds: a tensor-parallel parameter's local tensor.
    size, what = (
        (param.to_local().size(dim), "local size")
        if isinstance(param, DTensor)
        else (param.size(dim), "size")
    )
    if size % info.shard_size:
        raise NotImplementedError(
            f"Shard({dim}) for {name} needs its {what} on dim {dim} ({size}) to be divisible by the shard "
            f"world size {info.shard_size}; fsdp2 pads only dim 0. Use Shard(0) for this parameter."
        )
    if not isinstance(reshard, bool) and reshard is not None and reshard != info.shard_size:
        raise NotImplementedError(
            f"reshard_after_forward={reshard} (an int) is not supported with Shard({dim}) for {name}; "
            "use True or False."
        )
    return dim, info


def _placement_result(result: Any, name: str, converted: dict[int, MeshInfo]) -> tuple[Any, MeshInfo]:
    """``(placement, mesh info)`` of a ``ShardPlacementResult``, fsdp2's or torch's (same fields)."""
    info = getattr(result, "mesh_info", None)
    if not hasattr(result, "placement") or info is None:
        raise ValueError(
            f"shard_placement_fn returned {result!r} for {name}: expected a Shard(dim) placement, a "
            "ShardPlacementResult or None."
        )
    if isinstance(info, MeshInfo):
        return result.placement, info
    # torch's FSDPMeshInfo / HSDPMeshInfo: same mesh and dims; one conversion per object per call.
    ours = converted.get(id(info))
    if ours is None:
        mesh, shard_dim = getattr(info, "mesh", None), getattr(info, "shard_mesh_dim", None)
        if not isinstance(mesh, DeviceMesh) or not isinstance(shard_dim, int):
            raise ValueError(
                f"shard_placement_fn returned a ShardPlacementResult for {name} whose mesh_info has no mesh "
                "and shard dim; build it with fsdp2.FSDPMeshInfo(mesh) or fsdp2.HSDPMeshInfo(mesh)."
            )
        ours = converted[id(info)] = MeshInfo.build(
            mesh, shard_dim, getattr(info, "replicate_mesh_dim", None)
        )
    return result.placement, ours


def with_outer_data_parallel(
    info: MeshInfo, own_mesh: DeviceMesh, dp_mesh: DeviceMesh, cache: dict[tuple[int, int], MeshInfo]
) -> MeshInfo:
    """``info`` for a DTensor parameter on ``own_mesh`` (e.g. ``ep``) sharded over ``info``'s mesh.

    The ranks of ``own_mesh`` that are also ranks of ``dp_mesh`` (``fully_shard``'s mesh, the other
    parameters' data-parallel ranks) hold different data, so the parameter's gradient is averaged
    over them too (see ``MeshInfo.outer_data_parallel``). One info object per pair, so that such
    parameters of one call share one group.
    """
    own = set(own_mesh.mesh.flatten().tolist())
    outer = len(own & set(dp_mesh.mesh.flatten().tolist())) or 1
    if outer == 1:
        return info
    key = (id(info), outer)
    found = cache.get(key)
    if found is None:
        found = cache[key] = info.with_outer_data_parallel(outer)
    return found


def group_by_mesh_info(
    infos: dict[int, MeshInfo], default_info: MeshInfo, params: dict[int, tuple[nn.Parameter, str]]
) -> list[tuple[MeshInfo, list[int]]]:
    """Parameters grouped by mesh info, in order of first use; one info object per process-group pair."""
    groups: dict[int, tuple[MeshInfo, list[int]]] = {}
    by_process_groups: dict[tuple[int, int, int], tuple[MeshInfo, str]] = {}
    for key, info in infos.items():
        pg_key = (id(info.shard_group), id(info.replicate_group), info.outer_data_parallel)
        seen = by_process_groups.setdefault(pg_key, (info, params[key][1]))
        if seen[0] is not info:
            raise ValueError(
                f"Parameters {seen[1]} and {params[key][1]} use the same process groups through two "
                "different mesh-info objects; parameters that share process groups must share one mesh-info "
                "object (build it once and return it for both from shard_placement_fn)."
            )
        groups.setdefault(id(info), (info, []))[1].append(key)
    return list(groups.values())


def is_replicated(module: nn.Module) -> bool:
    """Whether ``replicate`` (fsdp2's, or either of torch's) manages ``module``: calls skip its subtree."""
    return "replicate" in registered_apis(module)
