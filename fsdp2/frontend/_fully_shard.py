"""``fully_shard()``: validate, build the group and state, swap the module's class.

Owns: the order of a call (every check of ``_validate.py`` first, then the changes), collecting
managed modules and parameters into ``ParamSpec``/``GroupConfig`` records, building the
``FSDPParamGroup`` and ``FSDPState``, and the class swap. Does not own: the checks (``_validate.py``),
the ``FSDPModule`` mixin and ``FSDP<Name>`` classes (``_module.py``), hooks (``_state.py``) or
communication.
Invariants: a failed ``fully_shard`` leaves the module exactly as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, overload

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from typing_extensions import TypedDict, Unpack

from ..base import (
    DataParallelMeshDims,
    GroupConfig,
    MeshInfo,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ParamSpec,
    ShardPlacementResult,
    SpmdDims,
    as_fsdp2_policy,
    default_mesh,
    mesh_device,
    post_forward_mesh_info,
)
from ..group import FSDPParamGroup, build_group
from ..param import check_subclass_shardable, watch_registrations
from ..runtime import FSDPState, get_state, mark_replaced, watch_optimizer_steps
from ._composable import register_fully_shard, register_replicate, torch_state
from ._module import FSDPModule, fsdp_class, replicate_class
from ._validate import (
    group_by_mesh_info,
    is_replicated,
    placement_of,
    validate_fully_shard_modules,
    validate_ignored,
    validate_mesh,
    validate_param,
    validate_policies,
    validate_reshard_after_forward,
    validate_spmd_mesh,
    validate_spmd_param,
    validate_tp_param,
    with_outer_data_parallel,
)

PlacementFn = Callable[[nn.Parameter], "Shard | ShardPlacementResult | None"]


class _Options(TypedDict, total=False):
    """The keyword arguments of ``fully_shard`` (for the typed overloads below)."""

    mesh: DeviceMesh | None
    reshard_after_forward: bool | int | None
    shard_placement_fn: PlacementFn | None
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy
    ignored_params: set[nn.Parameter] | None
    dp_mesh_dims: DataParallelMeshDims | None


_ON_FIRST_CALL: list[Callable[[], None]] = []  # run by every fully_shard call, before it shards


def on_first_fully_shard(hook: Callable[[], None]) -> None:
    """Run ``hook`` (idempotent) when ``fully_shard`` shards a module: how rooms above join in."""
    if hook not in _ON_FIRST_CALL:
        _ON_FIRST_CALL.append(hook)


@overload
def fully_shard(module: nn.Module, **options: Unpack[_Options]) -> FSDPModule: ...
@overload
def fully_shard(module: list[nn.Module], **options: Unpack[_Options]) -> list[FSDPModule]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: PlacementFn | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 - frozen, shared safely
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 - frozen, shared safely
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> FSDPModule | list[FSDPModule]:
    """Shard ``module``'s parameters across the data-parallel ranks of ``mesh``, in place.

    Each managed parameter is replaced by an ``nn.Parameter`` DTensor sharded on dim 0 (rows follow
    ``torch.chunk``); the module's class becomes ``FSDP<Name>``, a subclass of :class:`FSDPModule` and
    of the original class. Call it bottom-up: on each block, then on the root. Parameters already
    managed by an inner call are left to it. All parameters of one call form one group, which issues
    one all-gather before its forward (and before its backward if resharded) and one reduce-scatter
    of gradients after its backward.

    Args:
        module: the module, or a list of modules sharded as one group (e.g. tied embedding and head).
        mesh: 1-D mesh to shard over, or 2-D ``(replicate, shard)`` mesh for HSDP. Default: every rank
            of the default process group on the default device type.
        reshard_after_forward: ``True`` frees the unsharded parameters after forward and gathers them
            again in backward; ``False`` keeps them until backward; ``None`` means ``True`` except for
            the root, which keeps them (its backward starts right away); an ``int`` k reshards to a
            k-rank slice after forward so backward gathers over k ranks only.
        shard_placement_fn: returns the placement for a parameter: ``None`` (``Shard(0)``), ``Shard(d)``
            for any dim of the parameter, or a ``ShardPlacementResult`` (a placement and its own mesh).
        mp_policy: mixed-precision dtypes.
        offload_policy: where sharded parameters live.
        ignored_params: parameters left unsharded and unreduced.
        dp_mesh_dims: with a full SPMD ``mesh`` whose parameters are already DTensors on it, which named
            dims are data parallel (see :class:`DataParallelMeshDims`): shard dims (several are
            flattened into one), replicate dims, or both.

    Returns:
        ``module`` itself (the same list for a list).

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` or a list of them.
        ValueError: a bad mesh, ``reshard_after_forward``, repeated call, scalar parameter.
        NotImplementedError: a non-contiguous parameter, or a tensor-parallel one fsdp2 cannot combine.

    Example:
        >>> for block in model.layers:  # doctest: +SKIP
        ...     fully_shard(block)
        >>> fully_shard(model)  # doctest: +SKIP
    """
    modules = validate_fully_shard_modules(module)
    mesh = mesh if mesh is not None else default_mesh()
    dp_mesh_dims = as_fsdp2_policy(dp_mesh_dims)
    dp_dims = None
    if dp_mesh_dims is None:
        mesh_info = validate_mesh(mesh)
    else:
        dp_dims = validate_spmd_mesh(mesh, dp_mesh_dims, reshard_after_forward)
        mesh_info = dp_dims.mesh_info
    # Replicas only: nothing is sharded, so an int has no sharding to divide (torch ignores it too).
    validate_reshard_after_forward(reshard_after_forward, mesh_info.shard_size, mesh_info.replicate_only)
    args = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "shard_placement_fn": shard_placement_fn,
        "mp_policy": mp_policy,
        "offload_policy": offload_policy,
        "ignored_params": ignored_params,
        "dp_mesh_dims": dp_mesh_dims,
    }
    apply_call(Call("fully_shard", modules, mesh_info, dp_dims, args))
    return module  # type: ignore[return-value]  # reason: the class swap made it an FSDPModule


@dataclass(frozen=True)
class Call:
    """One ``fully_shard`` or ``replicate`` call after its own checks of the module and mesh.

    ``args``: the call's keyword arguments as given (``replicate`` has no ``reshard_after_forward`` or
    ``shard_placement_fn``: ``None``); a deep copy calls ``api`` again with them.
    """

    api: str  # "fully_shard" or "replicate"
    modules: tuple[nn.Module, ...]
    mesh_info: MeshInfo
    dp_dims: SpmdDims | None
    args: dict[str, Any]


def apply_call(call: Call) -> FSDPState:
    """Check the rest (policies, parameters), then build the groups and state and swap the classes.

    Everything that can be refused is refused before the first change to a module.
    """
    modules, mesh_info, dp_dims, args = call.modules, call.mesh_info, call.dp_dims, call.args
    mesh: DeviceMesh = args["mesh"]
    reshard_after_forward = args.get("reshard_after_forward")
    shard_placement_fn = args.get("shard_placement_fn")
    ignored_params = args["ignored_params"]
    mp_policy, offload_policy = as_fsdp2_policy(args["mp_policy"]), as_fsdp2_policy(args["offload_policy"])
    validate_policies(mp_policy, offload_policy)
    ignored = validate_ignored(ignored_params)
    device = mesh_device(mesh)
    managed = _managed_modules(modules)
    params = _managed_params(managed, ignored)
    _refuse_aliased(params)
    shard_dims: dict[int, int] = {}
    spmd_meshes: dict[int, DeviceMesh] = {}
    joined: dict[tuple[int, int], DeviceMesh] = {}  # (dp mesh, tp mesh) ids -> their joined mesh
    infos: dict[int, MeshInfo] = {}  # parameter -> the mesh info of its group
    converted: dict[int, MeshInfo] = {}  # torch's mesh-info objects -> ours, once per call
    outer_infos: dict[tuple[int, int], MeshInfo] = {}  # (mesh info, outer dp ranks) -> its info
    for key, (param, name) in params.items():
        validate_param(param, name, device, call.api)
        dim, info = placement_of(param, name, shard_placement_fn, mesh_info, reshard_after_forward, converted)
        if dim == 0 and not isinstance(param, DTensor):
            check_subclass_shardable(param, name, info.shard_size, info.shard_rank)
        if dim:
            shard_dims[key] = dim
        if dp_dims is not None:
            validate_spmd_param(param, name, mesh, dp_dims, dim, info is mesh_info)
            infos[key] = info
            continue
        if isinstance(param, DTensor):
            if mesh_info.replicate_only:
                raise NotImplementedError(
                    f"replicate does not support the DTensor (tensor-parallel) parameter {name} on a 1-D "
                    "mesh. Pass the full SPMD mesh with dp_mesh_dims=DataParallelMeshDims(replicate=...), "
                    "or use fully_shard."
                )
            # Its own mesh info: e.g. experts on an ``ep`` mesh, sharded over their own dp mesh.
            own = info is not mesh_info
            spmd_meshes[key] = validate_tp_param(param, name, info.mesh, reshard_after_forward, info, joined)
            if own:
                info = with_outer_data_parallel(info, param.device_mesh, mesh, outer_infos)
        infos[key] = info
    by_info = group_by_mesh_info(infos, mesh_info, params)
    # ---- no state has changed up to here ----
    mark_replaced([param for param, _ in params.values()])  # an optimizer built before would not train them
    _move_to_device(managed, params, device)
    groups: list[FSDPParamGroup] = []
    owners = _owners(managed, params) if params else {}
    for info, keys in by_info:
        specs = [
            ParamSpec(
                params[key][0], tuple(owners[key]), shard_dims.get(key, 0), spmd_meshes.get(key), dp_dims
            )
            for key in keys
        ]
        post_info = (
            None  # replicas only: the parameters are never sharded, so nothing is resharded after forward
            if info.replicate_only
            else post_forward_mesh_info(
                True if reshard_after_forward is None else reshard_after_forward, info
            )
        )
        group = build_group(specs, modules, GroupConfig(info, mp_policy, offload_policy, device), post_info)
        # An explicit False keeps parameters unsharded after no-grad forwards too (eval loops); so
        # does replicate, which never reshards after forward (as torch's).
        keep = reshard_after_forward is False or call.api == "replicate"
        group.controls.update(reshard_after_no_grad_forward=not keep)
        groups.append(group)
    auto = reshard_after_forward is None and call.api == "fully_shard"
    state = FSDPState(modules, groups, auto_reshard=auto, mp_policy=mp_policy)
    if groups:
        watch_optimizer_steps()
    for hook in _ON_FIRST_CALL:  # after the step guard: its checks run before the rooms' step work
        hook()  # e.g. automatic local-shard and whole-tensor optimizer steps (``optim``); idempotent
    watch_registrations()
    # The same set is often passed to every call; ones in none of these modules are checked against
    # the whole tree at the root's first forward.
    present = {id(p) for m in modules for p in m.parameters()}
    state.foreign_ignored = [p for p in ignored_params or () if id(p) not in present]
    state.api = call.api
    state.shard_args = dict(args)
    for managed_module in managed:
        managed_module.__dict__["_is_fsdp_managed_module"] = True
        managed_module.__dict__["_fsdp_use_orig_params"] = True
    for root in modules:
        for sub in root.modules():
            inner = get_state(sub)
            if inner is not None and inner is not state and inner not in state.descendants:
                inner.mark_nested()  # not a top-level FSDP module any more (see _compiled.py)
                state.descendants.append(inner)
        if call.api == "replicate":
            register_replicate(root, state)
            root.__class__ = replicate_class(type(root))
        else:
            register_fully_shard(root, state)
            root.__class__ = fsdp_class(type(root))
    return state


def _state_of(module: nn.Module) -> Any:
    """``fully_shard.state(module)``: the state of a sharded module (``None`` if it is not sharded).

    Torch's ``fully_shard`` has this attribute too (``torch.distributed.pipelining`` reads it), so it
    works the same after :func:`fsdp2.patch_torch_fsdp`: a module sharded by torch's ``fully_shard``
    before the patch answers torch's state.
    """
    state = get_state(module)
    return state if state is not None else torch_state(module)


fully_shard.state = _state_of  # type: ignore[attr-defined]  # reason: torch's fully_shard has .state


# ---- collection and set-up ---------------------------------------------------------------------


def _managed_modules(roots: tuple[nn.Module, ...]) -> list[nn.Module]:
    """Modules under ``roots`` whose direct parameters this call manages (post-order, de-duplicated)."""
    seen: set[nn.Module] = set()
    order: list[nn.Module] = []

    def visit(module: nn.Module, is_root: bool) -> None:
        if module in seen:
            return
        seen.add(module)
        if not is_root and (get_state(module) is not None or is_replicated(module)):
            return
        for child in module.children():
            visit(child, False)
        order.append(module)

    for root in roots:
        visit(root, True)
    return order


def _managed_params(modules: Iterable[nn.Module], ignored: set[int]) -> dict[int, tuple[nn.Parameter, str]]:
    found: dict[int, tuple[nn.Parameter, str]] = {}
    for module in modules:
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in ignored and id(param) not in found:
                found[id(param)] = (param, f"{type(module).__name__}.{name}")
    return found


def _refuse_aliased(params: dict[int, tuple[nn.Parameter, str]]) -> None:
    """Two parameters whose elements overlap in memory: sharding would give each its own copy."""
    spans: dict[int, list[tuple[int, int, str]]] = {}
    for param, name in params.values():
        if isinstance(param, DTensor) or param.device.type == "meta" or param.numel() == 0 or is_fake(param):
            continue  # fake tensors (memory estimates) have no memory
        try:
            key = param.untyped_storage().data_ptr()
        except RuntimeError:  # a tensor subclass: no memory of its own to share
            continue
        size = param.element_size()
        start = int(param.storage_offset()) * size
        last = sum((int(n) - 1) * int(st) for n, st in zip(param.shape, param.stride(), strict=True))
        end = start + (last + 1) * size
        for other_start, other_end, other in spans.setdefault(key, []):
            if start < other_end and other_start < end:
                raise ValueError(
                    f"Parameters {other} and {name} are views of the same memory (aliases): fully_shard "
                    "would shard each into its own storage and silently break the link between them. "
                    "Register one nn.Parameter under both names to tie them (module.b = module.a), or give "
                    "each its own memory (nn.Parameter(t.clone()))."
                )
        spans[key].append((start, end, name))


def _owners(
    modules: Iterable[nn.Module], params: dict[int, tuple[nn.Parameter, str]]
) -> dict[int, list[tuple[nn.Module, str]]]:
    owners: dict[int, list[tuple[nn.Module, str]]] = {key: [] for key in params}
    for module in modules:
        for name, param in module._parameters.items():  # noqa: SLF001 - direct registrations only
            if param is not None and id(param) in owners:
                owners[id(param)].append((module, name))
    return owners


def _move_to_device(
    modules: list[nn.Module], params: dict[int, tuple[nn.Parameter, str]], device: torch.device
) -> None:
    with torch.no_grad():
        for param, _ in params.values():
            # DTensor (tensor-parallel) parameters already live where their own mesh says.
            if param.device != device and param.device.type != "meta" and not isinstance(param, DTensor):
                param.data = param.data.to(device)
        for module in modules:
            for name, buffer in module._buffers.items():  # noqa: SLF001 - direct buffers only
                if buffer is not None and buffer.device != device and buffer.device.type != "meta":
                    module._buffers[name] = buffer.to(device)  # noqa: SLF001 - as nn.Module._apply does
