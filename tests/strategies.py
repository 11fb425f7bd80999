"""Hypothesis strategies shared by the property tests.

Owns: world sizes, parameter shapes (1-3 dims, dim 0 often smaller than the world size, equal to 1,
or 0), dtypes, and ``SimulatedGroup`` records: a world size plus the parameters of one group.
Tensors are built from a seeded ``torch.Generator`` so an example is fully described by its draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

MAX_WORLD_SIZE = 16

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INT_DTYPES = (torch.int64, torch.int32)

world_sizes = st.integers(min_value=1, max_value=MAX_WORLD_SIZE)
float_dtypes = st.sampled_from(FLOAT_DTYPES)
# Integer parameters only ever travel through the all-gather (they have no gradients).
gather_dtypes = st.sampled_from(FLOAT_DTYPES + INT_DTYPES)

# Dim 0 drives the sharding math: bias it towards 0, 1 and values around the world sizes.
dim0_sizes = st.one_of(
    st.sampled_from([0, 1]),
    st.integers(min_value=2, max_value=MAX_WORLD_SIZE + 3),
    st.integers(min_value=MAX_WORLD_SIZE + 4, max_value=70),
)
trailing_sizes = st.integers(min_value=1, max_value=5)


@st.composite
def param_shapes(draw: st.DrawFn, *, allow_empty: bool = True) -> torch.Size:
    """A parameter shape with 1 to 3 dims; dim 0 may be 0 unless ``allow_empty`` is false."""
    dim0 = draw(dim0_sizes.filter(lambda n: allow_empty or n > 0))
    trailing = draw(st.lists(trailing_sizes, min_size=0, max_size=2))
    return torch.Size((dim0, *trailing))


@dataclass(frozen=True)
class SimulatedGroup:
    """One parameter group over a simulated world: what every rank would hold before sharding."""

    world_size: int
    shapes: tuple[torch.Size, ...]
    dtype: torch.dtype
    seed: int

    def originals(self) -> list[torch.Tensor]:
        """The original (unsharded) parameters, identical on every simulated rank."""
        gen = torch.Generator().manual_seed(self.seed)
        return [random_tensor(shape, self.dtype, gen) for shape in self.shapes]

    def rank_grads(self, rank: int) -> list[torch.Tensor]:
        """Small-integer-valued gradients of ``rank``: sums and powers of two stay exact in every dtype."""
        gen = torch.Generator().manual_seed(self.seed * 1009 + rank + 1)
        return [
            torch.randint(-8, 9, shape, generator=gen, dtype=torch.int64).to(self.dtype)
            for shape in self.shapes
        ]


def random_tensor(shape: torch.Size, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=gen, dtype=torch.int64).to(dtype)


@st.composite
def simulated_groups(
    draw: st.DrawFn,
    *,
    dtypes: st.SearchStrategy[torch.dtype] = float_dtypes,
    allow_empty: bool = True,
    max_params: int = 4,
) -> SimulatedGroup:
    """A world size and 1..``max_params`` parameters of mixed shapes sharing one dtype."""
    world_size = draw(world_sizes)
    shapes = draw(st.lists(param_shapes(allow_empty=allow_empty), min_size=1, max_size=max_params))
    dtype = draw(dtypes)
    seed = draw(st.integers(min_value=0, max_value=2**16))
    return SimulatedGroup(world_size, tuple(shapes), dtype, seed)
