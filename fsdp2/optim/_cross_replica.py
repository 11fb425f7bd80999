"""The optimizer sharded across replicas: ``fsdp2.shard_optimizer_across_replicas(model, optimizer)``.

Owns: the option (its checks, and switching the model's groups to a reduction across replicas by
reduce-scatter), the step over replica slices (``_SlicedStep``: each rank steps its slice of each
shard, with its slice of the gradient and of the state) and the parameters' all-gather across
replicas after each step. Does not own: the slice layout (``param._replica_slices``, see [Note:
Replica slices] there), the reduce-scatter across replicas (``group._replica_reduce``), the update
rule (the optimizer's).

[Note: The step over replica slices]
HSDP on ``R x S`` ranks keeps each parameter and its optimizer state sharded over the ``S`` ranks of
a replica and whole in each of the ``R`` replicas. With this option each rank keeps optimizer state
for ``1 / (R x S)`` of every parameter (ZeRO-1/2 across replicas, HSDP within):

1. backward: each group's gradients are reduce-scattered over its shard group (as in HSDP), then
   reduce-scattered, not all-reduced, across the replicas: each rank's ``.grad`` is its slice, a
   DTensor whose ``full_tensor()`` is the whole averaged gradient;
2. step: a pre-hook hands the optimizer, for each such parameter, the slice of its local shard (a view:
   the update lands in the shard), the slice of the gradient and the state's plain local tensors;
   the optimizer's own step runs on them (elementwise optimizers only); a post-hook wraps new state
   back as slice DTensors;
3. after the step, one all-gather per group across the replicas gives every replica the others'
   updated slices, so each holds its whole shard again before the next forward.

The operations on each element are HSDP's: the same reductions in the same order (two ranks per
replica group sum in one order only), the same update. Between steps the optimizer state is slice
DTensors: ``optimizer.state_dict()`` and DCP save them, and DCP loads them into any layout (plain
HSDP, another world size) and the other way round; state laid out like the parameter (a plain-HSDP
state loaded with ``optimizer.load_state_dict``) is cut into slices at the next step.

[Note: Whole-tensor optimizers over replica slices]
Muon (``torch.optim.Muon``, ``StackedMuon``) and Adafactor step rows, not elements: their updates
need sums or matrix functions over each whole parameter. Over replica slices a parameter's rows lie
on all ``R x S`` ranks, ``torch.chunk`` cut twice (``RowLayout.nested(rows, S, R)``), and one process
group over those ranks (``slice_row_group``, made once by this call) numbers them in row order. Then
the steps that serve row shards (``_muon``, ``_adafactor``; see their notes) serve slices as they
are, given the slice's rows and that group: Muon's momentum and blend are elementwise on the slice,
and each matrix's update travels slice by slice to one owner among all ``R x S`` ranks (owners
balanced over all of them: each matrix is orthogonalised once in the job, not once per replica) and
back; a stack's slices are whole experts, orthogonalised where they are. Adafactor's column, norm
and row-factor sums are all-reduced over the ``R x S`` ranks. The pre-hook runs that step, then
hides the gradients from the optimizer's own step (which steps only the rest) and the post-hook
gives them back before the all-gather. Muon is plain HSDP's bit for bit (the same whole update, the
same elementwise operations); Adafactor's sums add ``R x S`` pieces instead of ``S``, so it is
within fp32 rounding of plain HSDP's. Other whole-tensor optimizers (the general owner step) are
refused.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, TypeVar, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..group import group_mesh_info, replica_all_gather, replica_slicing_problem, slice_across_replicas
from ..param import (
    RowGroup,
    RowLayout,
    is_managed,
    is_slice,
    local_of,
    slice_mesh,
    slice_row_group,
    slice_rows,
    slice_spec,
    wrap_local,
)
from ..runtime import groups_under, sharded_params
from ._adafactor import factored_step
from ._local_optim import mark_decided
from ._muon import ROWS_AVAILABLE, muon_rows_step
from ._stacked_muon import StackedMuon
from ._step_rows import StepRows
from ._whole_tensor import kind_of, whole_tensor_step

__all__ = ["shard_optimizer_across_replicas"]

_ATTR = "_fsdp2_cross_replica"
Optimizers = TypeVar("Optimizers", bound="torch.optim.Optimizer | Sequence[torch.optim.Optimizer]")


def shard_optimizer_across_replicas(model: nn.Module, optimizer: Optimizers) -> Optimizers:
    """Shard ``optimizer``'s state across the replicas of ``model``'s HSDP (or ``replicate``) mesh.

    Each rank then keeps the optimizer state (and the reduced gradient) of ``1 / (R x S)`` of every
    parameter instead of HSDP's ``1 / S``: gradients are reduce-scattered across the replicas instead
    of all-reduced, each rank steps its slice, and the updated slices are all-gathered across the
    replicas after the step (see [Note: The step over replica slices]). Call it once, on every rank,
    after ``fully_shard`` and before the first backward; returns ``optimizer``::

        optimizer = fsdp2.shard_optimizer_across_replicas(model, torch.optim.AdamW(model.parameters()))

    ``optimizer`` may be a list of optimizers that together step the groups' parameters (Muon for the
    matrices, AdamW for the rest; returned as given). Elementwise optimizers step their slices as they
    would the whole; ``torch.optim.Muon``, ``fsdp2.StackedMuon`` and ``torch.optim.Adafactor`` step
    them over all ``R x S`` ranks (see [Note: Whole-tensor optimizers over replica slices]).

    Each parameter's ``.grad`` is then this rank's slice (a DTensor on the ``(shard, replicate)`` mesh
    whose ``full_tensor()`` is the whole gradient); ``fsdp2.clip_grad_norm_`` and DCP take it.

    Raises:
        TypeError: ``model`` or ``optimizer`` is not what it should be.
        ValueError: an optimizer is neither elementwise nor Muon, StackedMuon or Adafactor; a
            ``fully_shard`` group of ``model`` that holds parameters of the optimizers cannot reduce
            across replicas (no replicate dim, an all-reduce hook, a rank-ordered reduction, CPU
            offload, tensor parallelism) or also holds trainable parameters none of them steps; or an
            optimizer steps sharded parameters of no group of ``model``. Nothing is changed then.
    """
    given: list[Any] = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    for one in given:
        if not isinstance(one, torch.optim.Optimizer):
            raise TypeError(
                "shard_optimizer_across_replicas expects a torch.optim.Optimizer (or a list of them), got "
                f"{type(one).__name__}."
            )
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"shard_optimizer_across_replicas expects the model first, got {type(model).__name__}."
        )
    todo = [one for one in given if _ATTR not in one.__dict__]
    steps = {id(one): _rows_step_of(one) for one in todo}  # raises for other kinds
    chosen = _groups_of(model, given) if todo else []
    meshes: dict[int, Any] = {}
    rings: dict[int, RowGroup] = {}
    for group in chosen:
        info = group_mesh_info(group)
        if id(info) not in meshes:
            meshes[id(info)] = slice_mesh(info)
        if id(info) not in rings and any(steps.values()):
            rings[id(info)] = slice_row_group(info)  # collective: the same order on every rank
    for one in todo:
        own = {id(p) for g in one.param_groups for p in g["params"]}
        mine = [g for g in chosen if any(id(p) in own for p in sharded_params(g))]
        mesh_of = [meshes[id(group_mesh_info(g))] for g in mine]
        ring_of = [rings.get(id(group_mesh_info(g))) for g in mine]
        step = _SlicedStep(one, list(zip(mine, mesh_of, ring_of, strict=True)), steps[id(one)])
        for group, mesh, _ in step.groups:
            slice_across_replicas(group, mesh)
        if steps[id(one)] is not None:
            whole_tensor_step(one, enabled=False)  # its owner-step hooks (if any) would see slices
        one.__dict__[_ATTR] = step
        mark_decided(one)  # not the automatic local-shard step: this one
        step.to_slices()
    return optimizer


def _rows_step_of(optimizer: torch.optim.Optimizer) -> str | None:
    """How ``optimizer`` steps replica slices: its own step (``None``: elementwise), or fsdp2's on rows."""
    cls = type(optimizer)
    if cls in (torch.optim.Muon, StackedMuon) and ROWS_AVAILABLE:
        return "muon"
    if cls is torch.optim.Adafactor:
        return "adafactor"
    if kind_of(cls) != "elementwise":
        raise ValueError(
            f"shard_optimizer_across_replicas: {cls.__name__} is neither an elementwise optimizer (AdamW, "
            "Adam, SGD, ...; fsdp2.declare_optimizer(cls, 'elementwise') for your own), which steps "
            "slices of a parameter as it steps the whole, nor torch.optim.Muon, fsdp2.StackedMuon or "
            "torch.optim.Adafactor, whose steps fsdp2 runs over replica slices. Keep it on plain HSDP."
        )
    return None


def _groups_of(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> list[Any]:
    """``model``'s groups holding parameters of ``optimizers``, checked (see the function's Raises)."""
    groups = groups_under(model)
    if not groups:
        raise TypeError(
            f"shard_optimizer_across_replicas: {type(model).__name__} has no fully_shard module; call "
            "fully_shard (with an HSDP mesh) or replicate on it first."
        )
    stepped = {id(p) for optimizer in optimizers for g in optimizer.param_groups for p in g["params"]}
    covered: set[int] = set()
    chosen = []
    for group in groups:
        trainable = [p for p in sharded_params(group) if p.requires_grad]
        mine = [p for p in trainable if id(p) in stepped]
        if not mine:
            continue
        covered.update(id(p) for p in mine)
        problem = replica_slicing_problem(group)
        if problem is None and len(mine) != len(trainable):
            problem = "it also holds trainable parameters none of these optimizers steps"
        if problem is not None:
            raise ValueError(
                f"shard_optimizer_across_replicas: a fully_shard group of {type(model).__name__} cannot "
                f"shard its optimizer state across replicas: {problem}. Give the group an HSDP mesh "
                "(replicate, shard) and these optimizers (a list) all its trainable parameters, or "
                "leave the optimizer on plain HSDP."
            )
        chosen.append(group)
    stray = [
        p
        for optimizer in optimizers
        for g in optimizer.param_groups
        for p in g["params"]
        if is_managed(p) and id(p) not in covered
    ]
    if stray:
        raise ValueError(
            f"shard_optimizer_across_replicas: the optimizers step {len(stray)} sharded parameter(s) of "
            f"no fully_shard group of {type(model).__name__} (e.g. of shape {tuple(stray[0].shape)}); pass "
            "the model that holds them."
        )
    return chosen


class _SlicedStep:
    """One optimizer's steps over replica slices: its own step hooks (after torch's global ones)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        groups: list[tuple[Any, Any, RowGroup | None]],
        rows_step: str | None,
    ) -> None:
        self.optimizer = optimizer
        self.groups = groups  # (fully_shard group, its slice mesh, its ranks in row order)
        self.meshes = {id(p): (group, mesh) for group, mesh, _ in groups for p in sharded_params(group)}
        self.rings = {id(p): ring for group, _, ring in groups for p in sharded_params(group)}
        self.rows_step = rows_step  # "muon" or "adafactor": fsdp2's step over rows; None: the optimizer's
        self.swapped: list[tuple[list[Any], Any]] = []  # (param group's own list, its dict)
        self.slices: list[tuple[DTensor, torch.Tensor, Any]] = []  # (param, slice view, slice mesh)
        self.hidden: list[tuple[torch.Tensor, Any]] = []  # (param, gradient) the rows step stepped
        self.handles = (
            optimizer.register_step_pre_hook(self._before),
            optimizer.register_step_post_hook(self._after),
        )

    def _rows(self, param: DTensor) -> tuple[int, int]:
        group, _ = self.meshes[id(param)]
        return slice_rows(local_of(param).shape[0], group_mesh_info(group))

    def to_slices(self) -> None:
        """Cut state laid out like its parameter (plain HSDP's, e.g. just loaded) into slices."""
        state = self.optimizer.state
        for key in list(state):
            entry = self.meshes.get(id(key))
            if entry is None or not isinstance(key, DTensor):
                continue
            start, stop = self._rows(key)
            values = state[key]
            for name, value in list(values.items()):
                if isinstance(value, DTensor) and not is_slice(value, entry[1]) and _of_rows(value, key):
                    if tuple(value.placements) != tuple(key.placements):
                        raise ValueError(
                            f"optimizer state {name!r} of a parameter of shape {tuple(key.shape)} is laid "
                            "out "
                            f"as {tuple(value.placements)}, neither as the parameter nor as replica slices."
                        )
                    local = local_of(value).narrow(0, start, stop - start).clone()
                    spec = slice_spec(key, entry[1], local.dtype, tuple(value.shape))
                    values[name] = wrap_local(local, spec)

    def _before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if (len(args) > 1 and args[1] is not None) or kwargs.get("closure") is not None:
            raise ValueError(
                f"{type(optimizer).__name__}.step(closure) with its state sharded across replicas: call "
                "the forward and backward yourself, then step() without a closure."
            )
        self.to_slices()
        if self.rows_step is not None:
            self._step_rows(optimizer, self.rows_step)
            return
        state = optimizer.state
        for group in optimizer.param_groups:
            params = group["params"]
            swapped = []
            for param in params:
                entry = self.meshes.get(id(param))
                if entry is None:
                    swapped.append(param)
                    continue
                view = self._slice(param, entry[1])
                if param in state:
                    state[view] = {
                        k: local_of(v) if isinstance(v, DTensor) else v for k, v in state[param].items()
                    }
                swapped.append(view)
            self.swapped.append((params, group))
            group["params"] = swapped

    def _step_rows(self, optimizer: torch.optim.Optimizer, rows_step: str) -> None:
        """Muon's or Adafactor's step over this rank's slices; their gradients hidden from its own step.

        Muon moves a matrix's slices to its owner over all ``R x S`` ranks (a stack's slices are whole
        experts: nothing moves); Adafactor sums its statistics over them.
        """
        parts = []
        by_ring: dict[RowGroup, list[StepRows]] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                entry = self.meshes.get(id(param))
                if entry is None or param.grad is None:
                    continue
                start, stop = self._rows(param)
                local = local_of(param).narrow(0, start, stop - start)
                ring = self.rings[id(param)]
                assert ring is not None, "a rows step without the slices' ranks"
                wrap = functools.partial(_wrap_slice, param, entry[1])
                grad = _slice_grad(param, entry[1], start, stop)
                parts.append(StepRows(param, local, grad, None if param.ndim == 3 else ring, wrap))
                by_ring.setdefault(ring, []).append(parts[-1])
        if rows_step == "muon" and parts:
            muon_rows_step(optimizer, parts)
        for ring, members in by_ring.items() if rows_step == "adafactor" else ():
            factored_step(optimizer, members, ring.group)
        self.hidden = [(part.param, part.param.grad) for part in parts]
        for part in parts:
            part.param.grad = None  # the optimizer's own step skips what the rows step stepped

    def _slice(self, param: DTensor, mesh: Any) -> torch.Tensor:
        """The slice of ``param``'s local shard this rank steps (a view), holding its slice gradient."""
        start, stop = self._rows(param)
        view = local_of(param).narrow(0, start, stop - start)
        if param.grad is not None:
            local_grad = _slice_grad(param, mesh, start, stop)
            if local_grad.dtype != view.dtype:
                view.grad_dtype = local_grad.dtype
            view.grad = local_grad
        self.slices.append((param, view, mesh))
        return view

    def _after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for param, grad in self.hidden:
            param.grad = grad
        self.hidden = []
        for params, group in self.swapped:
            group["params"] = params
        self.swapped = []
        state = optimizer.state
        for param, view, mesh in self.slices:
            view.grad = None
            updated = state.pop(view, None)
            if updated is None:
                continue
            old = state.get(param, {})
            state[param] = {k: _wrapped(v, old.get(k), param, view, mesh) for k, v in updated.items()}
        self.slices = []
        own = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for group, _, _ in self.groups:
            self._gather(group, own)

    def _gather(self, group: Any, own: set[int]) -> None:
        """All-gather across the replicas the updated slices of ``group``'s parameters in ``own``."""
        params = [
            cast(DTensor, p)
            for p in sharded_params(group)
            if id(p) in own and p.grad is not None and local_of(cast(DTensor, p)).numel()
        ]
        if not params:
            return
        info = group_mesh_info(group)
        replicas, me = info.replicate_size, info.mesh.get_local_rank(info.replicate_mesh_dim)
        align = max(p.dtype.itemsize for p in params)
        pieces = []  # (local shard, its rows over the replicas, bytes of one replica's piece)
        total = 0
        for param in params:
            local = local_of(param)
            rows = RowLayout.chunked(local.shape[0], replicas)
            nbytes = -(-rows.step * (local[0].numel() * local.element_size()) // align) * align
            pieces.append((local, rows, total))
            total += nbytes
        send = torch.zeros(total, dtype=torch.uint8, device=params[0].device)
        for local, rows, offset in pieces:
            start, stop = rows.span(me)
            mine = local.narrow(0, start, stop - start).reshape(-1).view(torch.uint8)
            send.narrow(0, offset, mine.numel()).copy_(mine)
        out = torch.empty(replicas * total, dtype=torch.uint8, device=send.device)
        replica_all_gather(group)(out, send, info.replicate_group)
        with torch.no_grad():
            for local, rows, offset in pieces:
                _take_slices(out.view(replicas, total), offset, local, rows.step)


def _take_slices(out: torch.Tensor, offset: int, local: torch.Tensor, step: int) -> None:
    """Each replica's slice of ``local`` (``step`` rows, the last ones fewer) from its row of ``out``.

    ``out``: ``[replicas, bytes]``, a replica's slice at ``offset`` of its row (aligned for ``local``'s
    dtype). The replicas holding ``step`` rows come as one strided copy, the one holding the rest as
    one more: no Python per replica. This rank's own slice is copied too, onto the same values.
    """
    full, rest = divmod(local.shape[0], step) if step else (0, 0)
    row_bytes = local[0].numel() * local.element_size() if local.shape[0] else 0
    if full:
        sent = out[:full, offset : offset + step * row_bytes].view(local.dtype)
        local[: full * step].unflatten(0, (full, step)).copy_(sent.view(full, step, *local.shape[1:]))
    if rest:
        sent = out[full, offset : offset + rest * row_bytes].view(local.dtype)
        local[full * step :].copy_(sent.view(rest, *local.shape[1:]))


def _slice_grad(param: DTensor, mesh: Any, start: int, stop: int) -> torch.Tensor:
    """This rank's slice of ``param``'s gradient (rows ``[start, stop)`` of its local shard)."""
    grad = param.grad
    if isinstance(grad, DTensor) and is_slice(grad, mesh):
        return local_of(grad)
    if isinstance(grad, DTensor) and tuple(grad.placements) == tuple(param.placements):
        return local_of(grad).narrow(0, start, stop - start)  # e.g. DCP's zeros, a rank-ordered sum
    raise ValueError(
        f"a parameter of shape {tuple(param.shape)} has a gradient laid out as "
        f"{getattr(grad, 'placements', type(grad).__name__)}, neither as replica slices nor as "
        "the parameter; step after a backward through fully_shard."
    )


def _of_rows(value: DTensor, param: DTensor) -> bool:
    """Whether state ``value`` is over ``param``'s rows (its shape, or Adafactor's factor of them)."""
    return value.ndim == param.ndim and value.ndim > 0 and value.shape[0] == param.shape[0]


def _wrap_slice(param: DTensor, mesh: Any, local: torch.Tensor, shape: tuple[int, ...] | None) -> DTensor:
    """State over this rank's slice rows of ``param`` as a slice DTensor (``shape``: its global one)."""
    return wrap_local(local, slice_spec(param, mesh, local.dtype, shape))


def _wrapped(value: Any, old: Any, param: DTensor, view: torch.Tensor, mesh: Any) -> Any:
    """A state value after the step, as the optimizer keeps it between steps (slices as DTensors)."""
    if isinstance(old, DTensor) and local_of(old) is value:
        return old  # updated in place
    if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape == view.shape:
        return wrap_local(value, slice_spec(param, mesh, value.dtype))
    return value
