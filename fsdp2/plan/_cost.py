"""The planner's step-time model: what a wrapping costs, from measurements of this job.

Owns: ``GroupBytes`` (what one planned group moves), ``Setting`` (one wrapping: groups, resharding,
bucket cap, frozen residency, offload), ``CostModel`` (its measured constants and ``predict``), and
``measure_network`` (the all-gather and reduce-scatter fits of a process group, agreed by its ranks).
Does not own: the search (``_plan``), the memory estimate (``_memory``), what the settings do.

[Note: The step-time model]
A step costs ``compute_s`` (the model's forward, backward and optimizer step: the same for every
wrapping) plus, per group, ``per_group_s`` (its hooks, copy-in and copy-out: measured, not assumed)
plus its collectives: an all-gather in forward, another in backward when it reshards after forward
(only trainable bytes once frozen parameters stay gathered), and a reduce-scatter of its trainable
bytes. A collective of ``B`` bytes costs ``latency + B * seconds_per_byte`` (``measure_network``);
with a bucket cap, consecutive groups' collectives are packed into buckets of at most the cap, as
the schedule packs them, so fewer latencies are paid for the same bytes. CPU offload adds each
offloaded group's bytes over the host link both ways. Where the device runs collectives on streams
of their own (CUDA), a collective hides behind the compute of the group next to it: only what exceeds
that compute (the collective's share of ``compute_s`` by parameter bytes, the model's compute being
taken as proportional to them) is exposed, and the first all-gather is exposed in full; on the CPU
every collective is paid in full. ``compute_s`` and ``per_group_s`` come from timing two real
wrappings of the job's model on its ranks (``calibrate``): their difference in groups separates the
two.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..comm import DefaultAllGather, DefaultReduceScatter
from ..runtime import CollectiveFit, fit_collective

__all__ = ["CostModel", "GroupBytes", "Setting", "measure_network"]

# Before a job there is no process group to time: these stand in, and ``Plan.explain`` says so.
NOMINAL_FITS = {
    "cpu": CollectiveFit(1e-3, 1.0 / 1e9),  # gloo over loopback on a shared host
    "cuda": CollectiveFit(30e-6, 1.0 / 100e9),  # NCCL within one node
}
HOST_LINK_BYTES_PER_S = 20e9  # pinned host <-> GPU copies (PCIe 4 x16, about); offload only


@dataclasses.dataclass(frozen=True)
class GroupBytes:
    """One planned group's parameter bytes (unsharded, as gathered) and how many are trainable."""

    name: str
    total: int
    trainable: int

    @property
    def frozen(self) -> int:
        return self.total - self.trainable


@dataclasses.dataclass(frozen=True)
class Setting:
    """One wrapping: ``groups[i]`` module names per ``fully_shard`` call, each with its settings.

    ``bucket_cap_mb``: the cap given to ``set_bucket_cap_mb`` for both collectives (``None``: none);
    ``keep_frozen``: ``keep_frozen_gathered`` on the root; ``offload[i]``: CPU offload for group i.
    """

    groups: tuple[tuple[str, ...], ...]
    reshard_after_forward: tuple[bool, ...]
    bucket_cap_mb: float | None = None
    keep_frozen: bool = False
    offload: tuple[bool, ...] = ()

    def describe(self) -> str:
        if not self.groups:
            shape = "root only"
        else:
            size = max(len(g) for g in self.groups)
            shape = f"{len(self.groups)} group{'s' if len(self.groups) > 1 else ''} of up to {size}"
        parts = [shape, f"{sum(self.reshard_after_forward)} resharding after forward"]
        if self.bucket_cap_mb is not None:
            parts.append(f"{self.bucket_cap_mb:g} MiB buckets")
        if self.keep_frozen:
            parts.append("frozen parameters kept gathered")
        if any(self.offload):
            parts.append(f"{sum(self.offload)} offloaded to CPU")
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Measured constants of one job and the prediction of a step (see [Note: The step-time model])."""

    all_gather: CollectiveFit
    reduce_scatter: CollectiveFit
    compute_s: float
    per_group_s: float
    overlap: bool  # collectives on streams of their own (CUDA)
    measured_network: bool  # False: the nominal fits (no process group to time)

    def predict(self, setting: Setting, sizes: Sequence[GroupBytes], root: GroupBytes) -> float:
        """Seconds of one steady step under ``setting`` (``sizes[i]`` for ``setting.groups[i]``)."""
        order = [*sizes, root]  # forward order: the blocks, the root's own parameters last
        rafs = [*setting.reshard_after_forward, False]
        offload = [*(setting.offload or (False,) * len(sizes)), False]
        keep = setting.keep_frozen
        gathered = [g.trainable if keep else g.total for g in order]
        cap = None if setting.bucket_cap_mb is None else setting.bucket_cap_mb * 2**20
        forward = _packed(gathered, cap)
        again = [b for b, raf in zip(gathered, rafs, strict=True) if raf]
        backward = _packed(again, cap)
        reduced = _packed([g.trainable for g in order], cap)
        if self.overlap:  # a collective hides behind compute of its bytes' share (its neighbour's)
            per_byte = self.compute_s / max(sum(g.total for g in order), 1)
            first = forward[:1]  # nothing runs before the first all-gather: paid in full
            gathers = [*forward[1:], *backward]
            comm = sum(self.all_gather.seconds(b) for b in first)
            comm += sum(max(self.all_gather.seconds(b) - b * per_byte, 0.0) for b in gathers)
            comm += sum(max(self.reduce_scatter.seconds(b) - b * per_byte, 0.0) for b in reduced)
        else:
            comm = sum(self.all_gather.seconds(b) for b in [*forward, *backward])
            comm += sum(self.reduce_scatter.seconds(b) for b in reduced)
        host = sum(2 * g.total for g, off in zip(order, offload, strict=True) if off) / HOST_LINK_BYTES_PER_S
        return self.compute_s + self.per_group_s * len(order) + comm + host


def _packed(sizes: Sequence[int], cap: float | None) -> list[int]:
    """Collective sizes after packing consecutive ones into buckets of at most ``cap`` bytes."""
    sizes = [s for s in sizes if s > 0]
    if cap is None:
        return sizes
    out: list[int] = []
    for size in sizes:
        if out and out[-1] + size <= cap:
            out[-1] += size
        else:
            out.append(size)
    return out


def calibrate(
    timed: Sequence[tuple[float, Setting]],
    shapes: Sequence[tuple[Sequence[GroupBytes], GroupBytes]],
    model: CostModel,
) -> CostModel:
    """``model`` with ``compute_s`` and ``per_group_s`` fitted to measured steps of two settings.

    ``timed[i]``: the measured seconds of a steady step under a setting, ``shapes[i]`` its groups'
    bytes and the root's. The collectives are predicted from the network fits; what remains is
    ``compute_s + per_group_s * groups``, two measurements with different group counts give both (a
    negative per-group cost, from noise, is taken as zero).
    """
    zero = dataclasses.replace(model, compute_s=0.0, per_group_s=0.0)
    rest = [
        (seconds - zero.predict(setting, groups, root), len(setting.groups) + 1)
        for (seconds, setting), (groups, root) in zip(timed, shapes, strict=True)
    ]
    (r1, n1), (r2, n2) = rest[0], rest[-1]
    per_group = (r1 - r2) / (n1 - n2) if n1 != n2 else 0.0
    per_group = max(per_group, 0.0)
    compute = max(statistics.fmean(r - per_group * n for r, n in rest), 0.0)
    return dataclasses.replace(model, compute_s=compute, per_group_s=per_group)


def measure_network(
    group: dist.ProcessGroup, device: torch.device, sizes: Sequence[int] = (64 * 1024, 8 * 2**20)
) -> tuple[CollectiveFit, CollectiveFit]:
    """The all-gather and reduce-scatter fits of ``group`` (full-buffer bytes), agreed by its ranks.

    fsdp2's default collectives, timed as ``set_bucket_cap_mb("auto")`` times a group's own.
    """
    world = dist.get_world_size(group)
    return (
        fit_collective("all_gather", DefaultAllGather(), group, world, device, [group], sizes),
        fit_collective("reduce_scatter", DefaultReduceScatter(), group, world, device, [group], sizes),
    )
