"""Meta-device initialisation: ``fsdp2.init_like_unsharded`` and the repeated-shard warning.

- Inside ``init_like_unsharded()``, ``nn.init`` fills of the sharded parameters (``kaiming_uniform_``,
  both branches of ``trunc_normal_``, ``normal_``, ``Tensor.uniform_``) and ``torch.randn_like`` give
  every rank its part of the unsharded model's draw: parameters bit-equal to an unsharded model
  initialised with the same generator, for even and uneven shards, HSDP and ``Shard(1)``, and training
  then matches that model. Plain tensors and deterministic fills are unchanged.
- Without it, initialising shard by shard with ranks seeded alike repeats the full weight once per rank
  (torch's ``fully_shard`` does the same, silently); fsdp2 warns at the first forward, naming the
  parameters and the fix, and does not warn for constant fills, loaded weights or the context's result.

Thread ranks share the process's default generator, so each rank seeds its own ``torch.Generator``
(what separate processes seeded alike have). On a CPU mesh DTensor's own random fills drop a
``generator=`` argument and draw from the default generator (torch 2.13); inside the context the
generator is honoured. ``tests/comm/test_gloo_features.py`` runs the ``reset_parameters()``
form in gloo processes, where the repetition happens for real.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import fsdp2
from tests._harness import assert_sharded_parity, run_threaded
from tests._training import train_in_lockstep
from tests.models import make_input
from tests.shared.uneven import _Net as _UnevenNet


class _Net(_UnevenNet):
    """Row counts 6, 3 and 5 (world 4 pads every layer and leaves the last rank 0 rows of ``b``), plus
    a parameter initialised to a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale[:5]


def _init(model: nn.Module, gen: torch.Generator) -> None:
    """Several initialisers, drawing from ``gen`` in a fixed order."""
    with torch.no_grad():
        nn.init.kaiming_uniform_(model.a.weight, a=math.sqrt(5), generator=gen)
        nn.init.trunc_normal_(model.a.bias, std=1.0, generator=gen)  # normal draws with rejection
        nn.init.trunc_normal_(model.b.weight, std=1.0, a=-0.1, b=0.1, generator=gen)  # uniform + accept
        model.head.weight.normal_(0.0, 0.5, generator=gen)
        model.head.bias.uniform_(-1.0, 1.0, generator=gen)
        model.scale.fill_(1.0)


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(1234)  # the same seed on every rank


def _reference() -> nn.Module:
    ref = _Net()
    _init(ref, _generator())
    return ref


def _sharded(layout: str) -> _Net:
    with torch.device("meta"):
        model = _Net()
    kwargs: dict[str, Any] = {}
    if layout == "hsdp":
        kwargs["mesh"] = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("r", "s"))
    if layout == "shard1":
        kwargs["shard_placement_fn"] = lambda p: Shard(1) if p.ndim == 2 and p.size(1) % 2 == 0 else None
    fsdp2.fully_shard(model.a, **kwargs)
    fsdp2.fully_shard(model, **kwargs)
    model.to_empty(device="cpu")
    return model


def _inputs(rank: int, step: int) -> torch.Tensor:
    return make_input((3, 4), rank, seed=step)


def _init_matches_unsharded(layout: str) -> None:
    ref = _reference()
    model = _sharded(layout)
    with fsdp2.init_like_unsharded():
        _init(model, _generator())
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert isinstance(param, DTensor), name
        assert torch.equal(param.full_tensor(), ref_param), name
    train_in_lockstep(model, ref, _inputs, 2, assert_sharded_parity)


@pytest.mark.parametrize(("world", "layout"), [(2, "flat"), (4, "flat"), (4, "hsdp"), (2, "shard1")])
def test_init_like_unsharded_equals_the_unsharded_model(world: int, layout: str) -> None:
    run_threaded(world, _init_matches_unsharded, layout)


def _random_like_and_plain_tensors() -> None:
    model = _sharded("flat")
    with fsdp2.init_like_unsharded(), torch.no_grad():
        drawn = torch.randn_like(model.a.weight, generator=_generator())
        plain = torch.empty(6, 4).normal_(generator=_generator())  # not a DTensor: as usual
        model.head.bias.zero_()  # deterministic fills act on the shard as before
    expected = torch.empty(6, 4).normal_(generator=_generator())
    assert isinstance(drawn, DTensor)
    assert drawn.placements == model.a.weight.placements
    assert torch.equal(drawn.full_tensor(), expected)
    assert torch.equal(plain, expected)
    assert torch.equal(model.head.bias.full_tensor(), torch.zeros(5))


def test_random_like_ops_and_plain_tensors_inside_the_context() -> None:
    run_threaded(2, _random_like_and_plain_tensors)


# ---- the warning for shard-by-shard initialisation ---------------------------------------------


def _first_forward(how: str) -> bool:
    """Materialise, initialise ``how``, run one forward; whether the full weight repeats per rank."""
    model = _sharded("flat")
    if how == "per-shard":
        # What DTensor's random fills do on a CPU mesh in processes seeded alike: each rank fills its
        # local shard from the same generator state.
        with torch.no_grad():
            for param in model.parameters():
                local = param.to_local()
                local.copy_(nn.init.uniform_(torch.empty(local.shape), generator=_generator()))
            model.scale.fill_(1.0)
    elif how == "context":
        with fsdp2.init_like_unsharded():
            _init(model, _generator())
    elif how == "constant":
        for param in model.parameters():
            nn.init.constant_(param, 0.5)
    elif how == "loaded":
        model.load_state_dict(_reference().state_dict())
    model(_inputs(dist.get_rank(), 0)).sum().backward()
    model(_inputs(dist.get_rank(), 1)).sum().backward()  # the check runs once
    weight = model.a.weight.full_tensor()
    return torch.equal(weight[:3], weight[3:])


@pytest.mark.parametrize("how", ["per-shard", "context", "constant", "loaded"])
def test_shard_by_shard_initialisation_warns_at_the_first_forward(how: str) -> None:
    # Recorded here, in the main thread: catch_warnings is process-wide.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        repeated = run_threaded(2, _first_forward, how)
    messages = [str(w.message) for w in caught if "holds the same values" in str(w.message)]
    assert repeated == [how in ("per-shard", "constant")] * 2
    if how == "per-shard":
        # One warning per rank, once per group: the root's group (b, head) and a's group.
        assert len(messages) == 4, messages
        assert any("a.weight, a.bias" in m for m in messages), messages
        assert all("fsdp2.init_like_unsharded()" in m for m in messages)
        assert not any("scale" in m for m in messages), "a constant parameter is not reported"
    else:
        assert messages == []
