"""Replicas checked to the bit: ``fsdp2.check_replicas``.

Owns: a fingerprint of each parameter's local tensor (its bytes as 64-bit words: their count, wrapping
sum and position-weighted wrapping sum; 24 bytes), one all-gather of a rank's fingerprints per
replicated mesh dim into one tensor, the comparison as one tensor operation (a parameter's replicas
become Python values only when they differ), and the error every rank raises (through
``comm.raise_everywhere``, a flag all-reduced first). A flipped bit changes the wrapping sum, so it is
always found; other differences are found unless two different tensors agree on both sums, a 2^-64
chance. Does not own:
the parameters or their meshes (read from the DTensors).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..comm import raise_everywhere

__all__ = ["check_replicas"]


def check_replicas(model: nn.Module) -> None:
    """Compare every parameter's local shard across its replicas, bit for bit; raise if any differ.

    Replicas are the ranks that hold the same shard: the replicate dim of an HSDP mesh, and any mesh
    dim on which a parameter is ``Replicate()`` (a tensor-parallel bias). Every rank must call it; it
    sends 24 bytes per parameter and replicated dim (one all-gather per dim, one all-reduce), and
    reads each local tensor once. Plain (non-DTensor) parameters are not compared.

    Raises:
        RuntimeError: on every rank, when some replicas differ: each differing parameter with the
            replicas that differ (the minority when there are more than two, else both).
    """
    if not dist.is_initialized():
        return
    by_dim: dict[tuple[int, int], tuple[Any, list[str], list[torch.Tensor]]] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not isinstance(param, DTensor):
                continue
            mesh = param.device_mesh
            for dim, placement in enumerate(param.placements):
                if placement.is_replicate() and mesh.size(dim) > 1:
                    entry = by_dim.setdefault((id(mesh), dim), (mesh, [], []))
                    entry[1].append(name)
                    entry[2].append(_fingerprint(param.to_local()))
    problems: list[str] = []
    for (_, dim), (mesh, names, prints) in sorted(by_dim.items(), key=lambda item: item[0][1]):
        group = mesh.get_group(dim)
        local = torch.stack(prints).to(mesh.device_type)
        gathered = local.new_empty((dist.get_world_size(group), *local.shape))
        dist.all_gather_into_tensor(gathered, local, group=group)
        gathered = gathered.cpu()
        differs = (gathered != gathered[:1]).any(dim=2).any(dim=0)  # per parameter, over replicas
        dim_name = mesh.mesh_dim_names[dim] if mesh.mesh_dim_names else str(dim)
        for index in differs.nonzero().flatten().tolist():  # only the parameters that differ
            values = [tuple(row) for row in gathered[:, index].tolist()]
            problems.append(f"{names[index]}: {_who_differs(values)} on mesh dim {dim_name!r}")
    _raise_everywhere(problems)


def _fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """``[words, sum, weighted sum]`` of ``tensor``'s bytes as 64-bit words (wrapping int64 sums)."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-data.numel()) % 8
    if pad or data.storage_offset() % 8:  # 64-bit words need 8 whole bytes at an aligned offset
        data = torch.cat([data, data.new_zeros(pad)])  # a copy of its own (a shard may start anywhere)
    words = data.view(torch.int64)
    weights = torch.arange(1, words.numel() + 1, dtype=torch.int64, device=words.device)
    return torch.stack(
        [torch.tensor(words.numel(), device=words.device), words.sum(), (words * weights).sum()]
    )


def _who_differs(values: list[tuple[int, ...]]) -> str:
    """The replicas (indices along the dim) that differ: the minority, or all of them with two."""
    counts = Counter(values)
    majority, count = counts.most_common(1)[0]
    if count * 2 > len(values):
        odd = [i for i, v in enumerate(values) if v != majority]
        return f"replica(s) {odd} differ from the other {count}"
    return f"replicas {list(range(len(values)))} do not agree (no majority)"


def _raise_everywhere(problems: list[str]) -> None:
    """Every rank raises when any rank found a difference (each replica group sees only its own)."""
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    raise_everywhere("\n".join(problems), None, _differ, device=device, combine=_lines)


def _lines(everyone: list[str]) -> str:
    """Every rank's differences, each once, sorted."""
    return "; ".join(sorted({line for found in everyone for line in found.split("\n") if line}))


def _differ(found: str) -> RuntimeError:
    return RuntimeError(
        "check_replicas: parameters differ across their replicas (ranks that hold the same shard), so the "
        f"replicas train different models: {found}. Restore the replicas from a checkpoint, or "
        "broadcast the parameters from one replica; look for a rank that skipped a step or a "
        "non-deterministic update."
    )
