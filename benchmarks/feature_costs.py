"""Every feature's per-rank host cost at thousands of ranks, fsdp2 against torch (issue 53, item 3).

One process acts as rank 1 of ``N`` ranks under torch's fake process group (no process talks to
another, every collective returns at once), a fresh process per ``N``, as in
``benchmarks/flat_costs.py`` (which measures the ring of ``Snapshots``, ``check_replicas``, the
whole-tensor Muon step, ``save_pretrained``, ``WeightSync`` and the deterministic reduction; those are
not repeated here). The all-gather, reduce-scatter and all-to-all are emulated by one tensor operation
each, for fsdp2 and torch alike (both call ``dist.all_gather_single`` and
``dist.reduce_scatter_single``): the fake backend's own copy chunk by chunk, host work growing with N
that one NCCL call does not have. All-reduces stay the fake backend's no-op.

Per feature, two figures of rank 1: its CPU time (``time.process_time``, one intra-op thread, the
least of ``--tries`` runs, milliseconds) and the peak of Python allocations during one more run
(``tracemalloc``, KiB: where a list, dict or tuple of one entry per rank shows; tensor storage is not
a Python allocation and is not in it). The features, ``fsdp2`` and, where torch has it, ``torch``:

- ``fully_shard``: each of 16 blocks of two ``Linear(512, 512)`` and the root, FSDP over N ranks
  (``torch.distributed.fsdp.fully_shard`` for torch);
- ``step fsdp`` / ``step hsdp``: one forward, backward and ``AdamW`` step of 4 blocks of two
  ``Linear(128, 128)``, FSDP over N ranks and HSDP on a (N/4 replicas, 4 shards) mesh;
- ``state_dict``, ``get_model_state_dict``, ``get_optimizer_state_dict``: the 512 model after one
  AdamW step (``torch.distributed.checkpoint.state_dict``'s functions for both);
- ``clip_grad_norm``: ``fsdp2.clip_grad_norm_`` on the 512 model's gradients against
  ``torch.nn.utils.clip_grad_norm_`` on torch's;
- ``adafactor step``: ``torch.optim.Adafactor.step()`` on the 128 model (fsdp2 steps it on rows, two
  small all-reduces per step; torch's ``fully_shard`` raises in Adafactor's in-place ``pow_``, see
  docs/optimizers.md): fsdp2 only;
- ``replicate setup`` / ``replicate step``: ``fsdp2.replicate`` against torch's
  ``torch.distributed._composable.replicate_with_fsdp.replicate`` on each block and the root of the
  128 model, over N ranks, then one AdamW step;
- ``across-replicas step``: ``fsdp2.shard_optimizer_across_replicas`` on the HSDP 128 model, one
  AdamW step (compare with ``step hsdp``): fsdp2 only;
- ``experts setup`` / ``experts step``: ``fsdp2.shard_experts`` then ``fully_shard`` of the blocks and
  the root of ``tests/shared/experts_models.Net`` (2 MoE layers, top 2, width 4, 64 tokens), one
  forward, backward and AdamW step; ``2N`` experts at ``ep = N`` (two experts per rank, the token
  exchange over every rank) and 160 at ``ep = 8``. Under the fake group the token counts a rank
  receives are its own (``fsdp2/experts/_tokens.py``). fsdp2 only.

Run:  python benchmarks/feature_costs.py [--worlds 8 512 4096 16384] [--tries 5] [--only NAME ...]
Prints one table of milliseconds and one of KiB.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _per_world import rows_per_world

REPO = Path(__file__).resolve().parents[1]
RANK = 1
TRIES = 5

Measured = dict[str, tuple[float, float]]


def _measure(run: Callable[[Any], Any], prepare: Callable[[], Any] | None = None) -> tuple[float, float]:
    """(least CPU ms of ``TRIES`` runs, peak KiB of Python allocations in one more run)."""
    times = []
    for _ in range(TRIES):
        state = prepare() if prepare else None
        start = time.process_time()
        run(state)
        times.append(time.process_time() - start)
    state = prepare() if prepare else None
    tracemalloc.start()
    try:
        run(state)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return min(times) * 1e3, peak / 1024


def _emulate_collectives() -> None:
    """All-gather, reduce-scatter and all-to-all as one tensor operation each (see the module)."""
    import torch
    import torch.distributed as dist

    def all_gather_single(output: Any, input_tensor: Any, group: Any = None, async_op: bool = False) -> None:
        ranks = dist.get_world_size(group)
        output.view(ranks, -1).copy_(input_tensor.reshape(1, -1).expand(ranks, -1))

    def reduce_scatter_single(
        output: Any,
        input: Any,  # torch's keyword, which torch's fully_shard passes by name
        op: Any = None,
        group: Any = None,
        async_op: bool = False,
    ) -> None:
        torch.sum(input.view(dist.get_world_size(group), -1), dim=0, out=output.view(-1))

    def all_to_all_single(output: Any, input_tensor: Any, *args: Any, **kwargs: Any) -> None:
        if output.numel() == input_tensor.numel():
            output.copy_(input_tensor)
        else:
            output.zero_()

    dist.all_gather_single = all_gather_single  # type: ignore[attr-defined]
    dist.reduce_scatter_single = reduce_scatter_single  # type: ignore[attr-defined]
    dist.all_to_all_single = all_to_all_single  # type: ignore[assignment]


def _sharders() -> dict[str, Callable[..., Any]]:
    from torch.distributed.fsdp import fully_shard

    import fsdp2

    return {"fsdp2": fsdp2.fully_shard, "torch": fully_shard}


def _blocks(width: int, count: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.Linear(width, width)) for _ in range(count)]
    )


def _shard(model: Any, apply: Callable[..., Any], mesh: Any) -> Any:
    for block in model:
        apply(block, mesh=mesh)
    apply(model, mesh=mesh)
    return model


def _train(model: Any, optim: Any, x: Any) -> None:
    model(x).sum().backward()
    optim.step()
    optim.zero_grad()


def _fully_shard(world: int, out: Measured) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    base = _blocks(512, 16)
    for lib, apply in _sharders().items():
        out[f"{lib} fully_shard"] = _measure(
            lambda model, a=apply: _shard(model, a, mesh), lambda: copy.deepcopy(base)
        )


def _steps(world: int, out: Measured) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    base = _blocks(128, 4)
    x = torch.randn(8, 128)
    meshes = {
        "fsdp": init_device_mesh("cpu", (world,)),
        "hsdp": init_device_mesh("cpu", (world // 4, 4), mesh_dim_names=("replicate", "shard")),
    }
    for name, mesh in meshes.items():
        for lib, apply in _sharders().items():
            model = _shard(copy.deepcopy(base), apply, mesh)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
            _train(model, optim, x)  # state made
            out[f"{lib} step {name}"] = _measure(lambda _, m=model, o=optim: _train(m, o, x))


def _state_and_clip(world: int, out: Measured) -> None:
    import torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2

    mesh = init_device_mesh("cpu", (world,))
    base = _blocks(512, 16)
    x = torch.randn(4, 512)
    clips = {"fsdp2": fsdp2.clip_grad_norm_, "torch": torch.nn.utils.clip_grad_norm_}
    for lib, apply in _sharders().items():
        model = _shard(copy.deepcopy(base), apply, mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _train(model, optim, x)
        out[f"{lib} state_dict"] = _measure(lambda _, m=model: m.state_dict())
        out[f"{lib} get_model_state_dict"] = _measure(lambda _, m=model: get_model_state_dict(m))
        out[f"{lib} get_optimizer_state_dict"] = _measure(
            lambda _, m=model, o=optim: get_optimizer_state_dict(m, o)
        )
        model(x).sum().backward()
        params = list(model.parameters())
        out[f"{lib} clip_grad_norm"] = _measure(lambda _, c=clips[lib], p=params: c(p, 1.0))


def _adafactor(world: int, out: Measured) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2

    model = _shard(_blocks(128, 4), fsdp2.fully_shard, init_device_mesh("cpu", (world,)))
    optim = torch.optim.Adafactor(model.parameters(), lr=1e-3)
    x = torch.randn(8, 128)
    _train(model, optim, x)
    model(x).sum().backward()
    out["fsdp2 adafactor step"] = _measure(lambda _: optim.step())


def _replicate(world: int, out: Measured) -> None:
    import torch
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("replicate",))
    base = _blocks(128, 4)
    x = torch.randn(8, 128)
    for lib, apply in {"fsdp2": fsdp2.replicate, "torch": replicate}.items():
        out[f"{lib} replicate setup"] = _measure(
            lambda model, a=apply: _shard(model, a, mesh), lambda: copy.deepcopy(base)
        )
        model = _shard(copy.deepcopy(base), apply, mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _train(model, optim, x)
        out[f"{lib} replicate step"] = _measure(lambda _, m=model, o=optim: _train(m, o, x))


def _across(world: int, out: Measured) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2

    mesh = init_device_mesh("cpu", (world // 4, 4), mesh_dim_names=("replicate", "shard"))
    model = _shard(_blocks(128, 4), fsdp2.fully_shard, mesh)
    optim = fsdp2.shard_optimizer_across_replicas(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randn(8, 128)
    _train(model, optim, x)
    out["fsdp2 across-replicas step"] = _measure(lambda _: _train(model, optim, x))


def _experts(world: int, out: Measured) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2
    from tests.shared.experts_models import DIM, Net

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    x = torch.randn(64, DIM)
    for label, experts, ep in (("2N", 2 * world, world), ("160", 160, 8)):
        torch.manual_seed(0)
        base = Net(experts, top_k=2, counted=False, layers=2)
        with torch.no_grad():
            for param in base.parameters():
                param.normal_(0, 0.5)

        def setup(model: Any, ep: int = ep) -> Any:
            fsdp2.shard_experts(model, ep=ep, mesh=mesh)
            for layer in model.layers:
                fsdp2.fully_shard(layer, mesh=mesh)
            return fsdp2.fully_shard(model, mesh=mesh)

        out[f"fsdp2 experts {label} setup"] = _measure(setup, lambda b=base: copy.deepcopy(b))
        model = setup(copy.deepcopy(base))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _train(model, optim, x)
        out[f"fsdp2 experts {label} step"] = _measure(lambda _, m=model, o=optim: _train(m, o, x))


FEATURES = {
    "fully_shard": _fully_shard,
    "steps": _steps,
    "state": _state_and_clip,
    "adafactor": _adafactor,
    "replicate": _replicate,
    "across": _across,
    "experts": _experts,
}


def _one(world: int, only: list[str]) -> Measured:
    sys.path.insert(0, str(REPO))
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)  # CPU time = this rank's host time
    torch.set_flush_denormal(True)
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=world)
    _emulate_collectives()
    out: Measured = {}
    for name in only:
        FEATURES[name](world, out)
    return out


def _table(rows: dict[int, Measured], index: int, unit: str) -> None:
    names = list(next(iter(rows.values())))
    print(f"\n{unit}")
    print(f"{'feature':<34} | " + " | ".join(f"{world:>9}" for world in rows) + " | growth")
    for name in names:
        values = [row[name][index] for row in rows.values()]
        growth = values[-1] / values[0] if values[0] else float("nan")
        print(f"{name:<34} | " + " | ".join(f"{v:>9.2f}" for v in values) + f" | {growth:.1f}x")


def main() -> None:
    global TRIES
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 512, 4096, 16384])
    parser.add_argument("--tries", type=int, default=TRIES)
    parser.add_argument("--only", nargs="+", choices=list(FEATURES), default=list(FEATURES))
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        TRIES = args.tries
        print(json.dumps(_one(args.one, args.only)))
        return
    rows = rows_per_world(__file__, args.worlds, ["--tries", str(args.tries), "--only", *args.only])
    _table(rows, 0, "CPU ms (least of --tries)")
    _table(rows, 1, "peak Python allocations, KiB (tracemalloc)")


if __name__ == "__main__":
    main()
