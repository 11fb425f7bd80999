"""The expert mesh: the data-parallel mesh's shard dim split into ``efsdp x ep`` over the same ranks.

Owns: ``ExpertMesh`` (the mesh, the ``ep`` group, this rank's place in it, the experts' data-parallel
mesh info) and ``expert_mesh`` (built once per data-parallel mesh and degree). Does not own: which
experts a rank holds (``_placement``), the token exchange (``_tokens``), any collective.

[Note: The expert mesh]
The data-parallel mesh's shard dim (all of a 1-D mesh; dim 1 of an HSDP ``(replicate, shard)`` mesh)
of ``S`` ranks is unflattened into ``(S / ep, ep)`` with ``ep`` innermost: the ranks of one ``ep``
group are neighbours (the token all-to-all stays on the fastest links), and the ``efsdp`` groups are
strided across them. The experts are sharded over ``efsdp`` (and replicated over HSDP's replicate
dim); every rank of the data-parallel mesh is a data-parallel rank of the experts too, so their
gradients are averaged over ``replicate x efsdp x ep`` - all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..base import FSDPMeshInfo, HSDPMeshInfo, MeshInfo

__all__ = ["ExpertMesh", "expert_mesh"]


@dataclass(frozen=True)
class ExpertMesh:
    """The meshes of one expert-parallel degree over one data-parallel mesh.

    ``mesh``: ``(efsdp, ep)``, or ``(replicate, efsdp, ep)`` under HSDP, over the data-parallel ranks.
    ``dp_mesh``: the data-parallel mesh it was built from (``fully_shard``'s mesh for the experts).
    ``sharding``: the experts' mesh info (``efsdp``, with HSDP's replicate dim).
    """

    mesh: DeviceMesh
    dp_mesh: DeviceMesh
    sharding: MeshInfo
    ep: int

    @cached_property
    def ep_mesh(self) -> DeviceMesh:
        """The ``ep`` dim, sliced once.

        A slice is a new ``DeviceMesh``, whose construction and comparison read every rank of the
        mesh (before: per MoE layer per forward).
        """
        return self.mesh[self.mesh.mesh_dim_names[-1]]  # type: ignore[index]  # reason: named by us

    @cached_property
    def ep_group(self) -> dist.ProcessGroup:
        return self.ep_mesh.get_group()

    @cached_property
    def ep_rank(self) -> int:
        return self.ep_mesh.get_local_rank()

    @property
    def efsdp(self) -> int:
        return self.sharding.shard_size


_BUILT: dict[tuple[int, int], ExpertMesh] = {}  # (data-parallel mesh, ep) -> its expert mesh


def expert_mesh(dp_mesh: DeviceMesh, ep: int) -> ExpertMesh:
    """The expert mesh of degree ``ep`` over ``dp_mesh`` (1-D, or 2-D HSDP): one per pair, shared.

    Every rank of ``dp_mesh`` must call it (unflattening creates the new dims' process groups).
    """
    if dp_mesh.ndim not in (1, 2):
        raise ValueError(
            f"shard_experts takes a 1-D data-parallel mesh or a 2-D (replicate, shard) HSDP mesh, got a "
            f"{dp_mesh.ndim}-D mesh; pass the data-parallel mesh (e.g. world_mesh['dp'])."
        )
    shard_dim = dp_mesh.ndim - 1
    shard_ranks = dp_mesh.size(shard_dim)
    if ep < 1 or shard_ranks % ep:
        raise ValueError(
            f"shard_experts: ep={ep} must divide the {shard_ranks} shard ranks of the data-parallel mesh "
            f"(ep x efsdp over the same ranks); pick ep among "
            f"{[d for d in range(1, shard_ranks + 1) if shard_ranks % d == 0]}."
        )
    key = (id(dp_mesh), ep)
    found = _BUILT.get(key)
    if found is not None and found.dp_mesh is dp_mesh:
        return found
    names = _free_names(dp_mesh)
    mesh = _split(dp_mesh, shard_dim, (shard_ranks // ep, ep), names)
    dims = mesh.mesh_dim_names or ()
    sharding: MeshInfo
    sharding = HSDPMeshInfo(mesh[dims[0], dims[1]]) if dp_mesh.ndim == 2 else FSDPMeshInfo(mesh[dims[0]])
    found = _BUILT[key] = ExpertMesh(mesh, dp_mesh, sharding, ep)
    return found


def _split(dp_mesh: DeviceMesh, dim: int, sizes: tuple[int, int], names: tuple[str, str]) -> DeviceMesh:
    """``dp_mesh`` with ``dim`` unflattened into ``sizes`` named ``names``.

    A named mesh is unflattened from its root (its process groups are made as torch makes them for a
    sub-mesh); an unnamed one is laid out anew over the same ranks (every rank of the default group
    takes part in making its groups, as for any new mesh).
    """
    if dp_mesh.mesh_dim_names is not None:
        return dp_mesh._unflatten(dim, sizes, names)  # noqa: SLF001 - torch's one way to split a named dim
    shape = (*dp_mesh.mesh.shape[:dim], *sizes)
    all_names = ("replicate", *names) if dim else names
    return DeviceMesh(dp_mesh.device_type, dp_mesh.mesh.reshape(shape), mesh_dim_names=all_names)


def _free_names(dp_mesh: DeviceMesh) -> tuple[str, str]:
    """``("efsdp", "ep")``, suffixed where the mesh already names a dim so."""
    taken = set(dp_mesh.mesh_dim_names or ())
    suffix = ""
    while f"efsdp{suffix}" in taken or f"ep{suffix}" in taken:
        suffix = f"_{len(suffix) + 1}"
    return f"efsdp{suffix}", f"ep{suffix}"
