"""A model whose weights are tensor subclasses with an all-gather extension, shared by the extension and
surface tests.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils._pytree import tree_map

aten = torch.ops.aten


class WrapperWeight(torch.Tensor):
    """A float weight wrapper: every op but a few layout ops unwraps it (compute sees the plain tensor),
    like torchao's float8 training weights."""

    _preserve: ClassVar[set[Any]] = {
        aten.detach.default,
        aten.view.default,
        aten._unsafe_view.default,
        aten.slice.Tensor,
        aten.new_zeros.default,
        aten.copy_.default,
        aten.clone.default,
        aten._to_copy.default,
        aten.empty_like.default,
        aten.as_strided.default,
        aten.split.Tensor,
        aten.alias.default,
        aten.t.default,
    }

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> WrapperWeight:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls, data.shape, strides=data.stride(), dtype=data.dtype, device=data.device
        )

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._data!r})"

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(cls, inner: dict[str, torch.Tensor], meta: Any, size: Any, stride: Any) -> Any:
        return cls(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        unwrap = lambda t: t._data if isinstance(t, WrapperWeight) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func in cls._preserve:
            return tree_map(lambda t: cls(t) if isinstance(t, torch.Tensor) else t, out)
        return out


class Net(nn.Module):
    def __init__(self, linear: type[nn.Linear] = nn.Linear, rows: tuple[int, int] = (12, 6)) -> None:
        super().__init__()
        self.l1 = linear(8, rows[0])
        self.l2 = linear(rows[0], rows[1])
        self.head = nn.Linear(rows[1], 3)  # a plain parameter in the root group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.l2(torch.relu(self.l1(x)))))
