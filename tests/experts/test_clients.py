"""``fsdp2.shard_experts`` on real clients' MoE models: transformers 5 (routed) and torchtitan (counts).

Threads as ranks (4: ep 2 x efsdp 2). Each model is the client's own, built tiny; the only fsdp2 lines
are ``shard_experts(model, ep=2)`` and ``fully_shard`` of each decoder layer and the root. The first
losses and gradients must equal the unsharded model's on every rank's batch (gradients averaged over
the ranks): transformers' Qwen3-MoE and Mixtral compute in fp32, exact losses and gradients to fp32
rounding; torchtitan's experts compute in bf16 (grouped GEMMs), so theirs to bf16's.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from tests._harness import assert_sharded_parity, run_threaded
from tests.shared.titan_cpu import SEQ, VOCAB, stand_in_for_triton_kernels, tiny_qwen3_moe

WORLD, EP = 4, 2


def _transformers_model(kind: str) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    shape: dict[str, Any] = {
        "vocab_size": 64,
        "hidden_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "num_experts_per_tok": 2,
    }
    if kind == "qwen3_moe":
        config = Qwen3MoeConfig(**shape, intermediate_size=32, moe_intermediate_size=8, num_experts=8)
        return Qwen3MoeForCausalLM(config)
    return MixtralForCausalLM(MixtralConfig(**shape, intermediate_size=8, num_local_experts=8))


def _shard(model: torch.nn.Module, layers: Any) -> int:
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    experts = fsdp2.shard_experts(model, ep=EP, mesh=mesh)
    for layer in layers:
        fsdp2.fully_shard(layer, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    return len(experts)


def _average_grads(ref: torch.nn.Module) -> None:
    for param in ref.parameters():
        if param.grad is None:  # an expert no token of this rank reached
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)


def _transformers(kind: str, built: torch.nn.Module, directory: str) -> int:
    ref, model = copy.deepcopy(built), copy.deepcopy(built)
    sharded = _shard(model, model.model.layers)  # type: ignore[union-attr]
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(dist.get_rank()))
    loss, ref_loss = model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    loss.backward()
    ref_loss.backward()
    _average_grads(ref)
    assert_sharded_parity(ref, model, grads=True)
    # The plain model's checkpoint (each stack written whole), and back into another sharded model.
    fsdp2.save_pretrained(model, directory)
    other = copy.deepcopy(built)
    with torch.no_grad():
        for param in other.parameters():
            param.mul_(0.5)
    _shard(other, other.model.layers)  # type: ignore[union-attr]
    fsdp2.load_pretrained(other, directory)
    assert_sharded_parity(built, other)
    return sharded


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_transformers_moe_with_one_line_expert_parallelism(kind: str, tmp_path: Any) -> None:
    built = _transformers_model(kind)
    assert run_threaded(WORLD, _transformers, kind, built, str(tmp_path)) == [2] * WORLD  # both layers
    loaded = type(built).from_pretrained(str(tmp_path))  # transformers reads fsdp2's files
    for (name, param), (_, mine) in zip(built.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(param, mine), name


def _titan(built: torch.nn.Module) -> dict[str, float]:
    ref, model = copy.deepcopy(built), copy.deepcopy(built)
    _shard(model, model.layers.values())  # type: ignore[operator]
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(dist.get_rank()))
    positions = torch.arange(SEQ).repeat(2, 1)
    losses = []
    for m in (model, ref):
        logits = m(tokens[:, :-1], positions=positions)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        losses.append(loss)
        losses[-1].backward()
    _average_grads(ref)
    worst = {}
    for (name, ref_param), (_, param) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
        assert ref_param.grad is not None, name
        assert param.grad is not None, name
        full = param.grad.full_tensor()  # type: ignore[attr-defined]
        worst[name] = ((full - ref_param.grad).norm() / ref_param.grad.norm()).item()
    worst["loss"] = abs(losses[0].item() - losses[1].item())
    return worst


@pytest.mark.slow  # multi-rank and costly: the whole suite runs it, the quick loop leaves it
def test_torchtitan_moe_with_one_line_expert_parallelism() -> None:
    stand_in_for_triton_kernels()
    import torchtitan.models.qwen3 as qwen3

    built = tiny_qwen3_moe(qwen3, ep=False)
    for worst in run_threaded(WORLD, _titan, built):
        # bf16 experts: tokens meet in other groupings than in the unsharded model; an ep factor would be 1.0
        assert worst.pop("loss") < 1e-3
        assert max(worst.values()) < 1e-2, worst
