"""A restart's restore: the newest snapshot some surviving node still has for every old rank, resharded.

Owns: ``reshard_newest`` (the choice, ``_choice``'s, from each new rank's listing of its node's
files; each reader checks the bytes it read, a damaged copy is dropped and the choice made again; then
one ``comm.exchange`` moves every row to its new rank, see ``_reshard``) and ``apply`` (the pieces
into the model, optimizer and registered objects, through torch.distributed.checkpoint's state-dict
functions, as a DCP load does). No file outside the node's snapshot directory is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from ..comm import exchange
from ._choice import Choice, Reduce, choose
from ._format import Leaf, RankSnapshot, fill, layout_of
from ._reshard import Reshard
from ._store import Damaged, Listed, NodeStore


@dataclass(frozen=True)
class Exchanged:
    """What ``reshard_newest`` gives this rank: the choice, the leaf table, its tree and local leaf values.

    ``skipped`` has a line for each damaged copy that was passed over, on any node.
    """

    choice: Choice
    leaves: tuple[Leaf, ...]
    tree: Any
    values: list[torch.Tensor]
    skipped: list[str]


def reshard_newest(
    store: NodeStore,
    listing: list[Listed],
    damaged: list[Damaged],
    group: dist.ProcessGroup,
    model: nn.Module,
    per_node: int = 1,
) -> Exchanged | str | None:
    """Choose, read, check and reshard onto this job's ranks (each leaf cut as ``model``'s entry is).

    ``listing`` and ``damaged``: this rank's node's files, whole and damaged; ``per_node``: the ranks on
    this rank's node. Returns ``None`` when no rank found a snapshot file at all, or the reason none is
    whole (damaged copies named). Collectives whose sizes do not grow with the world but for two: the
    readers' all-reduce of one integer per old rank, and the exchange's per-rank counts (see
    [Note: Choosing by tensors]); damaged copies' lines are gathered only when some rank has one.
    """
    me, world = dist.get_rank(group), dist.get_world_size(group)
    found = _choose_and_read(store, listing, damaged, group, per_node)
    if found is None or isinstance(found, str):
        return found
    choice, held, broken = found
    table: list[Any] = [held[0].leaves if 0 in held else None]
    dist.broadcast_object_list(table, src=dist.get_global_rank(group, int(choice.holder[0])), group=group)
    leaves = tuple(table[0])
    plan = Reshard(leaves, choice.old_world, world, choice.holder, new_cuts(leaves, model))
    received = exchange(plan.outgoing(me, held), group, align=1)  # counts travel
    tree, values = plan.incoming(me, received.part)
    skipped = [line for lines in broken.values() for line in lines]
    return Exchanged(choice, plan.leaves, tree, values, skipped)


Broken = dict[tuple[int, int], list[str]]  # why each damaged copy of (step, old rank) is, on every rank


def _choose_and_read(
    store: NodeStore, listing: list[Listed], damaged: list[Damaged], group: dist.ProcessGroup, per_node: int
) -> tuple[Choice, dict[int, RankSnapshot], Broken] | str | None:
    """The choice, this rank's files of it (every rank's read whole) and the damaged copies passed over.

    ``None``: no rank lists a file; a string: why no snapshot is whole.
    """
    me, world = dist.get_rank(group), dist.get_world_size(group)
    reduce = _reducer(group)
    anything = reduce(torch.tensor([len(listing), len(damaged)], dtype=torch.int64), "max").tolist()
    if not any(anything):
        return None
    broken: Broken = {}
    dropped: set[tuple[int, int]] = set()
    bad_here, found_bad = list(damaged), bool(anything[1])
    while True:
        if found_bad:  # rare: the lines of every damaged copy, for the messages
            _gather_damaged(bad_here, group, broken, dropped)
        choice = choose(listing, dropped, broken, (me, world, per_node), reduce)
        if isinstance(choice, str):
            return choice
        held, bad_here = _read_mine(store, choice, me)
        found_bad = bool(int(reduce(torch.tensor([len(bad_here)], dtype=torch.int64), "max")))
        if not found_bad:
            return choice, held, broken


def _reducer(group: dist.ProcessGroup) -> Reduce:
    ops = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

    def reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
        dist.all_reduce(tensor, op=ops[op], group=group)
        return tensor

    return reduce


def _gather_damaged(
    mine: list[Damaged], group: dist.ProcessGroup, broken: Broken, dropped: set[tuple[int, int]]
) -> None:
    """Every rank's newly found damaged copies into ``broken`` (in rank order); this rank's, ``dropped``."""
    reports: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, mine, group=group)
    for bad in reports:
        for item in bad:
            broken.setdefault((item.step, item.rank), []).append(item.why)
    dropped.update((item.step, item.rank) for item in mine)


def new_cuts(leaves: tuple[Leaf, ...], model: nn.Module) -> tuple[int | None, ...]:
    """How many pieces this job cuts each leaf's rows into (``Leaf.shards``), from its model entry.

    An entry absent, not a DTensor or of a layout snapshots do not take gets ``None`` (the whole world):
    ``apply`` then refuses it with its reason, after the exchange every rank makes alike.
    """
    targets = get_model_state_dict(model)
    cuts: list[int | None] = []
    for leaf in leaves:
        name = _owner(leaf.path)
        target = targets.get(name) if isinstance(name, str) else None
        layout = layout_of(target) if isinstance(target, DTensor) else None
        cuts.append(None if layout is None else layout[1])
    return tuple(cuts)


def _read_mine(store: NodeStore, choice: Choice, me: int) -> tuple[dict[int, RankSnapshot], list[Damaged]]:
    """The old snapshots this rank reads, and those whose copy here is damaged or gone."""
    held, damaged = {}, []
    for old in choice.read_by(me):
        try:
            held[old] = store.read(choice.step, old)
        except (OSError, ValueError, EOFError) as error:
            damaged.append(store.damaged(choice.step, old, error))
    return held, damaged


def apply(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    states: Mapping[str, Any],
    leaves: tuple[Leaf, ...],
    tree: Any,
    values: list[torch.Tensor],
) -> None:
    """Load a restored tree into the model, optimizer and registered objects.

    Raises:
        ValueError: the snapshot is of another model (a name or shape differs), before anything loads.
    """
    targets = get_model_state_dict(model)
    built = [_placed(leaf, value, targets) for leaf, value in zip(leaves, values, strict=True)]
    state = fill(tree, built)
    extra = set(state["state"]) ^ set(states)
    if extra:
        raise ValueError(
            f"the snapshot registered the objects {sorted(state['state'])}, this job registers "
            f"{sorted(states)}: register the same names (Snapshots(state=...)) as the job that took it"
        )
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for name, target in states.items():
        target.load_state_dict(state["state"][name])


def _placed(leaf: Leaf, value: torch.Tensor, targets: dict[str, Any]) -> torch.Tensor:
    """A restored local value as the tensor the model expects: a DTensor on the parameter's mesh."""
    name = _owner(leaf.path)
    target = targets.get(name) if isinstance(name, str) else None
    if leaf.path[:1] == ("model",) and (target is None or tuple(target.shape) != leaf.shape):
        here = "absent" if target is None else f"of shape {tuple(target.shape)}"
        raise ValueError(
            f"the snapshot is of another model: {leaf.path[1]} is of shape {leaf.shape} there and {here} "
            "here. Build the same model as the job that took the snapshot, or give this job another name."
        )
    if leaf.dim is None:
        device = target.device if isinstance(target, torch.Tensor) and leaf.path[:1] == ("model",) else None
        return value if device is None else value.to(device)
    layout = layout_of(target) if isinstance(target, DTensor) else None
    if layout is None or layout[0] != leaf.dim:
        raise ValueError(
            f"snapshot leaf {leaf.name} was cut on dim {leaf.dim}; this job's {name} is "
            f"{getattr(target, 'placements', 'not a DTensor')}: shard (FSDP, HSDP) or replicate the model "
            "on that dim, as the job that took the snapshot did"
        )
    assert isinstance(target, DTensor)
    stride = torch.empty(leaf.shape, device="meta").stride()
    return DTensor.from_local(
        value.to(target.device),
        target.device_mesh,
        target.placements,
        run_check=False,
        shape=torch.Size(leaf.shape),
        stride=stride,
    )


def _owner(path: tuple[Any, ...]) -> Any:
    """The model entry a leaf belongs to: ``model/<name>`` or ``optim/state/<name>/<key>`` (else ``None``)."""
    if path[:1] == ("model",):
        return path[1]
    return path[2] if path[:2] == ("optim", "state") else None
