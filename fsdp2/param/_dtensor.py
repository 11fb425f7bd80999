"""The one module that builds and re-points DTensors through their internals.

(``_memory.py`` also patches DTensor's sharding propagator while it estimates memory on fake tensors.)

Owns: building a DTensor from a local tensor and a precomputed spec without the autograd and
validation work of ``DTensor.from_local`` (hot path: one call per gradient per step), re-pointing
a DTensor at new local storage, and ``copy.deepcopy`` of a DTensor whose local tensor starts at a
storage offset (torch 2.13's fails; installed at import, see ``install_deepcopy``), and pickling
(``torch.save``) of a DTensor whose local tensor is a part of a larger storage: just the part is
saved (torch 2.13 fails where the part starts at an offset; see ``install_pickling``).
``tests/param/test_dtensor.py`` checks them against the public API.
Invariants: the spec passed in describes the local tensor (global shape, stride, dtype, placements).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Sequence
from operator import attrgetter
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = [
    "DTensorSpec",
    "install_deepcopy",
    "install_pickling",
    "local_in_placements",
    "local_of",
    "locals_of",
    "make_spec",
    "rebase_local",
    "set_local",
    "sole_reference",
    "spec_of",
    "specs_of",
    "strided_shard",
    "wrap_local",
]


def make_spec(
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    size: torch.Size,
    stride: tuple[int, ...],
    dtype: torch.dtype,
) -> DTensorSpec:
    """A DTensor spec for a global tensor of ``size``/``stride``/``dtype`` laid out by ``placements``."""
    return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(size, stride, dtype))


# DTensor's constructor is its C++ ``__new__`` followed by a Python ``__init__`` that only wraps
# ``Tensor.__init__`` in a torch.compile guard (a few µs a call). Building through ``__new__`` alone
# skips that guard; where a torch version lacks the C++ constructor, the full constructor is used.
_DTENSOR_NEW = getattr(torch.Tensor, "_dtensor__new__", None)
_NEW_ONLY = _DTENSOR_NEW is not None and DTensor.__new__ is _DTENSOR_NEW


def wrap_local(local: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool = False) -> DTensor:
    """A DTensor over ``local`` (no copy, no autograd edge)."""
    if _NEW_ONLY and not torch.compiler.is_compiling():
        tensor: DTensor = _DTENSOR_NEW(DTensor, local, spec, requires_grad=requires_grad)  # type: ignore[misc]  # reason: checked not None
        return tensor
    return DTensor(local, spec, requires_grad=requires_grad)


def local_of(tensor: DTensor) -> torch.Tensor:
    """The local tensor of a DTensor, without the autograd-tracked ``to_local`` call."""
    local: torch.Tensor = tensor._local_tensor  # noqa: SLF001 - this module owns DTensor internals
    return local


_LOCAL_TENSOR = attrgetter("_local_tensor")
_SPEC = attrgetter("_spec")


def locals_of(tensors: Iterable[DTensor]) -> Iterator[torch.Tensor]:
    """The local tensors of ``tensors``, lazily (a C-level loop: hot paths check whole lists)."""
    return map(_LOCAL_TENSOR, tensors)


def specs_of(tensors: Iterable[DTensor]) -> Iterator[DTensorSpec]:
    """The specs of ``tensors``, lazily (see ``locals_of``)."""
    return map(_SPEC, tensors)


def set_local(tensor: DTensor, local: torch.Tensor) -> None:
    """Point ``tensor`` at new local storage (same local shape)."""
    tensor._local_tensor = local  # noqa: SLF001 - this module owns DTensor internals


def rebase_local(param: DTensor, local: torch.Tensor) -> bool:
    """Point ``param`` at ``local`` (same shape, any storage offset), keeping the Python object.

    The wrapper tensor records its local tensor's storage offset, and torch.compile relies on the two
    agreeing. A local at another offset therefore gets a new wrapper whose tensor is swapped into
    ``param`` (as ``nn.Module._apply`` does for DTensor parameters): identity, attributes and
    post-accumulate-grad hooks stay, and the gradient is carried over. Returns ``False`` and changes
    nothing where another reference to the tensor (an autograd graph) makes swapping unsafe.
    """
    if local.storage_offset() == param.storage_offset():
        set_local(param, local)
        return True
    if not sole_reference(param):
        return False
    grad = param.grad
    replacement = wrap_local(local, spec_of(param), requires_grad=param.requires_grad)
    param.grad = None
    torch._C._swap_tensor_impl(param, replacement)  # noqa: SLF001 - the primitive under torch.utils.swap_tensors
    set_local(param, local)
    param.grad = grad
    return True


def sole_reference(tensor: torch.Tensor) -> bool:
    """Whether only ``tensor``'s Python object refers to its tensor (no autograd graph or C++ user)."""
    count: int = tensor._use_count()  # type: ignore[attr-defined]  # noqa: SLF001 - untyped private accessor
    return count == 1


def spec_of(tensor: DTensor) -> DTensorSpec:
    spec: DTensorSpec = tensor._spec  # noqa: SLF001 - this module owns DTensor internals
    return spec


def strided_shard(dim: int, split_factor: int) -> Placement:
    """DTensor's placement for a dim sharded inside another mesh dim's shards (FSDP inside TP)."""
    return _StridedShard(dim, split_factor=split_factor)


def local_in_placements(tensor: DTensor, placements: Sequence[Placement]) -> torch.Tensor:
    """``tensor``'s local tensor after redistributing it to ``placements`` (e.g. reducing ``Partial``).

    Waits for an asynchronous collective result, so the caller gets a plain tensor.
    """
    if tuple(tensor.placements) != tuple(placements):
        tensor = tensor.redistribute(tensor.device_mesh, placements)
    local = local_of(tensor)
    if isinstance(local, AsyncCollectiveTensor):
        local = local.wait()
    return local


def _deepcopy_at_offset(self: DTensor, memo: dict[int, Any]) -> DTensor:
    """``copy.deepcopy`` of a DTensor whose local tensor starts at a storage offset.

    torch 2.13's ``Tensor.__deepcopy__`` treats a wrapper tensor with a nonzero ``data_ptr()`` (which a
    DTensor wrapper has when its local tensor is a view at an offset, as fsdp2's packed shards are) as
    one with a real storage, and fails ("invalid python storage"). This copies the local tensor (with
    ``memo``, so views of one storage stay views of one copied storage), wraps it with the same spec,
    and copies the gradient and the instance attributes (``nn.Parameter``-ness among them).
    """
    if self.data_ptr() == 0:  # no offset: torch's own path (a clone) works
        copied: DTensor = _TENSOR_DEEPCOPY(self, memo)  # type: ignore[no-untyped-call]  # reason: torch's is untyped
        return copied
    if id(self) in memo:
        done: DTensor = memo[id(self)]
        return done
    if not self.is_leaf:
        raise RuntimeError(
            "copy.deepcopy works on DTensors that are graph leaves (parameters, detached tensors), not on "
            "results of differentiable operations; deepcopy tensor.detach() instead."
        )
    with torch.no_grad():
        local = copy.deepcopy(local_of(self).detach(), memo)
    new = wrap_local(local, spec_of(self), requires_grad=self.requires_grad)
    memo[id(self)] = new
    if self.grad is not None:
        new.grad = copy.deepcopy(self.grad, memo)
    for name, value in self.__dict__.items():
        if name not in ("_local_tensor", "_spec"):
            setattr(new, name, copy.deepcopy(value, memo))
    return new


_TENSOR_DEEPCOPY = torch.Tensor.__deepcopy__


def install_deepcopy() -> None:
    """Give ``DTensor`` the deep copy above, unless torch defines one of its own (idempotent)."""
    if DTensor.__deepcopy__ is _TENSOR_DEEPCOPY:
        DTensor.__deepcopy__ = _deepcopy_at_offset  # type: ignore[method-assign,assignment]


def _covers_storage(local: torch.Tensor) -> bool:
    """Whether ``local`` is its storage's only content (a plain tensor, or one without data)."""
    if local.device.type == "meta" or is_traceable_wrapper_subclass(local):
        return True
    if not torch._C._has_storage(local) or isinstance(local, FakeTensor):  # noqa: SLF001 - no public check
        return True
    nbytes = local.numel() * local.element_size()
    return local.storage_offset() == 0 and local.untyped_storage().nbytes() == nbytes


def _reduce_part(self: DTensor, proto: int) -> Any:
    """Pickle a DTensor; one whose local tensor is part of a larger storage keeps just that part.

    fsdp2's local shards are slots of a group's packed buffer. Pickled through ``torch.Tensor``'s
    reduction, a shard at a nonzero offset fails (its wrapper has a nonzero ``data_ptr()``, which torch
    takes for a real storage), and one at offset 0 would carry the whole buffer. Here the part is
    copied into a storage of its own (a transient copy while the pickler runs) and that DTensor is
    pickled instead: it loads as a DTensor over a compact local tensor, the spec and attributes kept.
    """
    local = local_of(self)
    if _covers_storage(local) and self.data_ptr() == 0:
        return _TENSOR_REDUCE_EX(self, proto)  # type: ignore[no-untyped-call]  # reason: untyped in torch
    part = local.detach().clone(memory_format=torch.contiguous_format)
    compact = wrap_local(part, spec_of(self), requires_grad=self.requires_grad)
    for name, value in self.__dict__.items():
        if name not in ("_local_tensor", "_spec"):
            setattr(compact, name, value)
    return _TENSOR_REDUCE_EX(compact, proto)  # type: ignore[no-untyped-call]  # reason: untyped in torch


_TENSOR_REDUCE_EX = torch.Tensor.__reduce_ex__


def install_pickling() -> None:
    """Give ``DTensor`` the reduction above, unless torch defines one of its own (idempotent)."""
    if DTensor.__reduce_ex__ is _TENSOR_REDUCE_EX:
        DTensor.__reduce_ex__ = _reduce_part  # type: ignore[method-assign,assignment]
