"""Checkpoints: state dicts, DCP save/load (also across world sizes and across torch <-> fsdp2), full
state dicts on the CPU, and fsdp2's own safetensors export/import.

- ``state_dict()`` keys are the unsharded model's, parameters are ``Shard(0)`` DTensors whose
  ``full_tensor()`` is the reference value, buffers are plain tensors; the plain model's state dict loads
  directly with ``load_state_dict``;
- DCP (``get_model_state_dict``/``get_optimizer_state_dict`` + ``dcp.save``, then ``dcp.load`` +
  ``set_*_state_dict``) restores parameters and optimizer state exactly, at the same world size, at a
  larger one, and between torch's ``fully_shard`` and fsdp2 both ways; the next step then matches an
  unsharded reference given the same weights and AdamW state;
- ``StateDictOptions(full_state_dict=True, cpu_offload=True)`` gives rank 0 the full CPU tensors and the
  other ranks nothing; full dicts on every rank load back with ``set_model_state_dict``;
- ``fsdp2.save_full_state_dict`` writes a file ``safetensors.torch.load_file`` reads into the plain model;
  ``fsdp2.load_full_state_dict`` loads it (or ``save_file``'s) at world sizes 1, 2 and 4, in place, and
  refuses a bad file on every rank before writing anything.
"""

from __future__ import annotations

import copy
import io
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor, Shard

import fsdp2
from tests._harness import run_threaded
from tests._training import EXACT, seeded
from tests.shared.checkpoint_net import (
    Net,
    adamw,
    assert_matches,
    dcp_load,
    full_value,
    inputs,
    perturbed,
    shard,
    snapshot,
    train,
)

safetensors_torch = pytest.importorskip("safetensors.torch")


# ---- state_dict() and load_state_dict() ----------------------------------------------------------


def _state_dict_layout() -> None:
    ref = seeded(Net)
    model = shard(copy.deepcopy(ref))
    state = model.state_dict()
    assert list(state) == list(ref.state_dict())
    for key, value in state.items():
        if key.endswith(("scale", "offset")):
            assert type(value) is torch.Tensor, key
        else:
            assert isinstance(value, DTensor), key
            assert value.placements == (Shard(0),), key
        torch.testing.assert_close(full_value(value), ref.state_dict()[key], **EXACT)
    # The plain model's full-size tensors load directly: fsdp2 keeps each rank's shard.
    fresh = shard(perturbed())
    fresh.load_state_dict(ref.state_dict())
    torch.testing.assert_close(
        {k: full_value(v) for k, v in fresh.state_dict().items()}, ref.state_dict(), **EXACT
    )


def test_state_dict_keys_values_and_plain_load() -> None:
    run_threaded(2, _state_dict_layout)


# ---- torch.save of a sharded state dict (per-rank files, torchft's live transfer) -------------------


def _pickled(state: dict[str, Any]) -> tuple[bytes, int]:
    """``torch.save`` bytes of ``state`` and the bytes of the tensor data in them."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = 0
    for value in state.values():
        if isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            data += local.numel() * local.element_size()
    return buffer.getvalue(), data


def _torch_save_round_trip(out: dict[str, int]) -> None:
    model = shard(seeded(Net))
    optim = adamw(model)
    train(model, optim, range(2))
    expected = snapshot(model, optim)
    saved, data = _pickled(model.state_dict())
    optim_buffer = io.BytesIO()
    torch.save(optim.state_dict(), optim_buffer)
    loaded = torch.load(io.BytesIO(saved), weights_only=False)
    for key, value in model.state_dict().items():
        got = loaded[key]
        assert type(got) is type(value), key
        if isinstance(value, DTensor):
            assert got.placements == value.placements, key
            local = got.to_local()  # just this rank's shard, in a storage of its own
            assert local.untyped_storage().nbytes() == local.numel() * local.element_size(), key
        torch.testing.assert_close(
            got.to_local() if isinstance(got, DTensor) else got,
            value.to_local() if isinstance(value, DTensor) else value,
            **EXACT,
        )
    fresh = shard(perturbed())
    fresh_optim = adamw(fresh)
    fresh.load_state_dict(loaded)
    fresh_optim.load_state_dict(torch.load(io.BytesIO(optim_buffer.getvalue()), weights_only=False))
    assert_matches(fresh, fresh_optim, expected)
    # The same model under torch's fully_shard: fsdp2's file is no larger (torch's carries padding).
    torch_saved, _ = _pickled(shard(seeded(Net), "torch").state_dict())
    if dist.get_rank() == 0:
        out.update(fsdp2=len(saved), data=data, torch=len(torch_saved))


def test_torch_save_of_a_sharded_state_dict() -> None:
    """Every rank pickles its state dicts, loads them back and into a fresh model (torch 2.13's
    fully_shard can; fsdp2's shards at an offset of a group's packed buffer failed to pickle)."""
    sizes: dict[str, int] = {}
    run_threaded(2, _torch_save_round_trip, sizes)
    assert sizes["fsdp2"] <= sizes["torch"], sizes
    assert sizes["fsdp2"] - sizes["data"] < 16 * 1024, sizes  # the shards' bytes plus the pickled specs


# ---- DCP: save with one implementation / world size, load with another ----------------------------


def _dcp_save(impl: str, path: str, out: dict[str, Any]) -> None:
    model = shard(seeded(Net), impl)
    optim = adamw(model)
    train(model, optim, range(2))
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    dcp.save(state, checkpoint_id=path)
    saved = snapshot(model, optim)
    if dist.get_rank() == 0:
        out.update(saved)


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize(
    ("save_impl", "save_world", "load_impl", "load_world"),
    [
        ("fsdp2", 2, "fsdp2", 2),
        ("fsdp2", 2, "fsdp2", 4),
        ("fsdp2", 4, "fsdp2", 2),
        ("torch", 2, "fsdp2", 2),
        ("fsdp2", 2, "torch", 2),
        ("torch", 2, "fsdp2", 4),
    ],
    ids=["fsdp2-2to2", "fsdp2-2to4", "fsdp2-4to2", "torch2-to-fsdp2", "fsdp2-to-torch2", "torch2-to-fsdp2x4"],
)
def test_dcp_round_trip(
    save_impl: str, save_world: int, load_impl: str, load_world: int, tmp_path: Path
) -> None:
    expected: dict[str, Any] = {}
    run_threaded(save_world, _dcp_save, save_impl, str(tmp_path / "ckpt"), expected)
    run_threaded(load_world, dcp_load, load_impl, str(tmp_path / "ckpt"), expected)


# ---- full state dicts on the CPU --------------------------------------------------------------------


def _full_on_cpu() -> None:
    ref = seeded(Net)
    model = shard(copy.deepcopy(ref))
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)
    if dist.get_rank() == 0:
        assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in full.values())
        torch.testing.assert_close(full, ref.state_dict(), **EXACT)
    else:
        assert full == {}
    # Without cpu_offload every rank gets the full tensors, and set_model_state_dict loads them.
    # (Loading rank 0's dict alone, broadcast_from_rank0=True, needs gloo processes.)
    everywhere = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    torch.testing.assert_close(everywhere, ref.state_dict(), **EXACT)
    fresh = shard(perturbed())
    set_model_state_dict(fresh, everywhere, options=StateDictOptions(full_state_dict=True))
    torch.testing.assert_close(
        {k: full_value(v) for k, v in fresh.state_dict().items()}, ref.state_dict(), **EXACT
    )


def test_full_state_dict_on_cpu_rank0_only() -> None:
    run_threaded(2, _full_on_cpu)


# ---- fsdp2.save_full_state_dict / load_full_state_dict ------------------------------------------------


def _export(path: str, out: dict[str, Any]) -> None:
    model = shard(seeded(Net))
    optim = adamw(model)
    train(model, optim, range(2))
    fsdp2.save_full_state_dict(model, path)
    expected = {k: full_value(v) for k, v in model.state_dict().items()}
    if dist.get_rank() == 0:
        out.update(expected)


def _import(path: str, expected: dict[str, torch.Tensor]) -> None:
    model = shard(perturbed())
    params = {name: (param, param.to_local()) for name, param in model.named_parameters()}
    fsdp2.load_full_state_dict(model, path)
    for name, param in model.named_parameters():
        # In place: the same parameter and local tensor (an optimizer built before keeps working).
        assert param is params[name][0], name
        assert param.to_local().data_ptr() == params[name][1].data_ptr(), name
    torch.testing.assert_close({k: full_value(v) for k, v in model.state_dict().items()}, expected, **EXACT)
    ref = Net()
    ref.load_state_dict(expected)
    for step in range(2):
        x = inputs(dist.get_rank(), step)
        torch.testing.assert_close(model(x).sum(), ref(x).sum())


@pytest.mark.parametrize("load_world", [1, 2, 4])
def test_save_full_state_dict_loads_anywhere(load_world: int, tmp_path: Path) -> None:
    path = str(tmp_path / "model.safetensors")
    expected: dict[str, torch.Tensor] = {}
    run_threaded(2, _export, path, expected)
    # The file is an ordinary safetensors file of the unsharded model.
    loaded = safetensors_torch.load_file(path)
    assert sorted(loaded) == sorted(Net().state_dict())
    torch.testing.assert_close(loaded, expected, **EXACT)
    plain = Net()
    plain.load_state_dict(loaded)
    run_threaded(load_world, _import, path, expected)


def test_load_full_state_dict_reads_save_file(tmp_path: Path) -> None:
    path = str(tmp_path / "plain.safetensors")
    torch.manual_seed(3)
    plain = Net()
    expected = {k: v.clone() for k, v in plain.state_dict().items()}
    safetensors_torch.save_file(plain.state_dict(), path)
    run_threaded(4, _import, path, expected)


def _bad_file(path: str, strict: bool) -> None:
    model = shard(seeded(Net))
    before = {k: full_value(v) for k, v in model.state_dict().items()}
    shape = r"blocks\.1\.up\.weight: expected the full shape \(13, 8\), got \(7, 8\)\. Nothing was loaded"
    keys = r"missing keys \['head\.bias'\], unexpected keys \['extra'\].*"
    with pytest.raises(ValueError, match=keys + shape if strict else shape):
        fsdp2.load_full_state_dict(model, path, strict=strict)
    torch.testing.assert_close({k: full_value(v) for k, v in model.state_dict().items()}, before, **EXACT)
    if strict:
        return
    # Without the bad entry (and with one missing), strict=False loads what is there.
    good = str(Path(path).with_name("partial.safetensors"))
    if dist.get_rank() == 0:
        tensors = safetensors_torch.load_file(path)
        tensors.pop("blocks.1.up.weight")
        safetensors_torch.save_file(tensors, good)
    dist.barrier()
    fsdp2.load_full_state_dict(model, good, strict=False)
    after = {k: full_value(v) for k, v in model.state_dict().items()}
    torch.testing.assert_close(after["blocks.1.up.weight"], before["blocks.1.up.weight"], **EXACT)
    torch.testing.assert_close(after["head.weight"], torch.ones(3, 8), **EXACT)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_load_full_state_dict_refuses_bad_file(strict: bool, tmp_path: Path) -> None:
    tensors = {k: torch.ones_like(v) for k, v in Net().state_dict().items()}
    tensors["blocks.1.up.weight"] = torch.zeros(7, 8)
    tensors.pop("head.bias")
    tensors["extra"] = torch.zeros(1)
    path = str(tmp_path / "bad.safetensors")
    safetensors_torch.save_file(tensors, path)
    run_threaded(2, _bad_file, path, strict)


def test_load_full_state_dict_without_safetensors(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "safetensors", None)
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ImportError, match="pip install safetensors"):
        fsdp2.load_full_state_dict(model, str(tmp_path / "none.safetensors"))
    torch.testing.assert_close(model.state_dict(), before, **EXACT)


def _unreadable(directory: str) -> None:
    model = shard(seeded(Net))
    before = {k: full_value(v) for k, v in model.state_dict().items()}
    missing = str(Path(directory) / "missing.safetensors")
    with pytest.raises(ValueError, match=r"rank 0 cannot read it: .*Nothing was loaded"):
        fsdp2.load_full_state_dict(model, missing)
    with pytest.raises(OSError, match=r"rank 0 cannot write .*Nothing was written"):
        fsdp2.save_full_state_dict(model, str(Path(directory) / "no-such-dir" / "model.safetensors"))
    torch.testing.assert_close({k: full_value(v) for k, v in model.state_dict().items()}, before, **EXACT)


def test_unreadable_or_unwritable_path_raises_on_every_rank(tmp_path: Path) -> None:
    # Rank 0 alone touches the file; the other ranks must raise too instead of waiting in a collective.
    run_threaded(2, _unreadable, str(tmp_path))
