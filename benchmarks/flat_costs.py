"""Per-rank host costs at thousands of ranks, under torch's fake process group (issue 53, in part).

One process acts as rank 1 of ``N`` ranks (``dist.init_process_group("fake", ...)``: no process talks
to another, every collective returns at once). Measured per ``N`` (a fresh process each), the minimum
of 3 runs:

- ``ring``: what ``Snapshots()`` computes from every rank's node key (8 ranks a node): the buddy ring,
  this rank's buddy, the ranks it keeps copies for and whether it leads its node. ``Snapshots`` itself
  builds a gloo group of its own and gathers objects, which the fake group cannot carry, so its ring
  is measured directly.
- ``per snapshot``: the ring work one ``save`` does besides the bytes: the exchange of snapshot sizes
  (an all-gather before, a message to and from the buddies after), the ranks it receives from, its
  buddy and whether it leads.
- ``check_replicas``: ``fsdp2.check_replicas`` on 16 blocks of two ``Linear(512, 512)``, HSDP on a
  (N/4 replicas, 4 shards) mesh. The fake group leaves received buffers as they were allocated, so
  every all-gather here is patched to fill them with copies of this rank's tensor (replicas that agree).
- ``plain step`` / ``deterministic step``: one forward and backward of 4 blocks of two
  ``Linear(128, 128)``, HSDP on a (N/4 replicas, 4 shards) mesh, without and with
  ``set_deterministic_reduction()`` (the same reduction ``wire_dtype`` uses); ``... fsdp``: the same
  on a 1-D mesh of all N ranks. The all-gather, reduce-scatter and all-to-all are emulated by one
  tensor operation each (copies of the input, the sum of the input's N chunks, a copy): the fake
  backend's own all-gather and reduce-scatter copy chunk by chunk, host work growing with N that one
  NCCL call does not have (6.6 and 2.4 ms per call at N = 4,096). The HSDP all-reduce stays the fake
  backend's no-op. One intra-op thread; the minimum of 10 steps.
- ``whole-tensor step``: one ``torch.optim.Muon`` step of three ``Linear(64, 64, bias=False)`` blocks
  (FSDP over N ranks; rank 1 owns one matrix at every N), the fourth step of one run. Received bytes
  are zeros (the fake group leaves them unwritten: garbage floats, whose denormals slow Newton-Schulz
  by 10x and more).
- ``save_pretrained``: ``fsdp2.save_pretrained`` of the check_replicas model, FSDP over N ranks, into
  a temporary directory (rank 1 writes its files: fewer as N grows).
- ``WeightSync``: the first ``WeightSync(model).updates()`` of that model, iterated to the end (every
  parameter gathered, in bf16, in 64 MB buckets).
- ``full_tensor``: the target for the two above, ``full_tensor()`` of every parameter of that model.
- ``restore``: ``Snapshots.restore``'s part that grows with the world, ``reshard_newest`` (the node's
  listing, the choice, the read, the exchange), restoring a snapshot of N old ranks (three
  ``Linear(64, 64)``, FSDP; 8 ranks a node) from rank 1's node: its own file and its copy of rank
  ``1 - 8``'s. The fake group's collectives return at once, so the rest of the world is emulated: the
  readers' MIN all-reduce gives every old rank its own new rank (each lists its own file), an object
  all-gather of the listings (the code before) unpickles every rank's listing (its own file and its
  copy), pickled beforehand, and the exchange, with this rank alone, hands back what it sent.

Times are this process's CPU time (``time.process_time``, one intra-op thread), the least of
``--tries`` runs: the development VM's cores are shared, and CPU time leaves out the waits for them.

Run:  python benchmarks/flat_costs.py [--worlds 8 512 4096 16384] [--tries 5] [--only steps|restore]
Prints a table (milliseconds).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from _per_world import rows_per_world

REPO = Path(__file__).resolve().parents[1]
RANK = 1
PER_NODE = 8


TRIES = 5


def _best(fn: Callable[[], Any], tries: int | None = None) -> float:
    times = []
    for _ in range(tries or TRIES):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times) * 1e3


def _patch_gathers() -> None:
    """Received buffers filled with this rank's tensor: the replicas agree (fake groups send nothing)."""
    import torch.distributed as dist

    plain, into = dist.all_gather, dist.all_gather_into_tensor

    def all_gather(outputs: list[Any], tensor: Any, *args: Any, **kwargs: Any) -> Any:
        work = plain(outputs, tensor, *args, **kwargs)
        for out in outputs:
            out.copy_(tensor)
        return work

    def all_gather_into_tensor(output: Any, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        work = into(output, tensor, *args, **kwargs)
        output.view(-1, *tensor.shape).copy_(
            tensor.unsqueeze(0).expand(output.numel() // tensor.numel(), *tensor.shape)
        )
        return work

    plain_a2a = dist.all_to_all_single

    def all_to_all_single(output: Any, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        work = plain_a2a(output, tensor, *args, **kwargs)
        output.zero_()  # received values: zeros, not the allocator's leftovers
        return work

    dist.all_gather, dist.all_gather_into_tensor = all_gather, all_gather_into_tensor  # type: ignore[assignment]
    dist.all_gather_single = all_gather_into_tensor  # type: ignore[attr-defined]
    dist.all_to_all_single = all_to_all_single  # type: ignore[assignment]


def _emulate_collectives() -> None:
    """The step's collectives as one tensor operation each (the fake backend's all-gather and
    reduce-scatter copy chunk by chunk: host work growing with N that one NCCL call does not have)."""
    import torch
    import torch.distributed as dist

    def all_gather_single(output: Any, input_tensor: Any, group: Any = None, async_op: bool = False) -> None:
        ranks = dist.get_world_size(group)
        output.view(ranks, -1).copy_(input_tensor.reshape(1, -1).clone().expand(ranks, -1))

    def reduce_scatter_single(
        output: Any, input_tensor: Any, op: Any = None, group: Any = None, async_op: bool = False
    ) -> None:
        torch.sum(input_tensor.view(dist.get_world_size(group), -1), dim=0, out=output.view(-1))

    def all_to_all_single(output: Any, input_tensor: Any, *args: Any, **kwargs: Any) -> None:
        output.copy_(input_tensor)

    dist.all_gather_single = all_gather_single  # type: ignore[attr-defined]
    dist.reduce_scatter_single = reduce_scatter_single  # type: ignore[attr-defined]
    dist.all_to_all_single = all_to_all_single  # type: ignore[assignment]


@contextlib.contextmanager
def _patched(module: Any, **attributes: Any) -> Iterator[None]:
    """``module``'s attributes replaced for the block's length."""
    saved = {name: getattr(module, name) for name in attributes}
    for name, value in attributes.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def _restore(world: int) -> float:
    """``reshard_newest`` as rank 1 of a job restoring a snapshot of ``world`` ranks (see the module)."""
    import inspect
    import pickle

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    import fsdp2
    from fsdp2.resilience._format import capture, encode_header, host_bytes
    from fsdp2.resilience._restore import reshard_newest
    from fsdp2.resilience._store import NodeStore

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(3)])
    for layer in model:
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
    tree = {"model": get_model_state_dict(model), "optim": {}, "state": {}}
    store = NodeStore(Path(tempfile.mkdtemp()), "train", "j")
    for rank in ((RANK - PER_NODE) % world, RANK):
        snapshot = capture(tree, 5, world, rank)
        store.write(5, rank, [encode_header(snapshot), host_bytes(snapshot.payload)])
    mine = store.listing()[0][-1]
    blobs = [  # every rank's listing, as the object all-gather of the code before brings it
        pickle.dumps(([_with_rank(mine, r), _with_rank(mine, (r - PER_NODE) % world)], []))
        for r in range(world)
    ]
    plain = pickle.dumps([])
    reduce = dist.all_reduce

    def all_reduce(tensor: Any, op: Any = dist.ReduceOp.SUM, group: Any = None, **kwargs: Any) -> None:
        reduce(tensor, op=op, group=group)
        if op == dist.ReduceOp.MIN and tensor.numel() == world:  # the readers: each its own number
            torch.minimum(tensor, torch.arange(world), out=tensor)

    def all_gather_object(out: list[Any], obj: Any, group: Any = None) -> None:
        pickle.dumps(obj)
        for r in range(world):
            out[r] = pickle.loads(blobs[r] if isinstance(obj, tuple) else plain)

    def broadcast_object_list(objects: list[Any], *args: Any, **kwargs: Any) -> None:
        objects[0] = snapshot.leaves

    def all_to_all_single(output: Any, tensor: Any, *args: Any, **kwargs: Any) -> None:
        output.copy_(tensor)  # this rank exchanges with itself alone

    per_node = (PER_NODE,) if "per_node" in inspect.signature(reshard_newest).parameters else ()
    patches = {
        "all_reduce": all_reduce,
        "all_gather_object": all_gather_object,
        "broadcast_object_list": broadcast_object_list,
        "all_to_all_single": all_to_all_single,
    }
    with _patched(dist, **patches):
        run = lambda: reshard_newest(store, *store.listing(), dist.group.WORLD, model, *per_node)  # noqa: E731
        assert run().choice.step == 5
        return _best(run)


def _with_rank(listed: Any, rank: int) -> Any:
    """``listed`` (a ``Listed``) of another old rank."""
    import dataclasses

    return dataclasses.replace(listed, rank=rank)


def _steps(world: int) -> dict[str, float]:
    """One forward and backward, plain and deterministic, HSDP (N/4, 4) and FSDP over all N ranks."""
    import copy

    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2

    torch.set_flush_denormal(True)
    torch.set_num_threads(1)  # one intra-op thread: less noise from whatever else shares the cores
    _emulate_collectives()
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128)) for _ in range(4)])
    x = torch.randn(8, 128)
    meshes = {
        "": init_device_mesh("cpu", (world // 4, 4), mesh_dim_names=("replicate", "shard")),
        " fsdp": init_device_mesh("cpu", (world,)),
    }
    times = {}
    for suffix, mesh in meshes.items():
        for name, deterministic in (("plain step", False), ("deterministic step", True)):
            model = copy.deepcopy(base)
            for block in model:
                fsdp2.fully_shard(block, mesh=mesh)
            fsdp2.fully_shard(model, mesh=mesh)
            if deterministic:
                model.set_deterministic_reduction()

            def step(model: nn.Module = model) -> None:
                model(x).sum().backward()
                model.zero_grad()

            step()  # warm
            times[name + suffix] = _best(step, tries=10)
    return times


def _one(world: int, only: str | None = None) -> dict[str, float]:
    sys.path.insert(0, str(REPO))
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fsdp2
    from fsdp2.resilience._ring import Ring, key_hash

    torch.set_num_threads(1)  # CPU time = this rank's host time
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=world)
    if only == "steps":
        return _steps(world)
    if only == "restore":
        return {"restore": _restore(world)}
    restored = _restore(world)  # before the gathers are patched for the rest
    _patch_gathers()
    keys = [f"host{r // PER_NODE}:/dev/shm/x" for r in range(world)]
    # What the all-gather of Snapshots() brings: every rank's key hash, one int64 each (the gather
    # itself is one tensor; the fake group cannot carry it, so its result is given here).
    hashes = torch.tensor([key_hash(key) for key in keys], dtype=torch.int64)

    def ring() -> None:
        key_hash(keys[RANK])  # this rank's own key, the only one it hashes
        _per_rank(Ring.of_hashes(hashes))

    def _per_rank(built: Any) -> None:
        buddy = built.buddy_of(RANK) if hasattr(built, "buddy_of") else built.buddy[RANK]
        built.kept_for(RANK)
        built.is_leader(RANK)
        del buddy

    built = Ring.of(keys)

    def per_snapshot() -> None:
        sizes = torch.tensor([100, 1000], dtype=torch.int64)
        if hasattr(built, "buddy_of"):  # sizes to and from the buddies only
            for _ in built.kept_for(RANK):
                torch.empty_like(sizes)
        else:
            every = [torch.empty_like(sizes) for _ in range(world)]
            dist.all_gather(every, sizes)
        _per_rank(built)

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512)) for _ in range(16)])
    mesh = init_device_mesh("cpu", (world // 4, 4), mesh_dim_names=("replicate", "shard"))
    for block in model:
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    fsdp2.check_replicas(model)  # warm
    row = {
        "ring": _best(ring),
        "per snapshot": _best(per_snapshot),
        "check_replicas": _best(lambda: fsdp2.check_replicas(model)),
    }
    row["restore"] = restored
    row["whole-tensor step"] = _muon_step()
    torch.manual_seed(0)
    flat = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512)) for _ in range(16)])
    for block in flat:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(flat)
    with tempfile.TemporaryDirectory() as directory:
        row["save_pretrained"] = _best(lambda: fsdp2.save_pretrained(flat, directory))
    row["WeightSync"] = _best(lambda: list(fsdp2.WeightSync(flat).updates()))
    row["full_tensor"] = _best(lambda: [p.full_tensor() for p in flat.parameters()])
    row.update(_steps(world))  # last: its emulated collectives replace the patches above
    return row


def _muon_step() -> float:
    """One Muon step of three Linear(64, 64) blocks (rank 1 owns one matrix), the fourth of a run."""
    import torch
    from torch import nn

    import fsdp2

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(3)])
    for layer in model:
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
    optimizer = torch.optim.Muon(model.parameters(), lr=0.01)
    fsdp2.whole_tensor_step(optimizer)
    data = torch.randn(2, 64)
    times = []
    for step in range(3 + TRIES):
        model(data).sum().backward()
        start = time.process_time()
        optimizer.step()
        if step >= 3:
            times.append(time.process_time() - start)
        optimizer.zero_grad()
    return min(times) * 1e3


def main() -> None:
    global TRIES
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 512, 4096])
    parser.add_argument(
        "--only", choices=["steps", "restore"], help="only the plain and deterministic steps, or the restore"
    )
    parser.add_argument("--tries", type=int, default=TRIES)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        TRIES = args.tries
        print(json.dumps(_one(args.one, args.only)))
        return
    only = ["--only", args.only] if args.only else []
    rows = rows_per_world(__file__, args.worlds, ["--tries", str(args.tries), *only])
    names = list(next(iter(rows.values())))
    print(f"{'ranks':>7} | " + " | ".join(f"{n:>17}" for n in names))
    for world, row in rows.items():
        print(f"{world:>7} | " + " | ".join(f"{row[n]:>17.3f}" for n in names))


if __name__ == "__main__":
    main()
