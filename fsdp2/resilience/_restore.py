"""A restart's restore: the newest snapshot some surviving node still has for every old rank, resharded.

Owns: ``choose`` (from every new rank's listing of its node's files: the newest step whose every old
rank has a whole copy somewhere, and which new rank reads each; or why there is none, naming the
damaged copies apart from the lost ones), ``reshard_newest`` (each reader checks the bytes it read; a
damaged copy is dropped and the choice made again; then one ``comm.exchange`` moves every row to its
new rank, see ``_reshard``) and ``apply`` (the pieces into the model, optimizer and registered
objects, through torch.distributed.checkpoint's state-dict functions, as a DCP load does). No file
outside the node's snapshot directory is read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from ..comm import exchange
from ._format import Leaf, RankSnapshot, fill, layout_of
from ._reshard import Reshard
from ._store import Damaged, Listed, NodeStore


@dataclass(frozen=True)
class Choice:
    """The snapshot to restore: its step, old world size, layout and the reader of each old rank."""

    step: int
    old_world: int
    fingerprint: int
    holder: tuple[int, ...]


def choose(
    listings: list[list[Listed]],
    dropped: set[tuple[int, int, int]],
    damaged: Mapping[tuple[int, int], list[str]] | None = None,
) -> Choice | str:
    """The newest snapshot every old rank of which is listed by some new rank, or why there is none.

    ``listings[j]`` is what new rank ``j`` found on its node; ``(j, step, old)`` in ``dropped`` is a copy
    already found damaged; ``damaged[(step, old)]`` says why each damaged copy of old rank ``old`` at
    ``step`` is (the reason names them, and does not blame lost nodes for them). Each old rank is read by
    the new rank of the same number when it lists it, else by the lister with the fewest to read so far.
    """
    damaged = damaged or {}
    candidates: dict[tuple[int, int, int], dict[int, list[int]]] = {}
    for reader, listing in enumerate(listings):
        for found in listing:
            if (reader, found.step, found.rank) in dropped:
                continue
            key = (found.step, found.world, found.fingerprint)
            candidates.setdefault(key, {}).setdefault(found.rank, []).append(reader)
    if not candidates and damaged:
        return f"every snapshot file found is damaged: {_lines(damaged.values())}"
    why = ""
    for step, world, print_ in sorted(candidates, reverse=True):
        listers = candidates[(step, world, print_)]
        missing = [old for old in range(world) if old not in listers]
        if missing:
            why = why or _not_whole(step, world, missing, damaged)
            continue
        load = [0] * len(listings)
        holder = []
        for old in range(world):  # in rank order, among its own listers: not param.owners_by_load's heap
            pick = old if old in listers[old] else min(listers[old], key=lambda r: (load[r], r))
            load[pick] += 1
            holder.append(pick)
        return Choice(step, world, print_, tuple(holder))
    return why


def _not_whole(
    step: int, world: int, missing: list[int], damaged: Mapping[tuple[int, int], list[str]]
) -> str:
    broken = [old for old in missing if (step, old) in damaged]
    gone = [old for old in missing if (step, old) not in damaged]
    parts = []
    if gone:
        parts.append(
            f"survives nowhere for rank(s) {', '.join(map(str, gone))} (their node and their buddy's node "
            "are gone, or the snapshot was cut short)"
        )
    if broken:
        lines = _lines(damaged[(step, old)] for old in broken)
        parts.append(f"has only damaged copies of rank(s) {', '.join(map(str, broken))} ({lines})")
    return f"the newest snapshot, step {step} of {world} ranks, {', and '.join(parts)}"


def _lines(groups: Iterable[list[str]], shown: int = 2) -> str:
    """Damaged copies, one ``path: why`` each: the first ``shown`` of them, then how many more."""
    lines = [line for group in groups for line in group]
    more = f"; and {len(lines) - shown} more" if len(lines) > shown else ""
    return "; ".join(lines[:shown]) + more


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
) -> Exchanged | str | None:
    """Choose, read, check and reshard onto this job's ranks (each leaf cut as ``model``'s entry is).

    ``listing`` and ``damaged``: this rank's node's files, whole and damaged. Returns ``None`` when no rank
    found a snapshot file at all, or the reason none is whole (damaged copies named).
    """
    me, world = dist.get_rank(group), dist.get_world_size(group)
    found: list[Any] = [None] * world
    dist.all_gather_object(found, (listing, damaged), group=group)
    listings = [entries for entries, _ in found]
    broken: dict[tuple[int, int], list[str]] = {}
    for _, bad in found:
        for item in bad:
            broken.setdefault((item.step, item.rank), []).append(item.why)
    if not any(listings) and not broken:
        return None
    dropped: set[tuple[int, int, int]] = set()
    while True:
        choice = choose(listings, dropped, broken)
        if isinstance(choice, str):
            return choice
        held, bad_here = _read_mine(store, choice, me)
        reports: list[Any] = [None] * world
        dist.all_gather_object(reports, bad_here, group=group)
        if not any(reports):
            break
        for reader, bad in enumerate(reports):
            for item in bad:
                dropped.add((reader, item.step, item.rank))
                broken.setdefault((item.step, item.rank), []).append(item.why)
    table: list[Any] = [held[0].leaves if 0 in held else None]
    dist.broadcast_object_list(table, src=dist.get_global_rank(group, choice.holder[0]), group=group)
    leaves = tuple(table[0])
    plan = Reshard(leaves, choice.old_world, world, choice.holder, new_cuts(leaves, model))
    received = exchange([[part] for part in plan.outgoing(me, held)], group, align=1)  # counts travel
    tree, values = plan.incoming(me, received.parts)
    skipped = [line for lines in broken.values() for line in lines]
    return Exchanged(choice, plan.leaves, tree, values, skipped)


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
    for old, reader in enumerate(choice.holder):
        if reader != me:
            continue
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
