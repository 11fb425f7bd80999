"""transformers 5's Qwen3-MoE with ``fsdp2.shard_experts`` on 4 gloo processes, against torch and reference.

One spawned world; each process trains the same tiny Qwen3-MoE (8 experts, top 2, fp32) twice on the
same batches: with torch's ``fully_shard`` (each rank gathers whole expert stacks: torch has no
expert parallelism) and with ``fsdp2.shard_experts(model, ep=2)`` then fsdp2's ``fully_shard`` (ep 2 x
efsdp 2: 4 experts a rank, the tokens exchanged by all-to-all). Rank 0 also runs the unsharded model on
every rank's batch. Over 2 AdamW steps: the first losses are equal bit for bit (the tokens meet the
same weights), and the first gradients of both equal the reference's (gradients of the mean over the
4 ranks' batches) to fp32 rounding.
"""

from __future__ import annotations

import pickle
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._harness import run_multiprocess

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300)]

WORLD, EP = 4, 2


def _model() -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
    )
    return Qwen3MoeForCausalLM(config)


def _ids(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(10 * step + rank))


def _train(impl: str) -> dict[str, Any]:
    import fsdp2

    model = _model()
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = fsdp2.fully_shard  # type: ignore[assignment]
        fsdp2.shard_experts(model, ep=EP)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out: dict[str, Any] = {"losses": []}
    for step in range(2):
        ids = _ids(dist.get_rank(), step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out["losses"].append(loss.item())
        if step == 0:
            out["grads"] = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        optim.step()
        optim.zero_grad()
    return out


def _run(directory: str) -> None:
    torch.set_num_threads(1)
    result = {impl: _train(impl) for impl in ("torch", "fsdp2")}
    if dist.get_rank() == 0:
        reference = _model()
        for rank in range(WORLD):
            ids = _ids(rank, 0)
            (reference(input_ids=ids, labels=ids).loss / WORLD).backward()
        result["reference"] = {name: p.grad for name, p in reference.named_parameters()}
    with open(Path(directory) / f"{dist.get_rank()}.pkl", "wb") as f:
        pickle.dump(result, f)


def test_transformers_qwen3_moe_with_shard_experts_against_torch_and_the_reference() -> None:
    with tempfile.TemporaryDirectory() as directory:
        run_multiprocess(WORLD, _run, directory)
        results = [pickle.loads((Path(directory) / f"{rank}.pkl").read_bytes()) for rank in range(WORLD)]
    for result in results:
        assert result["fsdp2"]["losses"][0] == result["torch"]["losses"][0]
        ours, theirs = result["fsdp2"]["losses"][1], result["torch"]["losses"][1]
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=0)
    reference = results[0]["reference"]
    for impl in ("torch", "fsdp2"):
        for name, grad in results[0][impl]["grads"].items():
            torch.testing.assert_close(grad, reference[name], msg=lambda m, i=impl, n=name: f"{i} {n}: {m}")
