"""``fsdp2.WeightSync``: a plain "inference" copy kept equal to the trainer's weights, in bf16.

The reference is the trainer itself: after every sync the consumer's parameters equal the trainer's
full parameters cast to bf16, bit for bit, whatever mix of dense and sparse updates arrived. The
trainer is a plain fp32 model sharded with fsdp2 and trained with a small learning rate, so most bf16
values stay put between steps and the changed-only updates are sparse.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import fsdp2
from tests._harness import run_threaded


def _model() -> nn.Module:
    torch.manual_seed(0)  # built once, in the main thread
    model = nn.Sequential(nn.Embedding(40, 16), nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 40))
    model[1].weight.requires_grad_(False)  # a frozen weight: sent once
    return model


def _load(consumer: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """What an inference engine's ``load_weights`` does with one pair (dense, or sparse values)."""
    target = consumer.get_parameter(name)
    with torch.no_grad():
        if tensor.is_sparse:
            target[tuple(tensor.indices())] = tensor.values()  # coalesced
        else:
            target.copy_(tensor)


def _dim1(param: nn.Parameter) -> Shard | None:
    return Shard(1) if param.dim() == 2 else None  # columns: a layout gathered alone


def _sync_steps(
    base: nn.Module, hsdp: bool, only_rank0: bool, bucket_mb: float = 64, columns: bool = False
) -> list[tuple[list[str], list[bool], int]]:
    world = dist.get_world_size()
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    model = copy.deepcopy(base)
    for layer in (model[0], model[1], model[3]):
        fsdp2.fully_shard(
            layer, mesh=mesh, shard_placement_fn=_dim1 if columns and layer is model[3] else None
        )
    fsdp2.fully_shard(model, mesh=mesh)
    consumer = copy.deepcopy(base).bfloat16()
    with torch.no_grad():
        for param in consumer.parameters():
            param.zero_()  # it learns everything from the sync
    optim = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sync = fsdp2.WeightSync(model, torch.bfloat16, rank=0 if only_rank0 else None, bucket_mb=bucket_mb)
    receives = not only_rank0 or dist.get_rank() == 0
    names = [name for name, _ in model.named_parameters()]
    calls = []
    for step in range(3):
        if step:
            tokens = torch.tensor([[step, 2 * step, 3]]) + dist.get_rank()  # a few embedding rows
            model(tokens).sum().backward()
            optim.step()
            optim.zero_grad()
        received = list(sync.updates())
        for name, tensor in received:
            _load(consumer, name, tensor)
        calls.append(([n for n, _ in received], [t.is_sparse for _, t in received], sync.bytes_sent))
        fulls = [param.full_tensor().bfloat16() for param in model.parameters()]  # every rank gathers
        if receives:
            for name, plain, full in zip(names, consumer.parameters(), fulls, strict=True):
                assert torch.equal(plain, full), f"step {step}: {name}"
        else:
            assert received == []
            assert sync.bytes_sent == 0
    return calls


@pytest.mark.parametrize(("world", "hsdp"), [(2, False), (4, True)], ids=["fsdp", "hsdp"])
def test_the_consumer_equals_the_trainer_after_every_sync(world: int, hsdp: bool) -> None:
    base = _model()
    names = [name for name, _ in base.named_parameters()]
    dense_bytes = sum(p.numel() * 2 for p in base.parameters())
    for calls in run_threaded(world, _sync_steps, base, hsdp, False):
        first, second, _ = calls
        assert first[0] == names  # the plain model's names, every parameter
        assert not any(first[1])
        assert first[2] == dense_bytes
        assert "1.weight" not in second[0]  # frozen: sent once
        assert "0.weight" in second[0]  # embedding rows changed: sparse
        assert second[1][second[0].index("0.weight")]
        sizes = dict((name, p.numel() * 2) for name, p in base.named_parameters())
        assert second[2] < sum(sizes[name] for name in second[0])  # the sparse ones cost less


def test_one_receiving_rank_and_the_others_take_part() -> None:
    run_threaded(2, _sync_steps, _model(), False, True)


# 2,000 bytes: the bf16 parameters (1,280 | 768 48 | 1,920 80 bytes) make three buckets
_THREE_BUCKETS_MB = 2000 / 2**20


def test_a_column_sharded_weight_is_gathered_alone_between_buckets() -> None:
    base = _model()
    one_bucket = run_threaded(2, _sync_steps, base, False, False)
    assert run_threaded(2, _sync_steps, base, False, False, 64, True) == one_bucket


@pytest.mark.parametrize(
    ("world", "hsdp", "only_rank0", "bucket_mb"),
    [(3, False, False, _THREE_BUCKETS_MB), (3, False, True, 0), (4, True, True, _THREE_BUCKETS_MB)],
    ids=["uneven-rows-three-buckets", "uneven-rows-one-rank-per-parameter", "hsdp-one-rank-three-buckets"],
)
def test_bucket_caps_and_uneven_rows_send_the_same(
    world: int, hsdp: bool, only_rank0: bool, bucket_mb: float
) -> None:
    base = _model()  # each run checks the consumer against the trainer after every call
    one_bucket = run_threaded(world, _sync_steps, base, hsdp, only_rank0)
    assert run_threaded(world, _sync_steps, base, hsdp, only_rank0, bucket_mb) == one_bucket  # the same pairs


class _Recorder:
    """Each rank's order of collective issue, completion and pairs yielded, from torch.distributed's
    own functions (patched for the test): ("issue", op), ("done", op), ("pair", name)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: dict[int, list[tuple[str, str]]] = {}
        for op in ("all_gather_single", "all_gather_into_tensor", "all_reduce"):
            if hasattr(dist, op):
                monkeypatch.setattr(dist, op, self._wrap(op, getattr(dist, op)))

    def log(self, kind: str, what: str) -> None:
        if self.events.get(dist.get_rank()) is not None:
            self.events[dist.get_rank()].append((kind, what))

    def _wrap(self, op: str, original: Any) -> Any:
        name = "all_gather" if op.startswith("all_gather") else op
        recorder = self

        class Work:
            def __init__(self, work: Any) -> None:
                self._work = work

            def wait(self, *args: Any) -> Any:
                out = self._work.wait(*args)
                recorder.log("done", name)
                return out

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.log("issue", name)
            work = original(*args, **kwargs)
            if kwargs.get("async_op"):
                return Work(work)
            self.log("done", name)
            return work

        return wrapper


def _recorded_syncs(recorder: _Recorder, base: nn.Module, only_rank0: bool, bucket_mb: float) -> None:
    model = copy.deepcopy(base)
    for layer in (model[0], model[1], model[3]):
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
    optim = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sync = fsdp2.WeightSync(model, rank=0 if only_rank0 else None, bucket_mb=bucket_mb)
    for step in range(2):
        if step:
            model(torch.tensor([[1, 2, 3]]) + dist.get_rank()).sum().backward()
            optim.step()
            optim.zero_grad()
        recorder.events[dist.get_rank()] = []  # from here: the sync's collectives and pairs only
        for name, _ in sync.updates():
            recorder.log("pair", name)
        recorder.log("call", "end")
        recorder.events[dist.get_rank()].append(("stop", ""))
        events = recorder.events.pop(dist.get_rank())
        recorder.events.setdefault(-1 - dist.get_rank(), []).extend(events)


def _calls(events: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    calls, current = [], []
    for event in events:
        if event[0] == "stop":
            calls.append(current)
            current = []
        else:
            current.append(event)
    return calls


@pytest.mark.parametrize("only_rank0", [False, True], ids=["every-rank", "rank-0"])
def test_no_pair_is_out_while_a_collective_is_in_flight(
    monkeypatch: pytest.MonkeyPatch, only_rank0: bool
) -> None:
    recorder = _Recorder(monkeypatch)
    run_threaded(2, _recorded_syncs, recorder, _model(), only_rank0, _THREE_BUCKETS_MB)
    for rank in range(2):
        first, second = _calls(recorder.events[-1 - rank])
        for events in (first, second):
            in_flight = 0
            for kind, _ in events:
                in_flight += {"issue": 1, "done": -1}.get(kind, 0)
                assert in_flight in (0, 1)
                assert kind != "pair" or in_flight == 0, events  # never a pair between issue and done
            ops = Counter(what for kind, what in events if kind == "issue")
            pairs = [what for kind, what in events if kind == "pair"]
            if only_rank0:  # the others yield nothing: every collective before rank 0's first pair
                last_done = max(i for i, (kind, _) in enumerate(events) if kind == "done")
                assert all(kind != "pair" for kind, _ in events[:last_done])
            if only_rank0 and rank == 1:
                assert pairs == []
        assert Counter(what for kind, what in first if kind == "issue") == {"all_gather": 3}  # 5 parameters
        assert [what for kind, what in first if kind == "pair"] in (
            [],
            [n for n, _ in _model().named_parameters()],
        )
        ops = Counter(what for kind, what in second if kind == "issue")
        assert ops["all_reduce"] == 1  # the changed counts, one for the whole model
        assert ops["all_gather"] <= 3


def _count_gathers(recorder: _Recorder, base: nn.Module, bucket_mb: float) -> None:
    model = copy.deepcopy(base)
    for layer in (model[0], model[1], model[3]):
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
    recorder.events[dist.get_rank()] = []
    list(fsdp2.WeightSync(model, bucket_mb=bucket_mb).updates())


@pytest.mark.parametrize(("bucket_mb", "gathers"), [(64, 1), (_THREE_BUCKETS_MB, 3), (0, 5)])
def test_one_all_gather_per_bucket(monkeypatch: pytest.MonkeyPatch, bucket_mb: float, gathers: int) -> None:
    recorder = _Recorder(monkeypatch)
    run_threaded(2, _count_gathers, recorder, _model(), bucket_mb)
    for rank in range(2):
        assert Counter(what for kind, what in recorder.events[rank] if kind == "issue") == {
            "all_gather": gathers
        }


def _shards(base: nn.Module, hsdp: bool) -> list[fsdp2.LocalShard]:
    world = dist.get_world_size()
    names = ("replicate", "shard") if hsdp else ("shard",)
    mesh = init_device_mesh("cpu", (2, world // 2) if hsdp else (world,), mesh_dim_names=names)
    model = copy.deepcopy(base)
    for layer in (model[0], model[1], model[3]):  # the last weight by columns without HSDP
        fsdp2.fully_shard(
            layer, mesh=mesh, shard_placement_fn=_dim1 if layer is model[3] and not hsdp else None
        )
    fsdp2.fully_shard(model, mesh=mesh)
    return list(fsdp2.WeightSync(model, torch.float32).local_shards())


def _receive(shards: list[fsdp2.LocalShard]) -> dict[str, torch.Tensor]:
    """A receiver that builds each full weight from every rank's shards (replicas write twice)."""
    full: dict[str, torch.Tensor] = {}
    for shard in shards:
        target = full.setdefault(
            shard.name, torch.full(shard.global_shape, float("nan"), dtype=shard.tensor.dtype)
        )
        where = tuple(slice(o, o + n) for o, n in zip(shard.offset, shard.tensor.shape, strict=True))
        target[where] = shard.tensor
    return full


@pytest.mark.parametrize(("world", "hsdp"), [(3, False), (4, True)], ids=["fsdp-uneven-and-columns", "hsdp"])
def test_local_shards_rebuild_the_unsharded_weights(world: int, hsdp: bool) -> None:
    base = _model()
    per_rank = run_threaded(world, _shards, base, hsdp)
    full = _receive([shard for shards in per_rank for shard in shards])
    assert list(full) == [name for name, _ in base.named_parameters()]
    for name, param in base.named_parameters():
        assert torch.equal(full[name], param.detach()), name
    embedding = per_rank[2][0]  # 40 rows over 3 ranks: 14, 14, 12; over 2 x 2: rank 2 is replica 1's first
    expected = ((0, 0), 20, (Replicate(), Shard(0))) if hsdp else ((28, 0), 12, (Shard(0),))
    assert (embedding.offset, embedding.tensor.shape[0], embedding.placements) == expected
    if not hsdp:
        columns = per_rank[1][3]  # 24 columns over 3 ranks
        assert (columns.name, columns.offset, tuple(columns.tensor.shape)) == ("3.weight", (0, 8), (40, 8))


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(TypeError, match=r"nn\.Module"):
        fsdp2.WeightSync(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dtype"):
        fsdp2.WeightSync(nn.Linear(2, 2), "bfloat16")  # type: ignore[arg-type]
    for dtype in (torch.int8, torch.bool, torch.float8_e4m3fn, torch.complex64):
        with pytest.raises(ValueError, match=f"cannot send weights as {dtype}"):
            fsdp2.WeightSync(nn.Linear(2, 2), dtype)
    for rank in (1, -1, True, "0"):  # no process group: the one process is rank 0
        with pytest.raises(ValueError, match="rank must be None"):
            fsdp2.WeightSync(nn.Linear(2, 2), rank=rank)  # type: ignore[arg-type]
    for bucket_mb in ("64", True, None):
        with pytest.raises(TypeError, match="bucket_mb must be a number"):
            fsdp2.WeightSync(nn.Linear(2, 2), bucket_mb=bucket_mb)  # type: ignore[arg-type]
    for bucket_mb in (-1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="bucket_mb must be 0"):
            fsdp2.WeightSync(nn.Linear(2, 2), bucket_mb=bucket_mb)
    fsdp2.WeightSync(nn.Linear(2, 2), torch.float16, rank=0)


def _rank_out_of_range() -> None:
    model = fsdp2.fully_shard(nn.Linear(4, 4))
    for rank in (2, 5, -1):
        with pytest.raises(ValueError, match=r"a rank of this job, 0 to 1; got"):
            fsdp2.WeightSync(model, rank=rank)


def test_a_rank_outside_the_job_is_refused() -> None:
    run_threaded(2, _rank_out_of_range)


def _partial_sums() -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = nn.Module()
    model.sums = nn.Parameter(DTensor.from_local(torch.ones(2), mesh, [Partial()]))
    with pytest.raises(ValueError, match=r"cannot place 'sums': its placement .* is not one block per rank"):
        next(fsdp2.WeightSync(model).local_shards())


def test_local_shards_refuse_a_layout_that_is_not_blocks() -> None:
    run_threaded(2, _partial_sums)


def _tiny_sync(base: nn.Module) -> dict[str, torch.Tensor]:
    model = fsdp2.fully_shard(copy.deepcopy(base))
    return dict(fsdp2.WeightSync(model).updates())


def test_a_rank_with_no_rows_packs_nothing() -> None:
    torch.manual_seed(0)
    base = nn.Linear(4, 2)  # 2 rows over 3 ranks: 1, 1, 0
    for received in run_threaded(3, _tiny_sync, base):
        assert list(received) == ["weight", "bias"]
        for name, param in base.named_parameters():
            assert torch.equal(received[name], param.detach().bfloat16()), name
