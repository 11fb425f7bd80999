"""``fsdp2.save_pretrained`` / ``load_pretrained``: Hugging Face checkpoints written and read by every rank.

A real ``transformers`` Llama (tied embeddings, RoPE's non-persistent buffers), saved by its own
``save_pretrained`` (one file, or several with a small ``max_shard_size``), loads into a sharded copy
(each decoder layer, then the root; built plainly or on the meta device) and gives the unsharded
model's logits exactly. fsdp2's export reads back with ``safetensors`` (equal to the unsharded state
dict, in the chosen dtype) and with ``from_pretrained`` (equal logits). A small model of uneven and
empty shards, a dim-1 shard (gathered whole on its mesh), an HSDP mesh and plain buffers goes out at
one world size and back at another. Bad checkpoints raise on every rank and leave parameters as
they were.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.overrides import TorchFunctionMode

import fsdp2
from tests._harness import run_threaded
from tests._training import EXACT

safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 96


def _llama() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))


def _logits(model: nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids=_ids()).logits
    return logits


def _shard_llama(model: nn.Module) -> nn.Module:
    for layer in model.model.layers:
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
    return model


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _read_all(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(safetensors_torch.load_file(path))
    return tensors


# ---- Hugging Face's checkpoints in --------------------------------------------------------------


class _GarbageMemory(TorchFunctionMode):
    """``to_empty``'s uninitialised memory made visible: plain tensors come back as NaN (or -7)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.empty_like and not isinstance(args[0], DTensor):
            fill = float("nan") if args[0].is_floating_point() else -7
            return torch.full_like(args[0], fill, **kwargs)
        return func(*args, **kwargs)


def _load_llama(reference: nn.Module, path: str, meta: bool) -> torch.Tensor:
    if meta:  # RoPE's non-persistent inv_freq: uninitialised memory until load_pretrained rebuilds it
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(reference.config)
        with _GarbageMemory():
            _shard_llama(model).to_empty(device="cpu")
    else:  # built: to_empty keeps the non-persistent buffers' values, the load fills the rest
        with _GarbageMemory():
            model = _shard_llama(copy.deepcopy(reference)).to_empty(device="cpu")
    fsdp2.load_pretrained(model, path)
    for name, buffer in reference.named_buffers():
        torch.testing.assert_close(model.get_buffer(name), buffer, **EXACT)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return _logits(model)


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("meta", [True, False], ids=["meta", "built"])
@pytest.mark.parametrize("max_shard_size", ["20KB", "50GB"], ids=["several-files", "one-file"])
def test_hf_save_pretrained_loads_into_sharded_model(meta: bool, max_shard_size: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = _llama()
    reference.save_pretrained(tmp_path, max_shard_size=max_shard_size)
    several = (tmp_path / "model.safetensors.index.json").exists()
    assert several == (max_shard_size == "20KB")
    assert "lm_head.weight" not in _read_all(tmp_path)  # HF writes the tied weight once
    want = _logits(reference)
    for got in run_threaded(2, _load_llama, reference, str(tmp_path), meta):
        torch.testing.assert_close(got, want, **EXACT)


# ---- fsdp2's export out --------------------------------------------------------------------------


def _export_llama(reference: nn.Module, directory: str, dtype: torch.dtype | str | None) -> None:
    model = _shard_llama(copy.deepcopy(reference))
    fsdp2.save_pretrained(model, directory, dtype=dtype, max_shard_size="20KB")


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["own-dtype", "bf16"])
def test_export_reads_back_with_safetensors_and_transformers(
    dtype: torch.dtype | None, tmp_path: Path
) -> None:
    torch.manual_seed(1)
    reference = _llama()
    # bf16 is asked for by name, as transformers takes it
    run_threaded(2, _export_llama, reference, str(tmp_path), "bfloat16" if dtype else None)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == sorted(set(index["weight_map"].values()))
    assert len(files) >= 2
    want = {k: v.to(dtype or v.dtype) for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    got = _read_all(tmp_path)
    assert set(index["weight_map"]) == got.keys() == want.keys()
    torch.testing.assert_close(got, want, **EXACT)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in want.values())
    for name, file in index["weight_map"].items():
        assert name in safetensors_torch.load_file(tmp_path / file), name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(loaded) is transformers.LlamaForCausalLM
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    expected = copy.deepcopy(reference)
    expected.load_state_dict({k: v.float() for k, v in reference.state_dict().items()} if dtype is None else {
        k: v.to(dtype).float() for k, v in reference.state_dict().items()
    })  # fmt: skip
    torch.testing.assert_close(_logits(loaded), _logits(expected), **EXACT)


# ---- uneven, empty, dim-1 and HSDP shards, plain buffers; any world size back ----------------------


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(12, 13)  # 13 rows: uneven chunks
        self.wide = nn.Linear(12, 8)  # sharded on dim 1 below (gathered whole on its mesh to export)
        self.down = nn.Linear(8, 3)  # 3 rows at world 4: one rank holds none
        self.register_buffer("counts", torch.arange(5))  # persistent, plain, an integer
        self.register_buffer("scratch", torch.zeros(2), persistent=False)  # not in the file

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))[:, :8] + self.wide(x))


def _seeded_net(seed: int) -> _Net:
    torch.manual_seed(seed)
    net = _Net()
    net.counts.add_(seed)
    return net


def _shard_net(net: _Net, hsdp: bool) -> _Net:
    mesh = (
        init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
        if hsdp
        else None
    )
    fsdp2.fully_shard(
        net.wide, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else Shard(0)
    )
    fsdp2.fully_shard(net, mesh=mesh)
    return net


def _export_net(net: _Net, directory: str, hsdp: bool) -> None:
    fsdp2.save_pretrained(_shard_net(copy.deepcopy(net), hsdp), directory, max_shard_size=200)


def _import_net(directory: str, hsdp: bool) -> dict[str, torch.Tensor]:
    model = _shard_net(_seeded_net(5), hsdp)
    locals_ = {name: p.to_local().data_ptr() for name, p in model.named_parameters()}
    fsdp2.load_pretrained(model, directory)
    assert {name: p.to_local().data_ptr() for name, p in model.named_parameters()} == locals_  # in place
    assert torch.equal(model.scratch, torch.zeros(2))
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(3))
    return {"state": {k: _full(v) for k, v in model.state_dict().items()}, "out": model(x).detach()}


@pytest.mark.parametrize(
    ("save_world", "load_world", "hsdp"),
    [(4, 3, False), (2, 4, False), (4, 4, True)],
    ids=["4-to-3", "2-to-4", "hsdp"],
)
def test_uneven_empty_and_dim1_shards_round_trip(
    save_world: int, load_world: int, hsdp: bool, tmp_path: Path
) -> None:
    net = _seeded_net(2)
    run_threaded(save_world, _export_net, net, str(tmp_path), hsdp)
    assert len(list(tmp_path.glob("*.safetensors"))) >= save_world  # every rank wrote a file
    torch.testing.assert_close(_read_all(tmp_path), net.state_dict(), **EXACT)
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(3))
    for got in run_threaded(load_world, _import_net, str(tmp_path), hsdp and load_world % 2 == 0):
        torch.testing.assert_close(got["state"], net.state_dict(), **EXACT)
        torch.testing.assert_close(got["out"], net(x).detach(), **EXACT)


def _export_default(net: _Net, directory: str) -> None:
    fsdp2.save_pretrained(_shard_net(copy.deepcopy(net), False), directory)


def test_single_file_and_a_stale_export(tmp_path: Path) -> None:
    """One ``.safetensors`` file loads too; a second export removes files of the first it did not replace."""
    net = _seeded_net(2)
    run_threaded(4, _export_net, net, str(tmp_path), False)
    first = {p.name for p in tmp_path.glob("*.safetensors")}
    run_threaded(2, _export_default, net, str(tmp_path))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = {p.name for p in tmp_path.glob("*.safetensors")}
    assert files == set(index["weight_map"].values())
    assert len(files) < len(first)
    torch.testing.assert_close(_read_all(tmp_path), net.state_dict(), **EXACT)
    single = tmp_path / "plain.safetensors"
    safetensors_torch.save_file(net.state_dict(), single)
    for got in run_threaded(2, _import_net, str(single), False):
        torch.testing.assert_close(got["state"], net.state_dict(), **EXACT)


class _FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 12)
        self.down = nn.Linear(12, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _tensor_parallel(net: nn.Module) -> nn.Module:
    """Column-wise ``up``, row-wise ``down`` on a 2-way TP mesh, then fully_shard on the 2-way DP mesh:
    strided shards (``_StridedShard``) and a dim-0 by dim-1 weight, both exported whole from their mesh."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(net, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fsdp2.fully_shard(net, mesh=mesh["dp"])
    return net


def _tp_round_trip(net: nn.Module, directory: str) -> dict[str, torch.Tensor]:
    fsdp2.save_pretrained(_tensor_parallel(copy.deepcopy(net)), directory, max_shard_size=300)
    model = _tensor_parallel(copy.deepcopy(net))
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().zero_()
    fsdp2.load_pretrained(model, directory)
    return {k: _full(v) for k, v in model.state_dict().items()}


def test_tensor_parallel_shards_out_and_back(tmp_path: Path) -> None:
    torch.manual_seed(4)
    net = _FeedForward()
    for got in run_threaded(4, _tp_round_trip, net, str(tmp_path)):
        torch.testing.assert_close(got, net.state_dict(), **EXACT)
    torch.testing.assert_close(_read_all(tmp_path), net.state_dict(), **EXACT)


# ---- bad checkpoints ------------------------------------------------------------------------------


def _refused(path: str, match: str) -> None:
    model = _shard_net(_seeded_net(5), False)
    before = {k: _full(v).clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        fsdp2.load_pretrained(model, path)
    torch.testing.assert_close({k: _full(v) for k, v in model.state_dict().items()}, before, **EXACT)


BAD = {
    "missing": (lambda t: t.pop("down.bias"), r"names missing from the checkpoint: \['down\.bias'\]"),
    "unexpected": (lambda t: t.update(extra=torch.zeros(1)), r"the model does not have: \['extra'\]"),
    "mis-shaped": (
        lambda t: t.update({"up.weight": torch.zeros(7, 8)}),
        r"shapes that differ: up\.weight \(7, 8\) \(model: \(13, 12\)\)\. Build the model from the",
    ),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_checkpoint_raises_everywhere_before_any_write(kind: str, tmp_path: Path) -> None:
    tensors = {k: torch.ones_like(v) for k, v in _Net().state_dict().items()}
    change, match = BAD[kind]
    change(tensors)
    safetensors_torch.save_file(tensors, tmp_path / "model.safetensors")
    run_threaded(2, _refused, str(tmp_path), match + r".*Nothing was loaded\.")


def test_unreadable_checkpoint_and_meta_parameters(tmp_path: Path) -> None:
    run_threaded(
        2, _refused, str(tmp_path), r"neither model\.safetensors\.index\.json nor model\.safetensors"
    )
    saved = _Net()
    safetensors_torch.save_file(saved.state_dict(), tmp_path / "model.safetensors")

    def on_meta(path: str) -> None:
        with torch.device("meta"):
            model = _shard_net(_Net(), False)
        with pytest.raises(ValueError, match=r"on the meta device: call model\.to_empty"):
            fsdp2.load_pretrained(model, path)

    run_threaded(2, on_meta, str(tmp_path))

    def meta_built(path: str) -> torch.Tensor:  # a plain module's non-persistent buffer: no rebuild known
        with torch.device("meta"):
            model = _shard_net(_Net(), False)
        with _GarbageMemory():
            model.to_empty(device="cpu")
        before = [p.to_local().clone() for p in model.parameters()]
        with pytest.raises(ValueError, match=r"non-persistent buffer\(s\) scratch hold uninitialised memory"):
            fsdp2.load_pretrained(model, path)
        after = [p.to_local() for p in model.parameters()]  # nothing was loaded
        torch.testing.assert_close(after, before, equal_nan=True, **EXACT)
        model.scratch.zero_()  # what the module's constructor computes
        fsdp2.load_pretrained(model, path)
        return model.up.weight.full_tensor()

    for got in run_threaded(2, meta_built, str(tmp_path)):
        torch.testing.assert_close(got, saved.up.weight.detach(), **EXACT)


def test_save_pretrained_refuses_bad_arguments(tmp_path: Path) -> None:
    net = _Net()
    with pytest.raises(ValueError, match=r"max_shard_size '5 parsecs' is not a size"):
        fsdp2.save_pretrained(net, tmp_path, max_shard_size="5 parsecs")
    with pytest.raises(TypeError, match="floating-point dtype"):
        fsdp2.save_pretrained(net, tmp_path, dtype=torch.int8)
    for bad in ("int8", "auto", "bf16", 16):
        with pytest.raises(TypeError, match=r"pass torch\.float16, torch\.bfloat16, torch\.float32"):
            fsdp2.save_pretrained(net, tmp_path, dtype=bad)  # type: ignore[arg-type]
    assert not os.listdir(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    run_threaded(2, _unwritable, net, str(blocker / "out"))


def _unwritable(net: _Net, directory: str) -> None:
    with pytest.raises(
        OSError, match=r"save_pretrained: .*cannot write in .*a-file/out.* Nothing was written\."
    ):
        fsdp2.save_pretrained(_shard_net(copy.deepcopy(net), False), directory)
