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
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..comm import take
from ..group import group_mesh_info, replica_all_gather, replica_slicing_problem, slice_across_replicas
from ..param import RowLayout, is_managed, is_slice, local_of, slice_mesh, slice_rows, slice_spec, wrap_local
from ..runtime import groups_under, sharded_params
from ._local_optim import mark_decided
from ._whole_tensor import kind_of

__all__ = ["shard_optimizer_across_replicas"]

_ATTR = "_fsdp2_cross_replica"


def shard_optimizer_across_replicas(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> torch.optim.Optimizer:
    """Shard ``optimizer``'s state across the replicas of ``model``'s HSDP (or ``replicate``) mesh.

    Each rank then keeps the optimizer state (and the reduced gradient) of ``1 / (R x S)`` of every
    parameter instead of HSDP's ``1 / S``: gradients are reduce-scattered across the replicas instead
    of all-reduced, each rank steps its slice, and the updated slices are all-gathered across the
    replicas after the step (see [Note: The step over replica slices]). Call it once, on every rank,
    after ``fully_shard`` and before the first backward; returns ``optimizer``::

        optimizer = fsdp2.shard_optimizer_across_replicas(model, torch.optim.AdamW(model.parameters()))

    Each parameter's ``.grad`` is then this rank's slice (a DTensor on the ``(shard, replicate)`` mesh
    whose ``full_tensor()`` is the whole gradient); ``fsdp2.clip_grad_norm_`` and DCP take it.

    Raises:
        TypeError: ``model`` or ``optimizer`` is not what it should be.
        ValueError: the optimizer is not elementwise; a ``fully_shard`` group of ``model`` that holds
            parameters of ``optimizer`` cannot reduce across replicas (no replicate dim, an all-reduce
            hook, a rank-ordered reduction, CPU offload, tensor parallelism) or also holds trainable
            parameters of no such optimizer; or the optimizer steps sharded parameters of no group of
            ``model``. Nothing is changed then.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "shard_optimizer_across_replicas expects a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}."
        )
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"shard_optimizer_across_replicas expects the model first, got {type(model).__name__}."
        )
    if _ATTR in optimizer.__dict__:
        return optimizer
    if kind_of(type(optimizer)) != "elementwise":
        raise ValueError(
            f"shard_optimizer_across_replicas: {type(optimizer).__name__} is not an elementwise optimizer, "
            "and only those step slices of a parameter as they step the whole (AdamW, Adam, SGD, ...; "
            "fsdp2.declare_optimizer(cls, 'elementwise') for your own). Muon and Adafactor need whole "
            "matrices: keep them on plain HSDP."
        )
    chosen = _groups_of(model, optimizer)
    meshes: dict[int, Any] = {}
    for group in chosen:
        info = group_mesh_info(group)
        if id(info) not in meshes:
            meshes[id(info)] = slice_mesh(info)
    step = _SlicedStep(optimizer, [(group, meshes[id(group_mesh_info(group))]) for group in chosen])
    for group, mesh in step.groups:
        slice_across_replicas(group, mesh)
    optimizer.__dict__[_ATTR] = step
    mark_decided(optimizer)  # not the automatic local-shard step: this one
    step.to_slices()
    return optimizer


def _groups_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Any]:
    """``model``'s groups holding parameters of ``optimizer``, checked (see the function's Raises)."""
    groups = groups_under(model)
    if not groups:
        raise TypeError(
            f"shard_optimizer_across_replicas: {type(model).__name__} has no fully_shard module; call "
            "fully_shard (with an HSDP mesh) or replicate on it first."
        )
    stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
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
            problem = "it also holds trainable parameters this optimizer does not step"
        if problem is not None:
            raise ValueError(
                f"shard_optimizer_across_replicas: a fully_shard group of {type(model).__name__} cannot "
                f"shard its optimizer state across replicas: {problem}. Give the group an HSDP mesh "
                "(replicate, shard) and this optimizer all its trainable parameters, or leave the "
                "optimizer on plain HSDP."
            )
        chosen.append(group)
    stray = [p for g in optimizer.param_groups for p in g["params"] if is_managed(p) and id(p) not in covered]
    if stray:
        raise ValueError(
            f"shard_optimizer_across_replicas: the optimizer steps {len(stray)} sharded parameter(s) of "
            f"no fully_shard group of {type(model).__name__} (e.g. of shape {tuple(stray[0].shape)}); pass "
            "the model that holds them."
        )
    return chosen


class _SlicedStep:
    """One optimizer's steps over replica slices: its own step hooks (after torch's global ones)."""

    def __init__(self, optimizer: torch.optim.Optimizer, groups: list[tuple[Any, Any]]) -> None:
        self.optimizer = optimizer
        self.groups = groups  # (fully_shard group, its slice mesh)
        self.meshes = {id(p): (group, mesh) for group, mesh in groups for p in sharded_params(group)}
        self.swapped: list[tuple[list[Any], Any]] = []  # (param group's own list, its dict)
        self.slices: list[tuple[DTensor, torch.Tensor, Any]] = []  # (param, slice view, slice mesh)
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
                if isinstance(value, DTensor) and not is_slice(value, entry[1]) and value.shape == key.shape:
                    if tuple(value.placements) != tuple(key.placements):
                        raise ValueError(
                            f"optimizer state {name!r} of a parameter of shape {tuple(key.shape)} is laid "
                            "out "
                            f"as {tuple(value.placements)}, neither as the parameter nor as replica slices."
                        )
                    local = local_of(value).narrow(0, start, stop - start).clone()
                    values[name] = wrap_local(local, slice_spec(key, entry[1], local.dtype))

    def _before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if (len(args) > 1 and args[1] is not None) or kwargs.get("closure") is not None:
            raise ValueError(
                f"{type(optimizer).__name__}.step(closure) with its state sharded across replicas: call "
                "the forward and backward yourself, then step() without a closure."
            )
        self.to_slices()
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

    def _slice(self, param: DTensor, mesh: Any) -> torch.Tensor:
        """The slice of ``param``'s local shard this rank steps (a view), holding its slice gradient."""
        start, stop = self._rows(param)
        view = local_of(param).narrow(0, start, stop - start)
        grad = param.grad
        if grad is not None:
            if isinstance(grad, DTensor) and is_slice(grad, mesh):
                local_grad = local_of(grad)
            elif isinstance(grad, DTensor) and tuple(grad.placements) == tuple(param.placements):
                local_grad = local_of(grad).narrow(
                    0, start, stop - start
                )  # e.g. DCP's zeros, a rank-ordered sum
            else:
                raise ValueError(
                    f"a parameter of shape {tuple(param.shape)} has a gradient laid out as "
                    f"{getattr(grad, 'placements', type(grad).__name__)}, neither as replica slices nor as "
                    "the parameter; step after a backward through fully_shard."
                )
            if local_grad.dtype != view.dtype:
                view.grad_dtype = local_grad.dtype
            view.grad = local_grad
        self.slices.append((param, view, mesh))
        return view

    def _after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
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
        for group, _ in self.groups:
            self._gather(group)

    def _gather(self, group: Any) -> None:
        """All-gather the updated slices of ``group``'s stepped parameters across the replicas."""
        params = [
            cast(DTensor, p)
            for p in sharded_params(group)
            if p.grad is not None and local_of(cast(DTensor, p)).numel()
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
            for replica in range(replicas):
                if replica == me:
                    continue
                base = out.narrow(0, replica * total, total)
                for local, rows, offset in pieces:
                    start, stop = rows.span(replica)
                    if stop > start:
                        shape = (stop - start, *local.shape[1:])
                        piece, _ = take(base, offset, shape, local.dtype, align)
                        local.narrow(0, start, stop - start).copy_(piece)


def _wrapped(value: Any, old: Any, param: DTensor, view: torch.Tensor, mesh: Any) -> Any:
    """A state value after the step, as the optimizer keeps it between steps (slices as DTensors)."""
    if isinstance(old, DTensor) and local_of(old) is value:
        return old  # updated in place
    if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape == view.shape:
        return wrap_local(value, slice_spec(param, mesh, value.dtype))
    return value
