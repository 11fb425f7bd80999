"""``load_pretrained`` / ``save_pretrained`` on mixtures of experts stored one tensor per expert.

transformers 5 holds experts as stacks (``experts.gate_up_proj`` ``[E, 2I, D]``) but its
``save_pretrained`` writes, and Hub checkpoints hold, one tensor per expert and projection
(``experts.3.gate_proj.weight``; Mixtral's ``block_sparse_moe.experts.3.w1.weight``). Threads as ranks
(world 4), tiny Qwen3-MoE, Mixtral and OLMoE built here: transformers' own checkpoint loads into a
model sharded three ways (``fully_shard``'s ``Shard(0)``: whole experts per rank; ``Shard(1)``: rows of
every expert; ``shard_experts(ep=2)``: ``(_StridedShard(0), Shard(0))`` on the expert mesh) with every
parameter bit-identical to the reference, each rank reading exactly as many expert elements as its
shards hold. fsdp2's export writes transformers' names and tensors (``layout="hub"``, the default) or
the stacks (``layout="model"``); both load with ``from_pretrained`` bit for bit. A checkpoint missing an
expert is refused on every rank, naming it, with the parameters untouched. A conversion that is not
stacking (HRM-text's fused ``gqkv_proj`` split by ``Chunk``) runs as transformers runs it, on whole
tensors; fsdp2 then refuses to save it by parts (``layout="hub"``) and names ``layout="model"``, which
the default falls back to.
"""

from __future__ import annotations

import copy
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import safetensors
import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import fsdp2
from tests._harness import run_threaded
from tests._training import EXACT

safetensors_torch = pytest.importorskip("safetensors.torch")

WORLD = 4
KINDS = ["qwen3_moe", "mixtral", "olmoe"]
EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _reference(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    shape: dict[str, Any] = {
        "vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "num_experts_per_tok": 2,
    }  # fmt: skip
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **shape, head_dim=8, intermediate_size=32, moe_intermediate_size=8, num_experts=8
        )
        return transformers.Qwen3MoeForCausalLM(config)
    if kind == "mixtral":
        return transformers.MixtralForCausalLM(
            transformers.MixtralConfig(**shape, head_dim=8, intermediate_size=8, num_local_experts=8)
        )
    return transformers.OlmoeForCausalLM(
        transformers.OlmoeConfig(**shape, intermediate_size=8, num_experts=8)
    )


def _shard(model: nn.Module, how: str) -> nn.Module:
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    if how == "ep2":
        fsdp2.shard_experts(model, ep=2, mesh=mesh)
    for layer in model.model.layers:  # type: ignore[union-attr]
        if how == "rows":  # each expert's rows split over the ranks
            fsdp2.fully_shard(layer.mlp.experts, mesh=mesh, shard_placement_fn=lambda p: Shard(1))
        fsdp2.fully_shard(layer, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    return model


def _read_all(directory: Path) -> dict[str, torch.Tensor]:
    return {n: t for f in directory.glob("*.safetensors") for n, t in safetensors_torch.load_file(f).items()}


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


class _Recorder:
    """``safetensors.safe_open`` that counts, per rank, the elements read of each checkpoint tensor."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.read: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def __call__(self, *args: Any, **kwargs: Any) -> _Handle:
        return _Handle(self.real(*args, **kwargs), self)

    def note(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        self.read[dist.get_rank() if dist.is_initialized() else 0][name] += tensor.numel()
        return tensor


class _Handle:
    def __init__(self, inner: Any, recorder: _Recorder) -> None:
        self.inner, self.recorder = inner, recorder

    def __enter__(self) -> _Handle:
        self.inner.__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        self.inner.__exit__(*args)

    def keys(self) -> list[str]:
        return list(self.inner.keys())

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.recorder.note(name, self.inner.get_tensor(name))

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self.inner.get_slice(name), name, self.recorder)


class _Slice:
    def __init__(self, inner: Any, name: str, recorder: _Recorder) -> None:
        self.inner, self.name, self.recorder = inner, name, recorder

    def get_shape(self) -> list[int]:
        return list(self.inner.get_shape())

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.recorder.note(self.name, self.inner[index])


# ---- transformers' checkpoints in ----------------------------------------------------------------


def _load(reference: nn.Module, kind: str, how: str, path: str) -> dict[str, Any]:
    model = _shard(_reference(kind, seed=5), how)
    fsdp2.load_pretrained(model, path)
    held = sum(p.to_local().numel() for n, p in model.named_parameters() if ".experts." in n)
    placements = {tuple(p.placements) for n, p in model.named_parameters() if ".experts." in n}
    for (name, want), (_, got) in zip(
        reference.state_dict().items(), model.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(_full(got), want, **EXACT, msg=name)
    return {"held": held, "placements": placements}


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("how", ["dim0", "rows", "ep2"])
@pytest.mark.parametrize("kind", KINDS)
def test_transformers_checkpoint_loads_into_sharded_experts(
    kind: str, how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = _reference(kind)
    reference.save_pretrained(tmp_path, max_shard_size="20KB")
    names = set(_read_all(tmp_path))
    assert sum(bool(EXPERT.search(n)) for n in names) == 2 * 3 * 8  # per expert: gate, up, down
    recorder = _Recorder(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", recorder)
    results = run_threaded(WORLD, _load, reference, kind, how, str(tmp_path))
    for rank, result in enumerate(results):
        read = {n: k for n, k in recorder.read[rank].items() if EXPERT.search(n)}
        assert sum(read.values()) == result["held"] > 0  # exactly its shards' elements of the experts
        if how == "dim0":  # whole experts 2r, 2r+1: no other expert's tensor is opened
            assert {int(EXPERT.search(n).group(1)) for n in read} == {2 * rank, 2 * rank + 1}  # type: ignore[union-attr]
        if how == "ep2":  # ep rank r % 2 holds experts 4 (r % 2) ..; efsdp rank r // 2 half of them
            first = 4 * (rank % 2) + 2 * (rank // 2)
            assert {int(EXPERT.search(n).group(1)) for n in read} == {first, first + 1}  # type: ignore[union-attr]
            assert any("_StridedShard" in str(p) for p in result["placements"])


# ---- fsdp2's export out ----------------------------------------------------------------------------


def _export(reference: nn.Module, kind: str, directory: str, layout: str) -> None:
    fsdp2.save_pretrained(
        _shard(copy.deepcopy(reference), "ep2"), directory, max_shard_size="20KB", layout=layout
    )


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("layout", ["hub", "model"])
@pytest.mark.parametrize("kind", KINDS)
def test_export_loads_with_from_pretrained(kind: str, layout: str, tmp_path: Path) -> None:
    reference = _reference(kind)
    run_threaded(WORLD, _export, reference, kind, str(tmp_path / "fsdp2"), layout)
    written = _read_all(tmp_path / "fsdp2")
    if layout == "hub":  # what transformers' own save_pretrained writes, name for name and bit for bit
        reference.save_pretrained(tmp_path / "hf")
        torch.testing.assert_close(written, _read_all(tmp_path / "hf"), **EXACT)
    else:
        torch.testing.assert_close(written, reference.state_dict(), **EXACT)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp2", dtype=torch.float32)
    assert type(loaded) is type(reference)
    torch.testing.assert_close(loaded.state_dict(), reference.state_dict(), **EXACT)
    for result in run_threaded(WORLD, _load, reference, kind, "ep2", str(tmp_path / "fsdp2")):
        assert result["held"] > 0


# ---- errors ------------------------------------------------------------------------------------------


def _load_refused(kind: str, path: str) -> str:
    model = _shard(_reference(kind, seed=5), "ep2")
    before = {n: _full(v).clone() for n, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="names missing from the checkpoint") as error:
        fsdp2.load_pretrained(model, path)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(_full(value), before[name], **EXACT)
    return str(error.value)


def test_checkpoint_missing_an_expert_names_it(tmp_path: Path) -> None:
    reference = _reference("mixtral")
    reference.save_pretrained(tmp_path / "hf")
    tensors = _read_all(tmp_path / "hf")
    gone = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    del tensors[gone]
    safetensors_torch.save_file(tensors, tmp_path / "broken.safetensors")
    for text in run_threaded(WORLD, _load_refused, "mixtral", str(tmp_path / "broken.safetensors")):
        assert f"[{gone!r}]" in text  # that expert alone, not the stack it belongs in
    with pytest.raises(ValueError, match="layout must be 'hub'"):
        fsdp2.save_pretrained(reference, tmp_path / "out", layout="stacked")


def test_checkpoint_missing_a_projection_or_with_an_odd_expert(tmp_path: Path) -> None:
    """Unsharded, one process: every up_proj of a layer gone, one expert of another shape; both named."""
    reference = _reference("qwen3_moe")
    reference.save_pretrained(tmp_path / "hf")
    tensors = {k: v for k, v in _read_all(tmp_path / "hf").items() if not re.search(r"0\.mlp.*up_proj", k)}
    tensors["model.layers.1.mlp.experts.2.down_proj.weight"] = torch.zeros(3, 3)
    safetensors_torch.save_file(tensors, tmp_path / "broken.safetensors")
    model = _reference("qwen3_moe", seed=5)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="names missing from the checkpoint") as error:
        fsdp2.load_pretrained(model, tmp_path / "broken.safetensors")
    assert "['model.layers.0.mlp.experts.{0..7}.up_proj.weight']" in str(error.value)
    assert "experts.2.down_proj.weight (3, 3) cannot be stacked" in str(error.value)
    torch.testing.assert_close(model.state_dict(), before, **EXACT)


# ---- other conversions: run as transformers runs them, on whole tensors --------------------------


def _hrm() -> nn.Module:
    """HRM-text: its checkpoints fuse ``gate_up_proj`` and ``gqkv_proj``, split (``Chunk``) on load."""
    from transformers.models.hrm_text import HrmTextConfig, HrmTextForCausalLM

    torch.manual_seed(0)
    config = HrmTextConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        head_dim=8, num_layers_per_stack=1, H_cycles=1, L_cycles=1, max_position_embeddings=32,
    )  # fmt: skip
    return HrmTextForCausalLM(config)


def _load_hrm(reference: nn.Module, path: str, out: str) -> None:
    torch.manual_seed(5)
    model = type(reference)(reference.config)
    for stack in (model.model.H_module, model.model.L_module):  # type: ignore[union-attr]
        for layer in stack.layers:
            fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
    fsdp2.load_pretrained(model, path)
    for (name, want), (_, got) in zip(
        reference.state_dict().items(), model.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(_full(got), want, **EXACT, msg=name)
    with pytest.raises(ValueError, match="pass layout='model'"):
        fsdp2.save_pretrained(model, out, layout="hub")
    fsdp2.save_pretrained(model, out)  # the default: the model's names where the Hub's are not blocks
    assert any("gqkv_proj" not in name and "q_proj" in name for name in _read_all(Path(out)))


def test_fused_checkpoint_tensors_split_as_transformers_splits_them(tmp_path: Path) -> None:
    reference = _hrm()
    reference.save_pretrained(tmp_path / "hf")
    assert any("gqkv_proj" in name for name in _read_all(tmp_path / "hf"))  # fused in the file
    run_threaded(WORLD, _load_hrm, reference, str(tmp_path / "hf"), str(tmp_path / "out"))
    assert not any("gqkv_proj" in name for name in _read_all(tmp_path / "out"))  # the model's names
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    torch.testing.assert_close(loaded.state_dict(), reference.state_dict(), **EXACT)
