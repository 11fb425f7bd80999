"""Device mesh facts resolved once per ``fully_shard`` call.

Owns: ``MeshInfo`` (the shard and replicate process groups, sizes and ranks), the default mesh, the
device a mesh communicates on, the smaller mesh used after forward for an int
``reshard_after_forward``, and ``SpmdDims`` (``DataParallelMeshDims`` resolved against a full SPMD
mesh: its data-parallel process groups and the layout of the sharded parameters). Does not own: any
collective call.
Invariants: a ``MeshInfo`` never changes after construction; ``shard_size * replicate_size`` equals the
number of data-parallel ranks.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.placement_types import Placement


@dataclass(frozen=True)
class MeshInfo:
    """The data-parallel layout of one mesh: dim 1 (or the only dim) shards, dim 0 replicates (HSDP).

    ``replicate_only``: no shard dim at all (``DataParallelMeshDims(replicate=...)``, data parallel like
    DDP): ``shard_mesh_dim`` is ``None``, ``shard_size`` 1, and ``shard_group`` is the replicate group,
    over which nothing is ever gathered or scattered (a single shard rank needs no collective).

    ``outer_data_parallel``: how many ranks of the parameters' own mesh (an expert-parallel ``ep``
    mesh, see ``with_outer_data_parallel``) are data-parallel ranks too, this one included. They hold
    different gradients of the same loss that no collective of this mesh info sums, so the default
    average divides by them as well (1 for every other mesh info).
    """

    mesh: DeviceMesh
    shard_mesh_dim: int | None
    replicate_mesh_dim: int | None
    shard_group: dist.ProcessGroup
    shard_size: int
    shard_rank: int
    replicate_group: dist.ProcessGroup | None
    replicate_size: int
    replicate_only: bool = False
    outer_data_parallel: int = 1

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh) -> MeshInfo:
        """Build the info for a 1-D (FSDP) or 2-D (HSDP: replicate, shard) mesh."""
        if mesh.ndim == 1:
            return cls(mesh, 0, None, mesh.get_group(0), mesh.size(0), mesh.get_local_rank(0), None, 1)
        return cls(
            mesh,
            1,
            0,
            mesh.get_group(1),
            mesh.size(1),
            mesh.get_local_rank(1),
            mesh.get_group(0),
            mesh.size(0),
        )

    @classmethod
    def build(cls, mesh: DeviceMesh, shard_mesh_dim: int, replicate_mesh_dim: int | None) -> MeshInfo:
        """The info for an explicit choice of shard (and replicate) dims of ``mesh``."""
        replicate = None if replicate_mesh_dim is None else mesh.get_group(replicate_mesh_dim)
        return cls(
            mesh,
            shard_mesh_dim,
            replicate_mesh_dim,
            mesh.get_group(shard_mesh_dim),
            mesh.size(shard_mesh_dim),
            mesh.get_local_rank(shard_mesh_dim),
            replicate,
            1 if replicate_mesh_dim is None else mesh.size(replicate_mesh_dim),
        )

    @classmethod
    def replicated(cls, mesh: DeviceMesh) -> MeshInfo:
        """The info for replicas only, over 1-D ``mesh``: no sharding, gradients all-reduced over it."""
        group = mesh.get_group(0)
        return cls(mesh, None, 0, group, 1, 0, group, mesh.size(0), replicate_only=True)

    def with_outer_data_parallel(self, ranks: int) -> MeshInfo:
        """This info (same process groups) averaging gradients over ``ranks`` more data-parallel ranks."""
        values = {f.name: getattr(self, f.name) for f in fields(MeshInfo)}
        values["outer_data_parallel"] = ranks
        return MeshInfo(**values)

    @property
    def average_over(self) -> int:
        """The default gradient divisor: every data-parallel rank (shard x replicate x outer)."""
        return self.shard_size * self.replicate_size * self.outer_data_parallel

    @property
    def is_hsdp(self) -> bool:
        """Sharded and replicated (torch's ``HSDPMeshInfo``); not for replicas only."""
        return self.replicate_mesh_dim is not None and not self.replicate_only


class _MeshInfoKind(type):
    """Metaclass of :class:`FSDPMeshInfo` and :class:`HSDPMeshInfo`: what ``isinstance`` accepts.

    fsdp2's ``MeshInfo`` of that kind and torch's own mesh-info objects of the same name, as torch's
    ``isinstance`` checks do (torchtitan asserts ``isinstance(info, FSDPMeshInfo)``).
    """

    def __instancecheck__(cls, obj: object) -> bool:
        if super().__instancecheck__(obj):
            return True
        if isinstance(obj, MeshInfo):
            return obj.is_hsdp if cls.__name__ == "HSDPMeshInfo" else not obj.replicate_only
        torch_class = _torch_mesh_info_class(cls.__name__)
        return torch_class is not None and isinstance(obj, torch_class)


# Where torch defines its mesh-info classes; looked up in sys.modules only (an object of one of them
# means the user already imported it), so fsdp2 itself never imports torch's FSDP package.
_TORCH_MESH_INFO_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_common"


def _torch_mesh_info_class(name: str) -> type | None:
    found = getattr(sys.modules.get(_TORCH_MESH_INFO_MODULE), name, None)
    return found if isinstance(found, type) else None


class FSDPMeshInfo(MeshInfo, metaclass=_MeshInfoKind):
    """A mesh info that shards over ``mesh``'s dim ``shard_mesh_dim`` (for ``ShardPlacementResult``).

    ``isinstance(x, FSDPMeshInfo)`` holds for every fsdp2 mesh info that shards (HSDP ones too) and for
    torch's ``FSDPMeshInfo`` / ``HSDPMeshInfo`` objects.
    """

    def __init__(self, mesh: DeviceMesh, shard_mesh_dim: int = 0) -> None:
        _check_dims(mesh, (shard_mesh_dim,))
        super().__init__(*_fields(MeshInfo.build(mesh, shard_mesh_dim, None)))


class HSDPMeshInfo(FSDPMeshInfo):
    """A mesh info that shards over one dim of ``mesh`` and replicates over another (HSDP).

    ``isinstance(x, HSDPMeshInfo)`` holds for every fsdp2 HSDP mesh info and torch's ``HSDPMeshInfo``.
    """

    def __init__(self, mesh: DeviceMesh, shard_mesh_dim: int = 1, replicate_mesh_dim: int = 0) -> None:
        _check_dims(mesh, (shard_mesh_dim, replicate_mesh_dim))
        if shard_mesh_dim == replicate_mesh_dim:
            raise ValueError(f"HSDPMeshInfo needs two different dims, got {shard_mesh_dim} for both.")
        MeshInfo.__init__(self, *_fields(MeshInfo.build(mesh, shard_mesh_dim, replicate_mesh_dim)))


def _fields(info: MeshInfo) -> tuple[Any, ...]:
    return tuple(getattr(info, f.name) for f in fields(MeshInfo))


def _check_dims(mesh: object, dims: tuple[object, ...]) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"a mesh info needs a DeviceMesh, got {type(mesh).__name__}.")
    for dim in dims:
        if not isinstance(dim, int) or not 0 <= dim < mesh.ndim:
            raise ValueError(f"mesh dim {dim!r} is out of range for a {mesh.ndim}-D mesh {mesh}.")


@dataclass(frozen=True)
class ShardPlacementResult:
    """What ``shard_placement_fn`` may return to put a parameter on its own mesh (e.g. MoE experts).

    Attributes:
        placement: ``Shard(d)`` or ``None`` (``Shard(0)``).
        mesh_info: from :class:`FSDPMeshInfo` or :class:`HSDPMeshInfo` (or torch's objects of those
            names). Parameters of one ``fully_shard`` call form one group per distinct mesh info; those
            sharing process groups must share the same mesh-info object. A DTensor parameter (experts
            on an ``ep`` mesh) is sharded over this mesh info's mesh, combined with its own.
    """

    placement: Any
    mesh_info: MeshInfo


def default_mesh(dim_names: tuple[str] | None = None) -> DeviceMesh:
    """A 1-D mesh over the whole default process group on the default device type."""
    if not dist.is_initialized():
        dist.init_process_group()
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=dim_names)


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device a mesh communicates on: ``cpu``, or the current device index of its accelerator."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


_warned_int_one = False


def post_forward_mesh_info(reshard_after_forward: bool | int, mesh_info: MeshInfo) -> MeshInfo | None:
    """The mesh parameters live on between forward and backward; ``None`` keeps them unsharded.

    ``True`` (or an int equal to the shard size) reuses ``mesh_info``; an int ``k`` in between builds
    a new ``(-1, k)`` mesh, which is a collective call. Arguments are validated by the caller.
    """
    global _warned_int_one
    if isinstance(reshard_after_forward, bool):
        return mesh_info if reshard_after_forward else None
    k = reshard_after_forward
    if k == 1:
        if not _warned_int_one:
            _warned_int_one = True
            warnings.warn(
                "reshard_after_forward=1 means resharding to a world of one rank after forward, which "
                "is the same as reshard_after_forward=False; pass False to say so.",
                stacklevel=3,
            )
        return None
    if k == mesh_info.shard_size:
        return mesh_info
    ranks = mesh_info.mesh.mesh.flatten().view(-1, k)
    mesh = DeviceMesh(
        mesh_info.mesh.device_type, ranks, mesh_dim_names=("post_forward_replicate", "post_forward_shard")
    )
    return MeshInfo.from_mesh(mesh)


def data_and_tensor_parallel_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh, param_name: str) -> DeviceMesh:
    """The mesh of a TP parameter sharded by FSDP: ``dp_mesh``'s dims followed by ``tp_mesh``'s.

    Both must be slices of one root mesh with distinct dim names (e.g. ``mesh["dp"]`` and
    ``mesh["tp"]`` of ``init_device_mesh(..., mesh_dim_names=("dp", "tp"))``).

    Raises:
        ValueError: the meshes are not disjoint slices of one root mesh.
    """
    fix = (
        'Build one mesh, e.g. mesh = init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp")), '
        'parallelize the module over mesh["tp"] and pass mesh["dp"] to fully_shard (for experts: '
        'mesh_dim_names=("efsdp", "ep"), the experts on mesh["ep"], FSDPMeshInfo(mesh["efsdp"])).'
    )
    if dp_mesh.device_type != tp_mesh.device_type:
        raise ValueError(
            f"Parameter {param_name} is a DTensor on a {tp_mesh.device_type!r} mesh, but its data-parallel "
            f"mesh is a {dp_mesh.device_type!r} mesh. {fix}"
        )
    dp_names, tp_names = dp_mesh.mesh_dim_names, tp_mesh.mesh_dim_names
    same_root = dp_mesh._get_root_mesh() == tp_mesh._get_root_mesh()  # noqa: SLF001 - no public accessor
    if not same_root or dp_names is None or tp_names is None or set(dp_names) & set(tp_names):
        raise ValueError(
            f"Parameter {param_name} is a DTensor on mesh {tp_mesh}, which is not a slice of the same root "
            f"mesh as its data-parallel mesh {dp_mesh} (fully_shard's, or the mesh info shard_placement_fn "
            f"gave it) with different dim names (tensor and expert parallelism need "
            f"disjoint dims of one mesh). If fully_shard was applied to a child after its parent, apply it "
            f"bottom-up instead. {fix}"
        )
    spmd: DeviceMesh = DeviceMesh._concatenate([dp_mesh, tp_mesh])  # noqa: SLF001 - no public API
    return spmd


@dataclass(frozen=True)
class SpmdDims:
    """``DataParallelMeshDims`` resolved against the full SPMD mesh the parameters are DTensors on.

    Attributes:
        mesh: the full SPMD mesh (``fully_shard``'s ``mesh``, the parameters' DTensor mesh).
        shard: indices of the shard dims in ``mesh`` (ascending and adjacent); may be empty.
        replicate: indices of the replicate dims in ``mesh`` (ascending); may be empty.
        mesh_info: the data-parallel process groups: several shard dims are flattened into one, and so
            are several replicate dims, as torch does.
        sharded_mesh: the mesh of the sharded parameters: ``mesh`` itself with at most one shard dim;
            with several, ``mesh`` whose shard dims are replaced by the flattened one (preceded, with
            replicate dims too, by the flattened replicate dim, whose own dims are dropped).
    """

    mesh: DeviceMesh
    shard: tuple[int, ...]
    replicate: tuple[int, ...]
    mesh_info: MeshInfo
    sharded_mesh: DeviceMesh

    @property
    def dp_indices(self) -> frozenset[int]:
        """The data-parallel dims of ``mesh`` (shard and replicate)."""
        return frozenset(self.shard + self.replicate)

    def sharded_placements(self, placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
        """``placements`` on ``mesh`` (FSDP's on the first shard dim) mapped onto ``sharded_mesh``."""
        if len(self.shard) <= 1:
            return placements
        out: list[Placement] = []
        for index, placement in enumerate(placements):
            if index == self.shard[0]:
                if self.replicate:
                    out.append(Replicate())
                out.append(placement)
            elif index not in self.shard and index not in self.replicate:
                out.append(placement)
        return tuple(out)

    @classmethod
    def build(
        cls, mesh: DeviceMesh, shard_names: tuple[str, ...], replicate_names: tuple[str, ...]
    ) -> SpmdDims:
        """Resolve validated dim names of ``mesh`` (flattening several into one is a collective call)."""
        names = mesh.mesh_dim_names
        assert names is not None, "an SPMD mesh without dim names"
        shard = tuple(names.index(name) for name in shard_names)
        replicate = tuple(names.index(name) for name in replicate_names)
        shard_mesh = _dims_mesh(mesh, shard_names)
        replicate_mesh = _dims_mesh(mesh, replicate_names)
        if shard_mesh is None:
            assert replicate_mesh is not None, "DataParallelMeshDims without dims"
            info = MeshInfo.replicated(replicate_mesh)
        elif replicate_mesh is None:
            info = MeshInfo.from_mesh(shard_mesh)
        else:
            both: DeviceMesh = DeviceMesh._concatenate([replicate_mesh, shard_mesh])  # noqa: SLF001 - no public API
            info = MeshInfo.from_mesh(both)
        sharded_mesh = mesh
        if len(shard) > 1:
            parts = [
                info.mesh if index == shard[0] else mesh[name]
                for index, name in enumerate(names)
                if index == shard[0] or (index not in shard and index not in replicate)
            ]
            sharded_mesh = DeviceMesh._concatenate(parts)  # noqa: SLF001 - no public API
        return cls(mesh, shard, replicate, info, sharded_mesh)


def _dims_mesh(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh | None:
    """The 1-D mesh over ``names`` of ``mesh``: a slice for one name, several flattened into one."""
    if not names:
        return None
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[names]._flatten("_".join(names))  # noqa: SLF001 - torch's own way to flatten dims
