"""torchtitan 0.3.0's MoE models with expert parallelism, with fsdp2 behind torch's ``fully_shard`` name.

Two tiny models cut from torchtitan's debug flavours: qwen3's MoE (2 layers, 4 experts of top-2
routing, width 64) and deepseek_v3's (a dense layer, then an MoE layer with 4 routed experts, top 2,
and a shared one; MLA attention; marked slow). Each runs on 4 gloo processes with
``expert_parallel_degree=2`` through torchtitan's own ``parallelize_qwen3`` / ``parallelize_deepseekv3``:
its ``ExpertParallel`` puts the experts on the ``ep`` mesh (all-to-all token dispatch), and
``apply_fsdp_to_decoder`` shards each block with a ``shard_placement_fn`` that returns torch's private
``ShardPlacementResult`` with torch's ``FSDPMeshInfo`` objects (over ``efsdp`` for the experts, the dense
mesh for the rest), turns gradient division off and prefetches explicitly. Each model runs twice on
the same data and seed: once with torch's ``fully_shard``, once after ``fsdp2.patch_torch_fsdp()``.
Losses (2 AdamW steps) agree exactly; gradients (first backward) and parameters (end) agree bit for
bit for qwen3 and to the last bit for deepseek_v3; the first gradients match the unsharded model's on
every rank's batch (torchtitan's loss: summed cross-entropy over the global token count).

CPU adaptations, the same for both runs (see ``tests/end_to_end/test_clients_gloo.py``): the stand-in
for torchtitan's Triton kernels, the CPU device type, SDPA attention, and torch's run sets
``set_force_sum_reduction_for_comms(True)`` (gloo has no ``PREMUL_SUM``; at factor 1 the same sums).
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
from tests.shared.titan_cpu import DIM, SEQ, VOCAB, build_titan, stand_in_for_triton_kernels, tiny_qwen3_moe

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

WORLD, EP, BATCH = 4, 2, 2


def _tiny_deepseek_v3(dsv3: Any, ep: bool) -> torch.nn.Module:
    """torchtitan's deepseek_v3 debug flavour cut down: a dense layer, then an MoE layer with 4 routed
    experts (top 2) and a shared one, MLA attention, width 64."""
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.common.rope import ComplexRoPE

    dsv3.get_attention_config = lambda backend: ScaledDotProductAttention.Config()
    rope = ComplexRoPE.Config(
        dim=8,
        max_seq_len=4 * SEQ,
        theta=10000.0,
        scaling="yarn",
        rope_factor=40.0,
        beta_fast=32.0,
        beta_slow=1.0,
        original_seq_len=SEQ,
    )
    layers = dsv3._build_dsv3_layers(
        n_layers=2,
        n_dense_layers=1,
        dim=DIM,
        n_heads=4,
        q_lora_rank=0,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        mscale=0.70,
        dense_hidden_dim=64,
        moe_hidden_dim=32,
        num_experts=4,
        num_shared_experts=1,
        router_top_k=2,
        router_score_func="softmax",
        attn_backend="sdpa",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=rope,
    )
    config = dsv3.DeepSeekV3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=layers,
        mtp_layers=[],
    )
    if ep:
        from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

        set_deepseek_v3_sharding_config(config, enable_sp=False, enable_ep=True)
    return build_titan(config)


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(
        0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(10 * step + rank)
    )


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(SEQ).repeat(tokens.shape[0], 1)
    logits = model(tokens[:, :-1], positions=positions)
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="sum"
    )
    return loss / float(BATCH * SEQ * WORLD)  # the trainer all-reduces the label count


def _full(tensor: Any) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _run(impl: str, flavour: str, out: str) -> None:
    torch.set_num_threads(1)
    if impl == "fsdp2":
        import fsdp2

        fsdp2.patch_torch_fsdp()  # before torchtitan imports fully_shard, as a user would
    stand_in_for_triton_kernels()
    import importlib

    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import utils as dist_utils

    parallel_dims_module.device_type = "cpu"
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", expert_parallel_degree=EP)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)  # as torchtitan's trainer does
    parallel_dims = parallel_dims_module.ParallelDims.from_config(parallelism, WORLD)
    parallel_dims.build_mesh()
    package = importlib.import_module(f"torchtitan.models.{flavour}")
    tiny, parallelize = (
        (tiny_qwen3_moe, package.parallelize_qwen3)
        if flavour == "qwen3"
        else (_tiny_deepseek_v3, package.parallelize_deepseekv3)
    )
    model = parallelize(
        tiny(package, ep=True),
        parallel_dims=parallel_dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder=tempfile.mkdtemp(),
    )
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if impl == "torch":
        for module in fsdp_modules:
            module.set_force_sum_reduction_for_comms(True)
    moe_layer = next(layer for layer in model.layers.values() if getattr(layer, "moe_enabled", False))
    experts = moe_layer.moe.routed_experts.inner_experts.w1_EFD
    result: dict[str, Any] = {
        "losses": [],
        "fsdp_modules": len(fsdp_modules),
        "experts": (
            experts.device_mesh.mesh_dim_names,
            str(experts.placements),
            tuple(experts.to_local().shape),
        ),
    }
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        loss = _loss(model, _batch(dist.get_rank(), step))
        loss.backward()
        result["losses"].append(loss.item())
        if step == 0:
            result["grads"] = {name: _full(p.grad) for name, p in model.named_parameters()}
        optim.step()
        optim.zero_grad()
    result["params"] = {name: _full(p) for name, p in model.named_parameters()}
    if impl == "fsdp2" and dist.get_rank() == 0:  # the unsharded model on every rank's batch: first gradients
        reference = tiny(package, ep=False)
        for rank in range(WORLD):
            _loss(reference, _batch(rank, 0)).backward()
        result["reference_grads"] = {name: p.grad for name, p in reference.named_parameters()}
    with open(Path(out) / f"{impl}{dist.get_rank()}.pkl", "wb") as f:
        pickle.dump(result, f)


def _load(out: str, impl: str, rank: int) -> dict[str, Any]:
    with open(Path(out) / f"{impl}{rank}.pkl", "rb") as f:
        result: dict[str, Any] = pickle.load(f)
    return result


@pytest.mark.parametrize("flavour", ["qwen3", pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_torchtitan_moe_with_expert_parallelism_and_fsdp2_behind_torchs_name(flavour: str) -> None:
    with tempfile.TemporaryDirectory() as out:
        run_multiprocess(WORLD, _run, "torch", flavour, out)
        run_multiprocess(WORLD, _run, "fsdp2", flavour, out)
        # deepseek_v3: a few elements of a few gradients differ from torch's in the last bit (fsdp2's
        # reduce-scatter buffers are longer than torch's, by the usage row, and gloo's summation order
        # depends on the length); qwen3's agree bit for bit.
        tol = {"rtol": 0.0, "atol": 0.0} if flavour == "qwen3" else {"rtol": 1e-6, "atol": 1e-9}
        for rank in range(WORLD):
            theirs, ours = _load(out, "torch", rank), _load(out, "fsdp2", rank)
            for key in ("losses", "fsdp_modules", "experts"):
                assert ours[key] == theirs[key], (rank, key, ours[key], theirs[key])
            for key in ("grads", "params"):
                assert ours[key].keys() == theirs[key].keys()
                for name, value in ours[key].items():
                    torch.testing.assert_close(
                        value, theirs[key][name], **tol, msg=lambda m, k=key, n=name: f"{k} {n}: {m}"
                    )
        ours = _load(out, "fsdp2", 0)
        # One DTensor over (efsdp, ep): FSDP's rows of each ep rank's 2 experts, one per efsdp rank.
        assert ours["experts"] == (
            ("efsdp", "ep"),
            "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
            (1, 32, DIM),
        )
        for name, grad in ours["grads"].items():
            # The experts compute in bf16 (grouped GEMMs); tokens reach them in another order than in
            # the unsharded model. A gradient off by the ep size would be 2x.
            ref = ours["reference_grads"][name]
            ratio = (grad.norm() / ref.norm()).item()
            assert ratio == pytest.approx(1.0, rel=1e-3), (name, ratio)
