"""Reading a Hugging Face checkpoint into a sharded model: each rank only the bytes of its own shards.

Owns: ``HubReader`` (the checkpoint's files and their open readers, the check of a load against the
model, and the reads: each model tensor filled from the checkpoint blocks that make it, each block read
only where it meets this rank's part) and ``held_box`` (the block of a DTensor a rank holds, for any
placements whose local part is one block). Does not own: which checkpoint tensors make which model
tensor (``_hub_layout``), the agreement between ranks or the buffers (``_pretrained.py``).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..param import local_box
from ._hub_layout import HubLayout, Source

__all__ = ["INDEX_NAME", "SINGLE_NAME", "HubReader", "held_box"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
Groups = Sequence[tuple[Sequence[str], torch.Tensor]]


class HubReader:
    """The checkpoint's files: which file holds each name, and an open (memory-mapped) reader for each."""

    def __init__(self, safe_open: Any) -> None:
        self._safe_open = safe_open
        self._handles: dict[str, Any] = {}
        self.where: dict[str, str] = {}  # name -> file path

    def open(self, path: str | os.PathLike[str]) -> str:
        """Read the index (or the file's names) and open every file; a problem, or ``""``."""
        try:
            self.where = _weight_map(os.fspath(path), self._safe_open)
            for file in dict.fromkeys(self.where.values()):
                self._handles[file] = self._safe_open(file, framework="pt", device="cpu").__enter__()
        except Exception as error:  # unreadable, not safetensors: every rank must hear of it
            return f"cannot read it: {type(error).__name__}: {error}."
        return ""

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint name's shape (from the files' headers)."""
        return {name: tuple(self._slice(name).get_shape()) for name in self.where}

    def check(self, groups: Groups, layout: HubLayout) -> str:
        """Missing, unexpected and mis-shaped names, and parameters on the meta device; or ``""``."""
        missing, shapes, meta = [], [], []
        for names, tensor in groups:
            absent = next((layout.missing[n] for n in names if n in layout.missing), None)
            source = _source(names, layout)
            if absent is not None:
                missing += absent
            elif source is None and not any(n in layout.problems for n in names):
                missing.append(names[0])
            elif source is not None and source.shape != tuple(tensor.shape):
                made = (
                    source.names[0]
                    if len(source.names) == 1
                    else f"{names[0]} from {len(source.names)} tensors"
                )
                shapes.append(f"{made} {source.shape} (model: {tuple(tensor.shape)})")
            if tensor.is_meta or (isinstance(tensor, DTensor) and tensor.to_local().is_meta):
                meta.append(names[0])
        return _problems(missing, layout.unexpected, shapes, meta, list(layout.problems.values()))

    def read(self, groups: Groups, layout: HubLayout) -> None:
        """Fill every group's tensor, closing each file once its last tensor is read (its mapped pages go)."""
        chosen = [(_source(names, layout), tensor) for names, tensor in groups]
        uses = Counter(self.where[n] for source, _ in chosen if source is not None for n in set(source.names))
        for source, tensor in chosen:
            assert source is not None  # checked
            self._fill(source, tensor)
            for file in {self.where[n] for n in source.names}:
                uses[file] -= 1
                if not uses[file]:
                    self._handles.pop(file).__exit__(None, None, None)

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    def _fill(self, source: Source, tensor: torch.Tensor) -> None:
        """Copy this rank's part of ``source`` into ``tensor`` in place, reading only those bytes."""
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        box: tuple[slice, ...] | None = tuple(slice(0, n) for n in tensor.shape)
        if isinstance(tensor, DTensor):
            if tensor.device_mesh.get_coordinate() is None:  # this rank holds no part of it
                return
            box = held_box(tensor) if tensor.dim() else ()
        if source.convert is not None:
            value = source.convert(lambda name: self._read(name, ()))
        elif box is None:  # not one block here: the whole tensor, cut below as DTensor cuts it
            value = torch.empty(source.shape, dtype=tensor.dtype)
            self._fill_box(source, value, tuple(slice(0, n) for n in source.shape))
        else:
            self._fill_box(source, local, box)
            return
        if box is None:
            assert isinstance(tensor, DTensor)
            value = distribute_tensor(
                value.to(tensor.dtype), tensor.device_mesh, tensor.placements, src_data_rank=None
            )
            local.copy_(value.to_local())
        else:
            local.copy_(value[box])

    def _fill_box(self, source: Source, out: torch.Tensor, box: tuple[slice, ...]) -> None:
        """``out`` (the block ``box`` of ``source``) from each checkpoint block's part inside ``box``."""
        for block in source.blocks:
            spans = [
                (max(s, b.start), min(s + n, b.stop))
                for s, n, b in zip(block.starts, block.sizes, box, strict=True)
            ]
            if any(lo >= hi for lo, hi in spans):
                continue
            read = tuple(
                slice(lo - s, hi - s)
                for d, ((lo, hi), s) in enumerate(zip(spans, block.starts, strict=True))
                if d not in block.squeezed
            )
            where = tuple(slice(lo - b.start, hi - b.start) for (lo, hi), b in zip(spans, box, strict=True))
            out[where].copy_(self._read(block.name, read).reshape([hi - lo for lo, hi in spans]))

    def _read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        if not index:
            return self._handles[self.where[name]].get_tensor(name)  # type: ignore[no-any-return]
        return self._slice(name)[index]  # type: ignore[no-any-return]

    def _slice(self, name: str) -> Any:
        return self._handles[self.where[name]].get_slice(name)


def held_box(tensor: DTensor) -> tuple[slice, ...] | None:
    """The block of the global tensor this rank's local tensor is, or ``None`` when it is not one block.

    ``local_box`` for ``Shard``/``Replicate``; other shardings (``_StridedShard``: expert and tensor
    parallelism under FSDP) by cutting each dim's ``arange`` as DTensor cuts the tensor.
    """
    box = local_box(tensor)
    if box is not None:
        return box
    slices = []
    for dim, size in enumerate(tensor.shape):
        mapped = [_on_dim(p, dim) for p in tensor.placements]
        placements = [p for p in mapped if p is not None]
        if len(placements) != len(mapped):
            return None
        held = distribute_tensor(torch.arange(size), tensor.device_mesh, placements, src_data_rank=None)
        rows = held.to_local().cpu()
        start = int(rows[0]) if len(rows) else 0
        if not torch.equal(rows, torch.arange(start, start + len(rows))):
            return None
        slices.append(slice(start, start + len(rows)))
    if tuple(s.stop - s.start for s in slices) != tuple(tensor.to_local().shape):
        return None
    return tuple(slices)


def _on_dim(placement: Placement, dim: int) -> Placement | None:
    """``placement`` as it acts on a 1-D tensor of the global tensor's ``dim`` (``None``: unknown)."""
    if isinstance(placement, _StridedShard):
        return _StridedShard(0, split_factor=placement.split_factor) if placement.dim == dim else Replicate()
    if isinstance(placement, Shard):
        return Shard(0) if placement.dim == dim else Replicate()
    return placement if isinstance(placement, Replicate) else None


def _source(names: Sequence[str], layout: HubLayout) -> Source | None:
    return next((layout.sources[n] for n in names if n in layout.sources), None)


def _weight_map(path: str, safe_open: Any) -> dict[str, str]:
    """Every tensor name of the checkpoint at ``path`` -> the file holding it."""
    if os.path.isdir(path):
        index = os.path.join(path, INDEX_NAME)
        if not os.path.exists(index):
            single = os.path.join(path, SINGLE_NAME)
            if not os.path.exists(single):
                raise FileNotFoundError(f"neither {INDEX_NAME} nor {SINGLE_NAME} is in the directory")
            return _weight_map(single, safe_open)
        with open(index, encoding="utf-8") as stream:
            weight_map = json.load(stream)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    with safe_open(path, framework="pt", device="cpu") as handle:
        return dict.fromkeys(handle.keys(), path)


def _problems(
    missing: Sequence[str],
    unexpected: Sequence[str],
    shapes: Sequence[str],
    meta: Sequence[str],
    other: Sequence[str],
) -> str:
    problems = []
    if missing:
        problems.append(f"names missing from the checkpoint: {list(missing)}.")
    if unexpected:
        problems.append(f"names in the checkpoint the model does not have: {list(unexpected)}.")
    if shapes:
        problems.append(f"shapes that differ: {', '.join(shapes)}.")
    problems += other
    if problems:
        problems.append(
            "Build the model from the checkpoint's own config (transformers.AutoConfig.from_pretrained) "
            "so names and shapes match."
        )
    if meta:
        problems.append(
            f"{list(meta)} are on the meta device: call model.to_empty(device=...) before loading."
        )
    return " ".join(problems)
