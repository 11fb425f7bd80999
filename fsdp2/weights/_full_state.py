"""Full-state files: one safetensors file, written and read by rank 0, one tensor in flight at a time.

Owns: ``save_full_state_dict`` (every rank gathers each state-dict entry in turn, rank 0 streams it
into a safetensors file whose header it wrote first) and ``load_full_state_dict`` (rank 0 reads one
entry at a time, broadcasts it, every rank copies its own shard into the existing parameter in place).
Does not own: the sharded state dict itself (``runtime/_state_dict.py`` hooks, used through
``state_dict()``), the safetensors pieces both exports share (``_safetensors.py``: header, dtype table,
checked state dict, comm device, gathering, the lazily imported reader).
Invariants: no rank holds more than one full (unsharded) tensor beyond its shards; a load either
finds every key with its full shape or raises on every rank before any parameter is written.
"""

from __future__ import annotations

import os
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..comm import raise_everywhere
from ..debug import check_entry
from ..param import local_box
from ._buffers import rebuild_buffers
from ._safetensors import checked_state_dict, comm_device, full_tensor, header_bytes, safe_open_or_raise


def save_full_state_dict(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Write ``model``'s full (unsharded) state dict to a safetensors file, gathering one tensor at a time.

    Every rank must call it. Each entry of ``model.state_dict()`` (parameters and buffers, under the
    unsharded model's names) is gathered in turn with ``DTensor.full_tensor()``, then rank 0 appends its
    bytes to the file and drops it, so no rank holds more than one full tensor beyond its shards
    (``get_model_state_dict(..., full_state_dict=True)`` holds the whole model at once). The file loads
    with ``safetensors.torch.load_file`` into the plain model, and with :func:`load_full_state_dict`
    into an fsdp2 model at any world size. Tied parameters are written under each of their names.
    Issues one all-gather per sharded tensor, one small object all-gather (whether rank 0 could open the
    file) and a barrier at the end (the file is complete when any rank returns). Only rank 0 touches
    ``path``; the ``safetensors`` package is not needed to save.

    Args:
        model: the fsdp2 (or plain) model; its parameters are left as they were.
        path: the file rank 0 writes (overwritten).

    Raises:
        TypeError: a state-dict entry is not a tensor, or has a dtype safetensors cannot store.
        OSError: (on every rank) rank 0 cannot open ``path`` for writing.

    Example:
        >>> fsdp2.save_full_state_dict(model, "model.safetensors")  # doctest: +SKIP
        >>> plain.load_state_dict(safetensors.torch.load_file("model.safetensors"))  # doctest: +SKIP
    """
    check_entry(model, "save_full_state_dict")  # debug mode: every rank is here (else DivergenceError)
    entries = _entries(model)
    writer = dist.get_rank() == 0 if dist.is_initialized() else True
    stream: BinaryIO | None = None
    try:
        problem = ""
        if writer:
            try:
                stream = open(path, "wb")  # noqa: SIM115 - closed in finally, after the collectives
                stream.write(header_bytes((k, t.dtype, t.shape) for k, t in entries.items()))
            except OSError as error:
                problem = f"rank 0 cannot write {os.fspath(path)!r}: {error}"
        # every rank raises, or none: no rank is left in a collective
        failed = "save_full_state_dict: {}. Nothing was written."
        raise_everywhere(problem, None, lambda text: OSError(failed.format(text)))
        for tensor in entries.values():
            full = full_tensor(tensor)  # collective: every rank, same order
            if stream is not None:
                stream.write(full.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            del full
    finally:
        if stream is not None:
            stream.close()
    if dist.is_initialized():
        dist.barrier()


def load_full_state_dict(model: nn.Module, path: str | os.PathLike[str], *, strict: bool = True) -> None:
    """Load a full safetensors state dict into ``model``'s existing (sharded) tensors, one tensor at a time.

    Every rank must call it; only rank 0 reads ``path``. For each entry of ``model.state_dict()``, rank 0
    reads the full tensor, casts it to the model's dtype and broadcasts it; every rank copies its own shard
    (its chunk under the parameter's DTensor placements) into the local tensor in place, so optimizers
    built on the parameters keep working, and frees the full tensor before the next one. Buffers are
    copied whole. Issues one broadcast per tensor plus one to agree on the check below.

    Args:
        model: the fsdp2 (or plain) model, at any world size; keys are its ``state_dict()`` keys.
        path: a safetensors file, e.g. written by :func:`save_full_state_dict` or
            ``safetensors.torch.save_file(plain_model.state_dict(), path)``.
        strict: with ``True``, a key missing from the file or extra in it raises; with ``False``, only the
            keys present in both are loaded.

    Raises:
        ImportError: the ``safetensors`` package is not installed.
        ValueError: (on every rank, before anything is written) rank 0 cannot read ``path`` as a
            safetensors file, missing or unexpected keys with ``strict=True``, a tensor whose shape
            is not the full shape of its entry, or a non-persistent buffer that ``to_empty`` left
            uninitialised and nothing rebuilds (a ``transformers`` model's own ``_init_weights`` rebuilds
            its buffers first, as in :func:`load_pretrained`).

    Example:
        >>> fsdp2.load_full_state_dict(model, "model.safetensors")  # doctest: +SKIP
    """
    safe_open = safe_open_or_raise("load_full_state_dict")
    check_entry(model, "load_full_state_dict")  # debug mode: every rank is here (else DivergenceError)
    entries = _entries(model)
    is_reader = dist.get_rank() == 0 if dist.is_initialized() else True
    comm = comm_device(entries.values())
    present: list[str] = []
    handle: Any = None
    try:
        problem = ""
        if is_reader:
            try:
                handle = safe_open(os.fspath(path), framework="pt", device="cpu").__enter__()
                problem, present = _check_file(handle, entries, strict)
            except Exception as error:  # unreadable or not safetensors: every rank must hear of it
                problem = f"rank 0 cannot read it: {type(error).__name__}: {error}."
        shared: list[Any] = [problem, present]
        if dist.is_initialized():
            dist.broadcast_object_list(shared, src=0)
        problem, present = shared
        if not problem:
            problem = rebuild_buffers(model, "load_full_state_dict")  # the same on every rank
        if problem:
            raise ValueError(f"load_full_state_dict({os.fspath(path)!r}): {problem} Nothing was loaded.")
        with torch.no_grad():
            # One receive buffer, sized for the largest entry and reused for every tensor: at most one
            # full tensor is in flight however late the backend releases a finished broadcast.
            largest = max((_nbytes(entries[key]) for key in present), default=0)
            buffer = torch.empty(largest, dtype=torch.uint8, device=comm)
            for key in present:
                tensor = entries[key]
                full = buffer[: _nbytes(tensor)].view(tensor.dtype).view(tensor.shape)
                if handle is not None:
                    full.copy_(handle.get_tensor(key))
                if dist.is_initialized():
                    dist.broadcast(full, src=0)
                _copy_into(tensor, full)
            del buffer
    finally:
        if handle is not None:
            handle.__exit__(None, None, None)


def _nbytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s full (unsharded) value."""
    return tensor.numel() * tensor.element_size()


def _entries(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` checked for safetensors, largest element size first (aligned offsets)."""
    state = checked_state_dict(model)
    # Stable: state-dict order within one element size. Descending sizes keep each offset a multiple
    # of its tensor's element size, so readers can view the bytes without copying.
    order = sorted(state, key=lambda k: -state[k].element_size())
    return {key: state[key] for key in order}


def _check_file(handle: Any, entries: dict[str, torch.Tensor], strict: bool) -> tuple[str, list[str]]:
    """``(problem or "", keys to load)``: the file's keys and shapes against the model's."""
    keys = set(handle.keys())
    missing = [k for k in entries if k not in keys]
    unexpected = sorted(keys - entries.keys())
    problems = []
    if strict and (missing or unexpected):
        problems.append(
            f"missing keys {missing}, unexpected keys {unexpected} (pass strict=False to skip them)."
        )
    present = [k for k in entries if k in keys]
    for key in present:
        shape = tuple(handle.get_slice(key).get_shape())
        if shape != tuple(entries[key].shape):
            problems.append(f"{key}: expected the full shape {tuple(entries[key].shape)}, got {shape}.")
    return " ".join(problems), present


def _copy_into(tensor: torch.Tensor, full: torch.Tensor) -> None:
    """Write this rank's part of ``full`` into ``tensor`` in place (its local shard for a DTensor)."""
    if not isinstance(tensor, DTensor):
        tensor.copy_(full)
        return
    if tensor.device_mesh.get_coordinate() is None:  # this rank holds no part of the tensor
        return
    box = local_box(tensor)
    if box is not None:  # a view of the rows this rank holds, copied without a clone
        local = full[box]
    else:  # strided shards (tensor parallel under FSDP): DTensor's own split
        local = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
    tensor.to_local().copy_(local)
