"""One shard group's owner step: owners, the two all-to-alls and the state's layout between steps.

Owns: ``ExchangePlan`` (the parameters of one shard process group stepped by owners: who owns each,
each rank's rows, the byte layout of both all-to-alls, what every rank knows of each parameter's state
layout) and ``shard_group_of`` (the layouts the owner step serves). Does not own: when it runs or the
shadow optimizer (``_whole_tensor``, see [Note: The owner step] there).

Bytes: every tensor travels as its raw bytes (any dtype, so bf16 parameters with fp32 state in one
buffer), each piece padded to 8 bytes so that every piece starts aligned for any dtype.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from ..param._dtensor import local_of, make_spec, wrap_local
from ..param._layout import chunk_rows

__all__ = [
    "ExchangePlan",
    "all_to_all_bytes",
    "assign_owners",
    "padded",
    "row_bytes",
    "shard_group_of",
    "sharded_like",
    "take",
]

_ALIGN = 8
Layout = tuple[tuple[str, str, tuple[int, ...], torch.dtype], ...]  # (key, "rows" | "full", shape, dtype)


def shard_group_of(param: torch.Tensor) -> tuple[dist.ProcessGroup, int]:
    """The process group ``param``'s rows are sharded over, and that mesh dim (FSDP or HSDP layouts).

    Raises:
        ValueError: a layout the owner step cannot serve (tensor parallelism: sharded on more than one
            mesh dim or on another tensor dim), naming the parameter's shape and placements.
    """
    assert isinstance(param, DTensor)
    placements = param.placements
    shards = [dim for dim, p in enumerate(placements) if p.is_shard()]
    plain = all(p.is_replicate() or p.is_shard() for p in placements)
    if len(shards) != 1 or placements[shards[0]] != Shard(0) or not plain:
        raise ValueError(
            f"whole-tensor optimizer step: a parameter of shape {tuple(param.shape)} is laid out as "
            f"{tuple(placements)} on its mesh; the owner step serves parameters sharded on dim 0 over one "
            "mesh dim (FSDP, or HSDP's shard dim) only. Tensor-parallel parameters need the update "
            "computed on the tensor-parallel shards' whole: step them with an optimizer built for that "
            "layout, or leave them out of this optimizer."
        )
    return param.device_mesh.get_group(shards[0]), shards[0]


class ExchangePlan:
    """The parameters of one shard process group, stepped whole on their owner ranks.

    Fields (fixed at construction but ``known``):
    - ``group`` / ``world`` / ``rank``: the shard process group, its size, this rank in it.
    - ``params``: ``(param, index of its optimizer param group)``, in the optimizer's order.
    - ``owners``: the owner rank of each parameter (most work first, to the least loaded rank).
    - ``rows``: per parameter, every rank's row count (``torch.chunk``'s pieces, as fsdp2 shards).
    - ``known``: per parameter, the state layout every rank holds (``None`` before the first step).
    """

    def __init__(self, group: dist.ProcessGroup, entries: list[tuple[torch.Tensor, int]]) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.params = entries
        self.rows = [
            [chunk_rows(p.shape[0], self.world, r)[2] for r in range(self.world)] for p, _ in entries
        ]
        self.owners = assign_owners([p for p, _ in entries], self.world)
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
        sends: list[list[torch.Tensor]] = [[] for _ in range(self.world)]
        expect = [0] * self.world
        travelling = [self._travelling(param, state) for param, _ in self.params]
        for i, tensors in enumerate(travelling):
            sends[self.owners[i]].extend(local_of(t) for t in tensors)
            if self.owners[i] == self.rank:
                for r in range(self.world):
                    expect[r] += sum(padded(self.rows[i][r] * row_bytes(t)) for t in tensors)
        received = self._all_to_all(sends, expect)
        pieces: dict[int, list[list[torch.Tensor]]] = {}
        offsets = [0] * self.world
        for i, tensors in enumerate(travelling):
            if self.owners[i] != self.rank:
                continue
            per_tensor: list[list[torch.Tensor]] = [[] for _ in tensors]
            for r in range(self.world):
                for t_index, tensor in enumerate(tensors):
                    shape = (self.rows[i][r], *tensor.shape[1:])
                    piece, offsets[r] = take(received[r], offsets[r], shape, tensor.dtype)
                    per_tensor[t_index].append(piece)
            pieces[i] = per_tensor
        return pieces

    def _assemble(self, i: int, pieces: list[list[torch.Tensor]], state: dict[Any, Any]) -> dict[str, Any]:
        """The whole gradient, parameter and state of parameter ``i`` on its owner."""
        param = self.params[i][0]
        grad, whole, *states = (torch.cat(p, dim=0) for p in pieces)
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
        """All-to-all 2: each rank's rows of the parameter and sharded state, copies of the rest."""
        sends: list[list[torch.Tensor]] = [[] for _ in range(self.world)]
        for i, whole in wholes.items():
            layout, _ = self.known[i]  # type: ignore[misc]
            starts = [sum(self.rows[i][:r]) for r in range(self.world)]
            for r in range(self.world):
                rows = slice(starts[r], starts[r] + self.rows[i][r])
                sends[r].append(whole["param"][rows])
                for key, kind, _, _ in layout:
                    value = whole["state"][key]
                    sends[r].append(value[rows] if kind == "rows" else value)
        expect = [0] * self.world
        for i, (param, _) in enumerate(self.params):
            layout, _ = self.known[i]  # type: ignore[misc]
            mine = self.rows[i][self.rank]
            nbytes = padded(mine * row_bytes(param))
            for _, kind, shape, dtype in layout:
                numel = mine * math.prod(shape[1:]) if kind == "rows" else math.prod(shape)
                nbytes += padded(numel * dtype.itemsize)
            expect[self.owners[i]] += nbytes
        received = self._all_to_all(sends, expect)
        offsets = [0] * self.world
        with torch.no_grad():
            for i, (param, _) in enumerate(self.params):
                owner = self.owners[i]
                layout, scalars = self.known[i]  # type: ignore[misc]
                mine = self.rows[i][self.rank]
                local = local_of(param)  # type: ignore[arg-type]
                piece, offsets[owner] = take(received[owner], offsets[owner], tuple(local.shape), local.dtype)
                local.copy_(piece)
                new_state: dict[str, Any] = dict(scalars)
                old = state.get(param, {})
                for key, kind, shape, dtype in layout:
                    size = (mine, *shape[1:]) if kind == "rows" else shape
                    piece, offsets[owner] = take(received[owner], offsets[owner], size, dtype)
                    new_state[key] = (
                        _rows_state(param, old.get(key), piece) if kind == "rows" else piece.clone()
                    )
                state[param] = new_state

    def _all_to_all(self, sends: list[list[torch.Tensor]], expect: list[int]) -> list[torch.Tensor]:
        return all_to_all_bytes(sends, expect, self.group, self.device)


def assign_owners(params: list[torch.Tensor], world: int) -> list[int]:
    """An owner rank per parameter: the most work first, each to the least loaded rank (ties: lowest)."""
    load = [0] * world
    owners = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (-_work(params[i]), i)):
        owner = min(range(world), key=lambda r: (load[r], r))
        owners[i] = owner
        load[owner] += _work(params[i])
    return owners


def all_to_all_bytes(
    sends: list[list[torch.Tensor]], expect: list[int], group: dist.ProcessGroup, device: torch.device
) -> list[torch.Tensor]:
    """The bytes of ``sends[r]`` to every rank ``r``, and from each ``expect[r]`` bytes: one all-to-all.

    The byte counts are exchanged first: where some rank sends other than what its peer expects, every
    rank raises (after one small all-reduce), so none waits on a collective that would not match.
    """
    parts = [_pack(tensors, device) for tensors in sends]
    out_bytes = [p.numel() for p in parts]
    counts = torch.tensor(out_bytes, dtype=torch.int64, device=device)
    theirs = torch.empty_like(counts)
    dist.all_to_all_single(theirs, counts, group=group)
    wrong = torch.tensor([int(theirs.tolist() != expect)], dtype=torch.int64, device=device)
    dist.all_reduce(wrong, group=group)
    if int(wrong.item()):
        raise RuntimeError(
            "whole-tensor optimizer step: the ranks of a shard group disagree on what to exchange "
            "(a parameter has a gradient or state on some ranks only). Step the optimizer on every "
            "rank after the same backward, and load its state on every rank."
        )
    source = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    output = torch.empty(sum(expect), dtype=torch.uint8, device=device)
    dist.all_to_all_single(output, source, expect, out_bytes, group=group)
    return list(output.split(expect))


def _work(param: torch.Tensor) -> int:
    """The owner's work for ``param``: a Newton-Schulz iteration's for a matrix, else its size."""
    if param.ndim == 2:
        return int(param.numel() * min(param.shape))
    return int(param.numel())


def row_bytes(tensor: torch.Tensor) -> int:
    """Bytes of one row (dim 0) of ``tensor``."""
    return math.prod(tensor.shape[1:]) * tensor.dtype.itemsize


def padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _pack(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The bytes of ``tensors`` one after another, each padded to 8 bytes."""
    chunks = []
    for tensor in tensors:
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        chunks.append(data)
        pad = padded(data.numel()) - data.numel()
        if pad:
            chunks.append(data.new_zeros(pad))
    if not chunks:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.cat(chunks)


def take(
    buffer: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[torch.Tensor, int]:
    """The tensor of ``shape`` and ``dtype`` at ``offset`` of ``buffer`` (a view), and the next offset."""
    nbytes = math.prod(shape) * dtype.itemsize
    piece = buffer[offset : offset + nbytes].view(dtype).view(shape)
    return piece, offset + padded(nbytes)


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
