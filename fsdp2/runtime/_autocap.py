"""Bucket caps from a measurement of the process group: ``set_bucket_cap_mb("auto")``.

Owns: reading ``set_bucket_cap_mb``'s arguments (a number of MiB, ``None`` or ``"auto"``), timing the
all-gather and reduce-scatter that the groups issue on their process group at two sizes, the fit
``seconds = latency + bytes * seconds_per_byte``, the agreement of all ranks of the mesh on it (the
slowest rank's latency and seconds per byte, by an all-reduce MAX), the cap the fit implies
(``CAP_LATENCIES`` latencies' worth of bytes, clamped to [``MIN_CAP``, ``MAX_CAP``]), and
``BucketCaps``, what ``set_bucket_cap_mb`` returns. Does not own: what a cap does (``Schedule``,
``_bucket.py``), the root and between-steps checks (``FSDPModule.set_bucket_cap_mb``).

[Note: Automatic caps]
A bucket of ``B`` bytes costs ``L + B * s`` (``L``: the collective's fixed cost, ``s``: seconds per
byte). The cap ``B = k * L / s`` makes the fixed cost ``1 / (1 + k)`` of a full bucket's time: with
``k = CAP_LATENCIES = 4``, a full bucket moves bytes at 80% of the link's rate, and a larger bucket
would gain at most the remaining 20% while holding more memory and delaying the first member's
compute longer. Measured fits (docs/performance.md, "Automatic caps"): gloo between 4 processes on
a shared 2-core VM, ``L`` 1.4-12 ms at 0.04-2.3 GB/s, caps of 1-40 MiB. For NCCL on one node (tens of
microseconds at 100+ GB/s; not measured by this project yet) the same rule gives tens of MiB, the
range of DDP's 25 MiB default. The lower clamp (1 MiB) keeps a noisy fit from undoing bucketing
where a collective is latency-bound; the upper one (256 MiB) bounds the memory of one bucket when
the per-byte term is lost in noise.
Every rank computes the cap from the same agreed numbers, so every rank buckets alike: caps that
differed between ranks would pair collectives of different buckets and hang.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import EllipsisType
from typing import Any, Literal

import torch
import torch.distributed as dist

from ..group import FSDPParamGroup
from ._bucket import MIB, cap_bytes

__all__ = [
    "AUTO",
    "BucketCaps",
    "CapMB",
    "CapMBOrUnset",
    "CollectiveFit",
    "choose_caps",
    "fit_collective",
    "measure_fit",
    "read_caps",
]

AUTO = "auto"
CAP_LATENCIES = 4.0  # k: a full bucket spends 1 / (1 + k) of its time on the fixed cost
MIN_CAP = 1 * MIB
MAX_CAP = 256 * MIB
SIZES = (4 * 1024, 4 * MIB)  # full-buffer bytes timed: latency-bound, bandwidth-bound
REPEATS = 5  # timed calls per size (after one untimed call that lines the ranks up)
_MIN_SECONDS_PER_BYTE = 1e-13  # 10 TB/s: a fit below it is noise (the cap goes to MAX_CAP)

CapMB = float | Literal["auto"] | None  # a set_bucket_cap_mb argument
CapMBOrUnset = CapMB | EllipsisType  # ``...``: not given
CapRequest = int | None | Literal["auto"]  # an argument read: bytes, None or "auto"
_log = logging.getLogger("fsdp2")


@dataclass(frozen=True)
class CollectiveFit:
    """A measured collective: ``seconds(nbytes) = latency_s + nbytes * seconds_per_byte``.

    ``nbytes`` counts the full buffer (the all-gather's output, the reduce-scatter's input), like the
    caps. The values are the maximum over the ranks of the mesh (every rank holds the same fit).
    """

    latency_s: float
    seconds_per_byte: float

    @property
    def bytes_per_second(self) -> float:
        return 1.0 / max(self.seconds_per_byte, _MIN_SECONDS_PER_BYTE)

    def seconds(self, nbytes: int) -> float:
        """The fitted time of one collective over a ``nbytes`` buffer."""
        return self.latency_s + nbytes * self.seconds_per_byte

    def cap(self) -> int:
        """Bytes whose transfer takes ``CAP_LATENCIES`` latencies, clamped (see [Note: Automatic caps])."""
        ideal = CAP_LATENCIES * self.latency_s / max(self.seconds_per_byte, _MIN_SECONDS_PER_BYTE)
        return round(min(max(ideal, MIN_CAP), MAX_CAP))


@dataclass(frozen=True)
class BucketCaps:
    """The caps ``set_bucket_cap_mb`` set, in bytes (``None``: one collective per group).

    ``all_gather_fit`` / ``reduce_scatter_fit``: the measurement an ``"auto"`` cap came from (``None``
    for a cap given as a number or ``None``, or when no group has a shard group of more than one rank).
    """

    all_gather: int | None
    reduce_scatter: int | None
    all_gather_fit: CollectiveFit | None = None
    reduce_scatter_fit: CollectiveFit | None = None

    @property
    def all_gather_mb(self) -> float | None:
        return None if self.all_gather is None else self.all_gather / MIB

    @property
    def reduce_scatter_mb(self) -> float | None:
        return None if self.reduce_scatter is None else self.reduce_scatter / MIB


def read_caps(all_gather: object, reduce_scatter: object) -> tuple[CapRequest, CapRequest]:
    """Validate ``set_bucket_cap_mb``'s arguments: bytes, ``None`` or ``AUTO`` for each.

    ``reduce_scatter`` not given (``...``) follows an ``"auto"`` all-gather cap and is ``None`` otherwise.
    """
    if isinstance(reduce_scatter, EllipsisType):
        reduce_scatter = AUTO if all_gather == AUTO else None
    return _read_one(all_gather, "all_gather"), _read_one(reduce_scatter, "reduce_scatter")


def _read_one(value: object, name: str) -> CapRequest:
    if isinstance(value, str):
        if value == AUTO:
            return "auto"
        raise ValueError(
            f"set_bucket_cap_mb: {name} must be a number of MiB, None or 'auto' (measure the process "
            f"group and choose the cap), got the string {value!r}. Pass a number such as 25, or 'auto'."
        )
    return cap_bytes(value, name)


def choose_caps(requests: tuple[CapRequest, CapRequest], groups: Iterable[FSDPParamGroup]) -> BucketCaps:
    """The caps for ``requests``, measuring the groups' process groups for each ``"auto"`` one.

    Collective for ``"auto"``: every rank of the groups' meshes must call it at the same point.
    """
    all_gather, reduce_scatter = requests
    if AUTO not in (all_gather, reduce_scatter):
        return BucketCaps(_number(all_gather), _number(reduce_scatter))
    gather_fits: list[CollectiveFit] = []
    scatter_fits: list[CollectiveFit] = []
    for group in _targets(groups):
        if all_gather == AUTO:
            gather_fits.append(measure_fit(group, "all_gather"))
        if reduce_scatter == AUTO:
            scatter_fits.append(measure_fit(group, "reduce_scatter"))
    ag_cap, ag_fit = _pick(all_gather, gather_fits)
    rs_cap, rs_fit = _pick(reduce_scatter, scatter_fits)
    caps = BucketCaps(ag_cap, rs_cap, ag_fit, rs_fit)
    _log.info("fsdp2: set_bucket_cap_mb('auto') chose %s", caps)
    return caps


def _number(request: CapRequest) -> int | None:
    assert request != AUTO
    return request if isinstance(request, int) else None


def _pick(request: CapRequest, fits: list[CollectiveFit]) -> tuple[int | None, CollectiveFit | None]:
    """A number stays; ``"auto"`` takes the largest cap among the measured process groups."""
    if request != AUTO:
        return _number(request), None
    if not fits:
        return None, None  # no shard group of several ranks: nothing would share a collective
    best = max(fits, key=lambda fit: fit.cap())
    return best.cap(), best


def _targets(groups: Iterable[FSDPParamGroup]) -> list[FSDPParamGroup]:
    """One group per distinct (shard group, reduce-scatter group), in module order.

    A group with the default collectives stands for its process group where one exists: it is the kind
    that buckets. Single-rank shard groups issue no collective and are skipped.
    """
    chosen: dict[tuple[int, int], FSDPParamGroup] = {}
    for group in groups:
        info = group.mesh_info
        if info.shard_size < 2:
            continue
        key = (id(info.shard_group), id(group.comms.reduce_scatter_group))
        held = chosen.get(key)
        if held is None or (held.comms.custom and not group.comms.custom):
            chosen[key] = group
    return list(chosen.values())


def measure_fit(
    group: FSDPParamGroup,
    kind: Literal["all_gather", "reduce_scatter"],
    sizes: Sequence[int] = SIZES,
    repeats: int = REPEATS,
) -> CollectiveFit:
    """Time ``group``'s collective of ``kind`` at two sizes; the fit agreed by every rank of its mesh.

    The collective is the one the group issues (its ``comms``, on its process group), so a custom or
    slower implementation is what gets measured.
    """
    info = group.mesh_info
    comm = group.comms.all_gather if kind == "all_gather" else group.comms.reduce_scatter
    process_group = info.shard_group
    if kind == "reduce_scatter" and group.comms.reduce_scatter_group is not None:
        process_group = group.comms.reduce_scatter_group
    agree_on = [info.shard_group]
    if info.replicate_group is not None and info.replicate_size > 1:
        agree_on.append(info.replicate_group)
    return fit_collective(kind, comm, process_group, info.shard_size, group.device, agree_on, sizes, repeats)


def fit_collective(
    kind: Literal["all_gather", "reduce_scatter"],
    comm: Any,
    process_group: dist.ProcessGroup,
    world: int,
    device: torch.device,
    agree_on: Sequence[dist.ProcessGroup],
    sizes: Sequence[int] = SIZES,
    repeats: int = REPEATS,
) -> CollectiveFit:
    """Time ``comm`` (an fsdp2 all-gather or reduce-scatter) at two sizes on ``process_group``.

    The line through the two medians, with the slowest rank's latency and seconds per byte (an
    all-reduce MAX over each group of ``agree_on``), so every rank holds the same fit.
    """
    small, large = sizes
    with torch.no_grad():
        t_small = _median_seconds(kind, comm, process_group, world, device, small, repeats)
        t_large = _median_seconds(kind, comm, process_group, world, device, large, repeats)
    n_small, n_large = (_elements(n, world) * 4 for n in sizes)
    per_byte = max((t_large - t_small) / (n_large - n_small), 0.0)
    latency = max(t_small - n_small * per_byte, 0.0)
    agreed = torch.tensor([latency, per_byte], dtype=torch.float64, device=device)
    for agree_group in agree_on:
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=agree_group)
    latency, per_byte = agreed.tolist()
    return CollectiveFit(latency, per_byte)


def _elements(nbytes: int, world: int) -> int:
    """fp32 elements of a full buffer of about ``nbytes``, a multiple of ``world``."""
    return max(nbytes // (4 * world), 1) * world


def _median_seconds(
    kind: str,
    comm: Any,
    group: dist.ProcessGroup,
    world: int,
    device: torch.device,
    nbytes: int,
    repeats: int,
) -> float:
    numel = _elements(nbytes, world)
    full = comm.allocate((numel,), dtype=torch.float32, device=device)
    part = comm.allocate((numel // world,), dtype=torch.float32, device=device)
    full.zero_()
    part.zero_()
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        if kind == "all_gather":
            work = comm(full, part, group, False)
        else:
            work = comm(part, full, group, dist.ReduceOp.SUM, False)
        if work is not None:
            work.wait()
        if device.type != "cpu":
            torch.accelerator.synchronize(device)
        if i:  # the first call lines the ranks up
            times.append(time.perf_counter() - start)
    return statistics.median(times)
