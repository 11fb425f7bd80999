"""Device mesh facts resolved once per ``fully_shard`` call.

Owns: ``MeshInfo`` (the shard and replicate process groups, sizes and ranks), the default mesh, the
device a mesh communicates on, and the smaller mesh used after forward for an int
``reshard_after_forward``. Does not own: any collective call.
Invariants: a ``MeshInfo`` never changes after construction; ``shard_size * replicate_size`` equals the
mesh size.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class MeshInfo:
    """The data-parallel layout of one mesh: dim 1 (or the only dim) shards, dim 0 replicates (HSDP)."""

    mesh: DeviceMesh
    shard_mesh_dim: int
    replicate_mesh_dim: int | None
    shard_group: dist.ProcessGroup
    shard_size: int
    shard_rank: int
    replicate_group: dist.ProcessGroup | None
    replicate_size: int

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

    @property
    def is_hsdp(self) -> bool:
        return self.replicate_mesh_dim is not None


def FSDPMeshInfo(mesh: DeviceMesh, shard_mesh_dim: int = 0) -> MeshInfo:  # noqa: N802 - torch's name
    """A mesh info that shards over ``mesh``'s dim ``shard_mesh_dim`` (for ``ShardPlacementResult``)."""
    _check_dims(mesh, (shard_mesh_dim,))
    return MeshInfo.build(mesh, shard_mesh_dim, None)


def HSDPMeshInfo(  # noqa: N802 - torch's name
    mesh: DeviceMesh, shard_mesh_dim: int = 1, replicate_mesh_dim: int = 0
) -> MeshInfo:
    """A mesh info that shards over one dim of ``mesh`` and replicates over another (HSDP)."""
    _check_dims(mesh, (shard_mesh_dim, replicate_mesh_dim))
    if shard_mesh_dim == replicate_mesh_dim:
        raise ValueError(f"HSDPMeshInfo needs two different dims, got {shard_mesh_dim} for both.")
    return MeshInfo.build(mesh, shard_mesh_dim, replicate_mesh_dim)


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
        mesh_info: from :func:`FSDPMeshInfo` or :func:`HSDPMeshInfo`. Parameters of one ``fully_shard``
            call form one group per distinct mesh info; those sharing process groups must share the
            same mesh-info object.
    """

    placement: Any
    mesh_info: MeshInfo


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over the whole default process group on the default device type."""
    if not dist.is_initialized():
        dist.init_process_group()
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


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
        'parallelize the module over mesh["tp"] and pass mesh["dp"] to fully_shard.'
    )
    if dp_mesh.device_type != tp_mesh.device_type:
        raise ValueError(
            f"Parameter {param_name} is a DTensor on a {tp_mesh.device_type!r} mesh, but fully_shard got a "
            f"{dp_mesh.device_type!r} mesh. {fix}"
        )
    dp_names, tp_names = dp_mesh.mesh_dim_names, tp_mesh.mesh_dim_names
    same_root = dp_mesh._get_root_mesh() == tp_mesh._get_root_mesh()  # noqa: SLF001 - no public accessor
    if not same_root or dp_names is None or tp_names is None or set(dp_names) & set(tp_names):
        raise ValueError(
            f"Parameter {param_name} is a DTensor on mesh {tp_mesh}, which is not a slice of the same root "
            f"mesh as fully_shard's mesh {dp_mesh} with different dim names (tensor parallelism needs "
            f"disjoint dims of one mesh). If fully_shard was applied to a child after its parent, apply it "
            f"bottom-up instead. {fix}"
        )
    spmd: DeviceMesh = DeviceMesh._concatenate([dp_mesh, tp_mesh])  # noqa: SLF001 - no public API
    return spmd
