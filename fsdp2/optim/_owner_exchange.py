"""One shard group's owner step: owners, the two all-to-alls and the state's layout between steps.

Owns: ``ExchangePlan`` (the parameters of one shard process group stepped by owners: who owns each,
each rank's rows, the byte layout of both all-to-alls, what every rank knows of each parameter's state
layout) and ``shard_group_of`` (the layouts the owner step serves). Does not own: when it runs or the
shadow optimizer (``_whole_tensor``, see [Note: The owner step] there).

Bytes: every tensor travels as its raw bytes (any dtype, so bf16 parameters with fp32 state in one
buffer), packed and exchanged by ``comm.exchange`` (each piece aligned for any dtype); the rows go
where the routes between a parameter's row layouts say (``param._rows``: its rows over the shard
group to its owner, and back). Every receiver knows what it receives: no counts travel, one
all-reduce checks them.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..comm import ALIGN, Received, exchange, nbytes_of, pack
from ..param import Piece, RowLayout, local_of, make_spec, owners_by_load, routes, row_shard, wrap_local

__all__ = ["DISAGREE", "ExchangePlan", "join_rows", "owners_of", "shard_group_of", "sharded_like"]

DISAGREE = (
    "whole-tensor optimizer step: the ranks of a shard group disagree on what to exchange "
    "(a parameter has a gradient or state on some ranks only). Step the optimizer on every "
    "rank after the same backward, and load its state on every rank."
)
Layout = tuple[tuple[str, str, tuple[int, ...], torch.dtype], ...]  # (key, "rows" | "full", shape, dtype)


def shard_group_of(param: torch.Tensor) -> tuple[dist.ProcessGroup, int]:
    """The process group ``param``'s rows are sharded over, and that mesh dim (FSDP or HSDP layouts).

    Raises:
        ValueError: a layout the owner step cannot serve (tensor parallelism: sharded on more than one
            mesh dim or on another tensor dim), naming the parameter's shape and placements.
    """
    assert isinstance(param, DTensor)
    mesh_dim = row_shard(param)
    if mesh_dim is None:
        raise ValueError(
            f"whole-tensor optimizer step: a parameter of shape {tuple(param.shape)} is laid out as "
            f"{tuple(param.placements)} on its mesh; the owner step serves parameters sharded on dim 0 "
            "over one mesh dim (FSDP, or HSDP's shard dim) only. Tensor-parallel parameters need the update "
            "computed on the tensor-parallel shards' whole: step them with an optimizer built for that "
            "layout, or leave them out of this optimizer."
        )
    return param.device_mesh.get_group(mesh_dim), mesh_dim


class ExchangePlan:
    """The parameters of one shard process group, stepped whole on their owner ranks.

    Fields (fixed at construction but ``known``):
    - ``group`` / ``world`` / ``rank``: the shard process group, its size, this rank in it.
    - ``params``: ``(param, index of its optimizer param group)``, in the optimizer's order.
    - ``owners``: the owner rank of each parameter (most work first, to the least loaded rank).
    - ``rows`` / ``owned``: per parameter, its rows over the group (``torch.chunk``'s pieces, as fsdp2
      shards) and all on its owner: the two row layouts the step moves between.
    - ``known``: per parameter, the state layout every rank holds (``None`` before the first step).
    """

    def __init__(self, group: dist.ProcessGroup, entries: list[tuple[torch.Tensor, int]]) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.params = entries
        self.owners = owners_of([p for p, _ in entries], self.world)
        self.rows = [RowLayout.chunked(p.shape[0], self.world) for p, _ in entries]
        self.owned = [
            RowLayout.owned(p.shape[0], self.world, owner)
            for (p, _), owner in zip(entries, self.owners, strict=True)
        ]
        self.known: list[tuple[Layout, dict[str, Any]] | None] = [None] * len(entries)
        self.device = entries[0][0].device  # a DTensor's device is its local tensor's

    # ---- one step ----------------------------------------------------------------------------------

    def run(self, optimizer: torch.optim.Optimizer, shadow: torch.optim.Optimizer) -> None:
        """Gather each parameter on its owner, step it there with ``shadow``, give each rank its part."""
        state = optimizer.state
        pieces = self._to_owners(state)
        owned = [i for i, owner in enumerate(self.owners) if owner == self.rank]
        wholes = {i: self._assemble(i, pieces[i], state) for i in owned}
        self._step(optimizer, shadow, wholes)
        self._announce(wholes, shadow)
        self._back(wholes, shadow, state)

    def _sharded_keys(self, param: torch.Tensor, state: dict[Any, Any]) -> list[str]:
        own = state.get(param, {})
        return sorted(k for k, v in own.items() if isinstance(v, DTensor) and v.shape == param.shape)

    def _travelling(self, param: torch.Tensor, state: dict[Any, Any]) -> list[DTensor]:
        """What goes to the owner: the gradient, the parameter, the sharded state (by key)."""
        keys = self._sharded_keys(param, state)
        return [param.grad, param, *(state[param][k] for k in keys)]  # DTensors (checked before the step)

    def _to_owners(self, state: dict[Any, Any]) -> dict[int, list[list[torch.Tensor]]]:
        """All-to-all 1: each rank's rows of the gradient, parameter and sharded state to the owner."""
        sends: dict[int, list[torch.Tensor]] = defaultdict(list)  # only the peers bytes go to
        expect: dict[int, int] = defaultdict(int)
        travelling = [self._travelling(param, state) for param, _ in self.params]
        for i, tensors in enumerate(travelling):
            if self.rows[i].count(self.rank):
                sends[self.owners[i]].extend(local_of(t) for t in tensors)
            for piece in self._gathered(i):
                expect[piece.peer] += sum(nbytes_of((piece.rows, *t.shape[1:]), t.dtype) for t in tensors)
        received = exchange(sends, self.group, expect=expect, device=self.device, mismatch=DISAGREE)
        pieces: dict[int, list[list[torch.Tensor]]] = {}
        for i, tensors in enumerate(travelling):
            if self.owners[i] != self.rank:
                continue
            per_tensor: list[list[torch.Tensor]] = [[] for _ in tensors]
            for piece in self._gathered(i):
                for t_index, tensor in enumerate(tensors):
                    shape = (piece.rows, *tensor.shape[1:])
                    per_tensor[t_index].append(received.take(piece.peer, shape, tensor.dtype))
            pieces[i] = per_tensor
        return pieces

    def _gathered(self, i: int) -> tuple[Piece, ...]:
        """The rows of parameter ``i`` this rank receives as its owner (none when it is not)."""
        return routes(self.rows[i], self.owned[i], self.rank).receive

    def _assemble(self, i: int, pieces: list[list[torch.Tensor]], state: dict[Any, Any]) -> dict[str, Any]:
        """The whole gradient, parameter and state of parameter ``i`` on its owner."""
        param = self.params[i][0]
        travelling = self._travelling(param, state)
        grad, whole, *states = (join_rows(p, t) for p, t in zip(pieces, travelling, strict=True))
        whole.grad = grad
        own = state.get(param, {})
        keys = self._sharded_keys(param, state)
        full_state = {k: v for k, v in own.items() if k not in keys}  # plain, equal on every rank
        full_state.update(zip(keys, states, strict=True))
        return {"param": whole, "state": full_state}

    def _step(
        self, optimizer: torch.optim.Optimizer, shadow: torch.optim.Optimizer, wholes: dict[int, Any]
    ) -> None:
        """The optimizer's own step over the whole tensors this rank owns, with each group's settings."""
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in optimizer.param_groups
        ]
        shadow.state = defaultdict(dict)
        for i, whole in wholes.items():
            groups[self.params[i][1]]["params"].append(whole["param"])
            shadow.state[whole["param"]] = whole["state"]  # the step fills or updates this dict
        shadow.param_groups = groups
        with torch.no_grad():
            type(optimizer).step(shadow)
        shadow.state, shadow.param_groups = defaultdict(dict), []  # hold nothing between steps

    def _announce(self, wholes: dict[int, Any], shadow: torch.optim.Optimizer) -> None:
        """Tell every rank the new state layouts (kinds, shapes, dtypes, scalars) where they changed."""
        changed = {}
        for i, whole in wholes.items():
            layout = _layout_of(whole["param"], whole["state"])
            if layout != self.known[i]:
                changed[i] = layout
        flag = torch.tensor([len(changed)], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, group=self.group)
        if int(flag.item()) == 0:
            return
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, changed, group=self.group)
        for part in everyone:
            for i, layout in part.items():
                self.known[i] = layout

    def _back(self, wholes: dict[int, Any], shadow: torch.optim.Optimizer, state: dict[Any, Any]) -> None:
        """Each rank's rows of the parameter and sharded state (one all-to-all), copies of the rest."""
        sends: dict[int, list[torch.Tensor]] = defaultdict(list)  # only the ranks holding rows
        for i, whole in wholes.items():
            layout, _ = self.known[i]  # type: ignore[misc]
            for piece in routes(self.owned[i], self.rows[i], self.rank).send:
                sends[piece.peer].append(whole["param"][piece.start : piece.stop])
                for key, kind, _, _ in layout:
                    if kind == "rows":
                        sends[piece.peer].append(whole["state"][key][piece.start : piece.stop])
        expect: dict[int, int] = defaultdict(int)
        for i, (param, _) in enumerate(self.params):
            layout, _ = self.known[i]  # type: ignore[misc]
            mine = self.rows[i].count(self.rank)
            if mine:
                nbytes = nbytes_of((mine, *param.shape[1:]), param.dtype)
                for _, kind, shape, dtype in layout:
                    nbytes += nbytes_of((mine, *shape[1:]), dtype) if kind == "rows" else 0
                expect[self.owners[i]] += nbytes
        received = exchange(sends, self.group, expect=expect, device=self.device, mismatch=DISAGREE)
        copies = self._copies(wholes)
        with torch.no_grad():
            for i, (param, _) in enumerate(self.params):
                owner = self.owners[i]
                layout, scalars = self.known[i]  # type: ignore[misc]
                mine = self.rows[i].count(self.rank)
                local = local_of(param)  # type: ignore[arg-type]
                local.copy_(received.take(owner, tuple(local.shape), local.dtype))  # none: empty
                new_state: dict[str, Any] = dict(scalars)
                old = state.get(param, {})
                for key, kind, shape, dtype in layout:
                    if kind == "rows":
                        rows = received.take(owner, (mine, *shape[1:]), dtype)
                        new_state[key] = _rows_state(param, old.get(key), rows)
                    else:
                        new_state[key] = copies.take(owner, shape, dtype).clone()
                state[param] = new_state

    def _copies(self, wholes: dict[int, Any]) -> Received:
        """Every owner's whole (not row-shaped) state tensors, on every rank: one all-gather.

        Each owner packs those of its parameters in parameter order; every rank knows their sizes from
        the layouts (``known``), so each owner's part is padded to the largest and no counts travel.
        The Python work is per parameter, never per rank.
        """
        sizes = [0] * self.world
        for i, known in enumerate(self.known):
            layout, _ = known  # type: ignore[misc]
            sizes[self.owners[i]] += sum(nbytes_of(s, d) for _, kind, s, d in layout if kind != "rows")
        room = max(sizes)
        mine = [
            whole["state"][key]
            for i, whole in sorted(wholes.items())
            for key, kind, _, _ in self.known[i][0]  # type: ignore[index]
            if kind != "rows"
        ]
        if room == 0:
            return Received(torch.empty(0, dtype=torch.uint8, device=self.device), sizes, ALIGN)
        part = torch.zeros(room, dtype=torch.uint8, device=self.device)
        packed = pack(mine, self.device)
        part[: packed.numel()].copy_(packed)
        everyone = torch.empty(self.world * room, dtype=torch.uint8, device=self.device)
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.10
        all_gather(everyone, part, group=self.group)
        return Received(everyone, [room] * self.world, ALIGN)


def owners_of(params: list[torch.Tensor], world: int) -> list[int]:
    """An owner rank per parameter: the most work first, each to the least loaded rank (ties: lowest)."""
    return owners_by_load([_work(p) for p in params], world)


def join_rows(pieces: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The rows ``pieces`` in order as one tensor (a new one; no rows: empty, shaped and typed ``like``)."""
    if pieces:
        return torch.cat(pieces, dim=0)
    return torch.empty((0, *like.shape[1:]), dtype=like.dtype, device=like.device)


def _work(param: torch.Tensor) -> int:
    """The owner's work for ``param``: a Newton-Schulz iteration's for a matrix, else its size."""
    if param.ndim == 2:
        return int(param.numel() * min(param.shape))
    return int(param.numel())


def _layout_of(param: torch.Tensor, state: dict[str, Any]) -> tuple[Layout, dict[str, Any]]:
    """Which state entries are parameter-shaped rows, which whole tensors, which plain values."""
    layout = []
    scalars = {}
    for key in sorted(state):
        value = state[key]
        if isinstance(value, torch.Tensor):
            kind = "rows" if value.shape == param.shape and value.ndim > 0 else "full"
            layout.append((key, kind, tuple(value.shape), value.dtype))
        else:
            scalars[key] = value
    return tuple(layout), scalars


def _rows_state(param: torch.Tensor, old: Any, piece: torch.Tensor) -> DTensor:
    """A parameter-shaped state tensor as a DTensor sharded like ``param`` over this rank's rows."""
    if isinstance(old, DTensor) and old.dtype == piece.dtype and old.shape == param.shape:
        local_of(old).copy_(piece)
        return old
    return sharded_like(param, piece.clone())


def sharded_like(param: torch.Tensor, local: torch.Tensor, shape: tuple[int, ...] | None = None) -> DTensor:
    """A DTensor over ``local`` (this rank's rows), laid out on the mesh as ``param`` is.

    ``shape``: its global shape, when it is not the parameter's (Adafactor's row factor).
    """
    assert isinstance(param, DTensor)
    size = torch.Size(param.shape if shape is None else shape)
    stride = tuple(torch.empty(size, device="meta").stride())
    return wrap_local(local, make_spec(param.device_mesh, param.placements, size, stride, local.dtype))
