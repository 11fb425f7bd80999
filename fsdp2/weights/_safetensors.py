"""The safetensors pieces both exports share: the full-state files and the Hugging Face checkpoints.

Owns: the dtype table (``SAFETENSORS_DTYPES``), the header of a file whose tensors follow back to back
(``header_bytes``), the state dict checked for safetensors (``checked_state_dict``), the device the
collectives run on (``comm_device``), one tensor's full value (``full_tensor``) and the lazily imported
reader (``safe_open_or_raise``). Does not own: what is written where, or by whom (``_full_state.py``:
rank 0; ``_pretrained.py``: every rank its own files).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..base import mesh_device

__all__ = [
    "SAFETENSORS_DTYPES",
    "checked_state_dict",
    "comm_device",
    "full_tensor",
    "header_bytes",
    "safe_open_or_raise",
]

# safetensors' names of the dtypes it stores
SAFETENSORS_DTYPES: Mapping[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def header_bytes(layout: Iterable[tuple[str, torch.dtype, Sequence[int]]]) -> bytes:
    """The start of a safetensors file whose tensors ``(name, dtype, shape)`` follow back to back.

    The 8-byte little-endian length, then the JSON header padded with spaces to a multiple of 8 bytes
    (so a tensor's offset stays a multiple of its element size when larger elements come first).
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in layout:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


def checked_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` (state-dict order), every entry a tensor of a dtype safetensors stores.

    Raises:
        TypeError: ``model`` is not a module, or an entry is not a tensor or has such a dtype.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}.")
    state = model.state_dict()
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"state_dict entry {key} is a {type(value).__name__}, not a tensor; safetensors stores "
                "tensors only."
            )
        if value.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(
                f"state_dict entry {key} has dtype {value.dtype}, which safetensors cannot store: expected "
                f"one of {sorted(map(str, SAFETENSORS_DTYPES))}."
            )
    return state


def comm_device(tensors: Any) -> torch.device:
    """The device collectives run on: the first DTensor's mesh device (CPU for a model without any)."""
    for tensor in tensors:
        if isinstance(tensor, DTensor):
            return mesh_device(tensor.device_mesh)
    return torch.device("cpu")


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s full value (a collective over its mesh for a DTensor; offloaded shards moved there)."""
    if not isinstance(tensor, DTensor):
        return tensor
    device = mesh_device(tensor.device_mesh)
    dtensor = tensor if tensor.device == device else cast(DTensor, tensor.to(device))  # offloaded shards
    full: torch.Tensor = dtensor.full_tensor()
    return full


def safe_open_or_raise(what: str) -> Any:
    """``safetensors.safe_open``, or an ImportError saying ``what`` needs the package."""
    try:
        from safetensors import safe_open
    except ImportError as error:
        raise ImportError(
            f"{what} needs the safetensors package: pip install safetensors "
            "(or pip install 'fsdp2[checkpoint]')."
        ) from error
    return safe_open
