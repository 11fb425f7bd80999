"""``shard_experts``: the one line that makes a model's experts expert parallel and sharded.

Owns: ``shard_experts`` (validation of every experts module before any changes, the layout choice,
placing each rank's experts, and ``fully_shard`` of each experts module over its expert mesh). Does
not own: the mesh (``_mesh``), the forward (``_module``), which modules are experts (``_find``).

[Note: The layout of a local stack]
Each rank of an ``ep`` group holds ``L = E / ep`` experts, sharded over the ``efsdp = S / ep`` ranks
of its expert mesh: ``Shard(0)`` (whole experts per rank) when ``L >= efsdp``, else ``Shard(1)`` (each
expert's rows split) for a stack whose dim 1 divides by ``efsdp``, so that no rank is left with an
empty shard when another dim can share the work; a stack whose dim 1 does not divide stays on
``Shard(0)``, where the ranks past its ``L`` rows hold empty shards (fully_shard pads only dim 0).
At ``ep = 1`` there is no exchange: the stack is sharded over the data-parallel mesh the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..base import MeshInfo, MixedPrecisionPolicy, OffloadPolicy, ShardPlacementResult, default_mesh
from ..frontend import FSDPModule, fully_shard
from ._find import convention_of, experts_modules
from ._mesh import expert_mesh
from ._module import Placement, place

__all__ = ["shard_experts"]


def shard_experts(
    module: nn.Module,
    ep: int = 1,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 - frozen, shared safely
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 - frozen, shared safely
    convention: str | None = None,
) -> list[FSDPModule]:
    """Make every experts module at or under ``module`` expert parallel over ``ep`` ranks, and shard it.

    The one line a user writes for a mixture of experts, before ``fully_shard`` of the blocks and the
    root: ``fsdp2.shard_experts(model, ep=2)``. Each experts module (stacked weights ``[E, ...]``, see
    docs/experts.md for the convention) keeps ``E / ep`` experts on each rank of its ``ep`` group, sends
    each token to the ranks of the experts its router chose and back (all-to-all, no token dropped),
    and is sharded over the rest of the data-parallel ranks (``Shard(0)``, or ``Shard(1)`` when its local
    stack is shorter than them and its rows divide among them). Gradients are averaged over every
    data-parallel rank, dense and expert alike, with no divisor to set.

    Args:
        module: the model (every experts module under it), or one experts module.
        ep: the expert-parallel degree; it divides the data-parallel mesh's shard ranks and ``E``.
        mesh: the data-parallel mesh ``fully_shard`` gets (1-D, or 2-D ``(replicate, shard)`` HSDP).
            Default: every rank of the default process group.
        reshard_after_forward: as ``fully_shard``'s, for the experts.
        mp_policy: as ``fully_shard``'s, for the experts.
        offload_policy: as ``fully_shard``'s, for the experts.
        convention: ``"counts"`` or ``"routed"`` where the forward's signature does not tell.

    Returns:
        The experts modules, each now an :class:`FSDPModule`.
    """
    found = experts_modules(module)
    if not found:
        raise ValueError(
            f"shard_experts found no experts module in {type(module).__name__}: an experts module has an int "
            "num_experts and holds its experts' weights as stacks [num_experts, ...] (see docs/experts.md)."
        )
    mesh = mesh if mesh is not None else default_mesh()
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise ValueError(
            "shard_experts got a 2-D mesh without dim names; HSDP needs them to tell the replicate dim from "
            "the shard dim. Build it with init_device_mesh(..., mesh_dim_names=('replicate', 'shard'))."
        )
    plans = [_plan(name, experts, ep, convention) for name, experts in found]
    experts_mesh = expert_mesh(mesh, ep) if ep > 1 else None  # raises for an ep the mesh cannot take
    # ---- no module has changed up to here ----
    sharded = []
    for (_, experts), (num_experts, style) in zip(found, plans, strict=True):
        undo = None
        if experts_mesh is not None:
            undo = place(experts, Placement(experts_mesh, num_experts, style))
            ranks, info = experts_mesh.efsdp, experts_mesh.sharding
        else:
            ranks, info = mesh.size(mesh.ndim - 1), None
        layout = _Layout(num_experts // ep, ranks, info)
        try:
            sharded.append(
                fully_shard(
                    experts,
                    mesh=mesh,
                    reshard_after_forward=reshard_after_forward,
                    shard_placement_fn=layout.placement,
                    mp_policy=mp_policy,
                    offload_policy=offload_policy,
                )
            )
        except Exception:
            # fully_shard changes nothing when it refuses; the placement goes back too. An argument it
            # refuses is refused for the first module, so the model is then as it was.
            if undo is not None:
                undo()
            raise
    return sharded


@dataclass(frozen=True)
class _Layout:
    """The placement of each stack of one experts module: see [Note: The layout of a local stack]."""

    local: int  # experts per ep rank
    ranks: int  # the ranks sharding them (efsdp)
    info: MeshInfo | None  # their mesh info (None: fully_shard's mesh)

    def placement(self, param: nn.Parameter) -> Shard | ShardPlacementResult:
        split_rows = self.local < self.ranks and param.ndim > 1 and param.shape[1] % self.ranks == 0
        shard = Shard(1 if split_rows else 0)
        return shard if self.info is None else ShardPlacementResult(placement=shard, mesh_info=self.info)


def _plan(name: str, experts: nn.Module, ep: int, convention: str | None) -> tuple[int, str]:
    """``experts``' expert count and convention; a ``ValueError`` for what expert parallelism cannot take."""
    label = name or type(experts).__name__
    if isinstance(experts, FSDPModule):
        raise ValueError(
            f"shard_experts: {label} is already sharded by fully_shard; call shard_experts first, then "
            "fully_shard on the blocks and the root."
        )
    placed: Any = [n for n, p in experts.named_parameters(recurse=False) if isinstance(p, DTensor)]
    if placed:
        raise ValueError(
            f"shard_experts: {label}.{placed[0]} is already a DTensor (placed by another expert-parallel "
            "plan, e.g. torchtitan's ExpertParallel); use one of the two, not both."
        )
    num_experts: int = getattr(experts, "num_experts")  # noqa: B009 - an int (is_experts_module checked)
    if num_experts % ep:
        raise ValueError(
            f"shard_experts: {label} has {num_experts} experts, which ep={ep} ranks cannot hold equally; "
            "pick an ep that divides the number of experts."
        )
    return num_experts, convention_of(experts, name, convention) if ep > 1 else "counts"
