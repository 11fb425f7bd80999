"""Initialising sharded parameters so that they hold what an unsharded model would.

Owns: :func:`init_like_unsharded`, a context in which a random fill of a sharded DTensor (``uniform_``,
``normal_``, ``torch.randn_like``, ... as called by ``reset_parameters()``, ``nn.init`` and Hugging
Face's ``_init_weights``) draws the full tensor and keeps this rank's part of it; and
:func:`warn_if_repeated_shards`, the check that catches the mistake the context prevents.

Why: after ``to_empty``, ``reset_parameters()`` on a sharded module fills each rank's shard on its own.
With ranks seeded alike on a CPU mesh every rank draws the same numbers, so the full weight repeats once
per rank; on any mesh the values differ from the unsharded model's. Drawing the full tensor (one
parameter at a time, a transient of that parameter's full size) gives every world size the unsharded
model's numbers and keeps the ranks' random generators in step with it.

Invariants: only the random fill itself is redirected. Deterministic fills (``zero_``, ``fill_``) and
elementwise arithmetic already act shard by shard correctly, so a composite initialiser such as
``trunc_normal_`` (random draws, masks, ``where``) ends with this rank's slice of the unsharded result.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Partial
from torch.utils._python_dispatch import TorchDispatchMode

from ._dtensor import local_of

if TYPE_CHECKING:
    from ._param import FSDPParam

__all__ = ["check_materialized", "init_like_unsharded", "warn_if_repeated_shards"]

_aten = torch.ops.aten


def _overloads(ops: Sequence[tuple[str, Sequence[str]]]) -> frozenset[Any]:
    """The named aten overloads this torch has (older versions lack some ``generator`` ones)."""
    packets = [(getattr(_aten, op), names) for op, names in ops]
    return frozenset(getattr(p, n) for p, names in packets for n in names if n in p.overloads())


# In-place random fills: (self, scalars..., generator=) -> self.
_RANDOM_FILLS = _overloads(
    [
        ("uniform_", ("default",)),
        ("normal_", ("default",)),
        ("bernoulli_", ("float",)),
        ("random_", ("default", "from", "to")),
        ("exponential_", ("default",)),
        ("geometric_", ("default",)),
        ("log_normal_", ("default",)),
        ("cauchy_", ("default",)),
    ]
)
# Random tensors shaped like their first argument: (like, scalars..., generator=, dtype=, ...) -> new.
_RANDOM_LIKES = _overloads(
    [
        ("rand_like", ("default", "generator")),
        ("randn_like", ("default", "generator")),
        ("randint_like", ("default", "low_dtype", "generator", "low_generator_dtype")),
    ]
)


@contextmanager
def init_like_unsharded() -> Iterator[None]:
    """Random initialisation of sharded parameters that gives each rank its part of the full draw.

    Inside the block, a random fill of a sharded DTensor (``nn.init.*_``, ``tensor.normal_()``,
    ``torch.randn_like``) draws the whole tensor from the same generator an unsharded tensor would use
    and keeps this rank's shard, so the model holds the unsharded model's values (for the same seed and
    the same order of calls) at every world size and on every device::

        with torch.device("meta"):
            model = Transformer()
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device=device)
        torch.manual_seed(0)  # the same seed on every rank
        with fsdp2.init_like_unsharded():
            for module in model.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()

    Each fill allocates one parameter's full tensor for the duration of the call. Tensors that are not
    sharded DTensors, and DTensors with a ``Partial`` placement, are filled as usual.
    """
    with _FullDrawMode():  # type: ignore[no-untyped-call]  # reason: TorchDispatchMode.__init__ is untyped
        yield


class _FullDrawMode(TorchDispatchMode):
    """Sends random fills of sharded DTensors through a full-size draw (see the module docstring)."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else None
        if not _drawn_whole(target, args[1:]):
            return func(*args, **kwargs)
        assert isinstance(target, DTensor)
        full_like = torch.empty(target.shape, dtype=target.dtype, device=local_of(target).device)
        if func in _RANDOM_FILLS:
            func(full_like, *args[1:], **kwargs)
            local_of(target).copy_(_shard_of(full_like, target))
            return target
        if func in _RANDOM_LIKES:
            full = func(full_like, *args[1:], **kwargs)
            return distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        return func(*args, **kwargs)


def _drawn_whole(target: Any, rest: tuple[Any, ...]) -> bool:
    """A random op on a sharded DTensor whose other arguments are scalars (no tensor inputs)."""
    if not isinstance(target, DTensor) or any(isinstance(a, torch.Tensor) for a in rest):
        return False
    placements = target.placements
    return any(p.is_shard() for p in placements) and not any(isinstance(p, Partial) for p in placements)


def _shard_of(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's local tensor of ``full`` laid out as ``like`` (every rank holds ``full``: no scatter)."""
    return local_of(distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None))


# Is a materialised-from-meta parameter's full tensor the same block repeated once per rank?
_PROBE = 16  # elements compared per rank block: random draws never agree on all of them by chance


def check_materialized(params: Sequence[FSDPParam]) -> None:
    """Refuse to train parameters still on the meta device, or offloaded ones not on the CPU."""
    meta = [p.fqn for p in params if p.sharded_param.is_meta]
    if meta:
        raise RuntimeError(
            f"Parameters {meta} are still on the meta device. Materialize them before training, "
            "e.g. module.to_empty(device=...), then reset_parameters() inside "
            "`with fsdp2.init_like_unsharded():` (or load the weights)."
        )
    misplaced = [p.fqn for p in params if p.offload_to_cpu and p.sharded_param.device.type != "cpu"]
    if misplaced:
        raise RuntimeError(
            f"CPUOffloadPolicy keeps sharded parameters on the CPU, but {misplaced} are not. "
            "Materialize them on the CPU, e.g. module.to_empty(device='cpu')."
        )


def warn_if_repeated_shards(group_params: Sequence[FSDPParam], world: int) -> None:
    """Warn once if a parameter materialised from meta repeats one block per rank (first all-gather).

    Checks the group's parameters whose rank blocks all hold the same non-constant values: the
    pattern shard-by-shard random initialisation with ranks seeded alike produces. Only ``world``-rank
    gathers over the full shard group are read (not post-forward ones), and nothing is read from fake
    tensors (memory estimates) or while torch.compile traces.
    """
    params = [p for p in group_params if p.from_meta and not p.has_extension]
    if not params or world != params[0].mesh_info.shard_size:
        return
    for fsdp_param in params:
        fsdp_param.from_meta = False
    flats = [p.unsharded.all_gather_output() for p in params]
    if torch.compiler.is_compiling() or any(is_fake(flat) for flat in flats):
        return
    repeated = [p.fqn for p, flat in zip(params, flats, strict=True) if _blocks_repeat(p, flat, world)]
    if not repeated:
        return
    names = ", ".join(repeated[:3]) + (f" and {len(repeated) - 3} more" if len(repeated) > 3 else "")
    warnings.warn(
        f"fsdp2: every rank's shard of {names} holds the same values, so the full parameter repeats once "
        "per rank. This is what initialising sharded parameters shard by shard does when ranks are seeded "
        "alike (e.g. reset_parameters() after to_empty on a CPU mesh). Run the initialisation inside "
        "`with fsdp2.init_like_unsharded():` to give each rank its part of the unsharded draw, or load "
        "the weights from a checkpoint (docs/migration.md, 'Initialising on the meta device').",
        UserWarning,
        stacklevel=2,
    )


def _blocks_repeat(param: FSDPParam, flat: torch.Tensor, world: int) -> bool:
    if world < 2 or not param.sharded_param.dtype.is_floating_point:
        return False
    probe = min(_PROBE, param.layout.smallest_shard_numel)
    if probe < 2:
        return False
    blocks = flat.detach().view(world, -1)[:, :probe]
    first = blocks[0]
    if bool((first == first[0]).all()):
        return False  # a constant fill (ones, zeros) is the same on every rank by design
    return bool((blocks == first).all())
