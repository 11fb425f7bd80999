"""torchtitan 0.3.0 on CPU: the stand-in for its Triton kernels, shared by the client tests.

Its model package imports its expert-parallel Triton kernels at import time; on a CPU-only machine a
stand-in module takes their place (the kernels are never called: the "standard" all-to-all
dispatcher does not use them).
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch

SEQ, VOCAB, DIM, HEAD_DIM = 16, 256, 64, 16

_TRITON_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
_KERNEL_NAMES = (
    "copy_full_counts_to_peers_kernel",
    "copy_rows_to_peers_kernel",
    "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel",
    "fill_dispatch_metadata_kernel",
    "invert_flat_indices_kernel",
    "reduce_topk_slots_kernel",
    "topk_scores_grad_kernel",
)


def stand_in_for_triton_kernels() -> None:
    """Put a module whose kernels raise in place of torchtitan's Triton kernels (before importing it)."""
    module = types.ModuleType(_TRITON_KERNELS)

    def unavailable(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("torchtitan's Triton kernels are not available on CPU")

    for name in _KERNEL_NAMES:
        setattr(module, name, unavailable)
    sys.modules[_TRITON_KERNELS] = module


def tiny_qwen3_moe(
    qwen3: Any, ep: bool, *, dim: int = DIM, experts: int = 4, moe_hidden: int = 32, seq: int = SEQ
) -> torch.nn.Module:
    """torchtitan's qwen3 debug MoE flavour cut down: 2 layers, 4 experts (top 2), width 64 (by default)."""
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.rope import CosSinRoPE

    qwen3.get_attention_config = lambda backend: ScaledDotProductAttention.Config()
    config = qwen3.Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=dim,
        norm=qwen3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT
        ),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=qwen3._LINEAR_INIT),
        layers=qwen3._build_qwen3_moe_layers(
            fuse_qkv=True,
            n_layers=2,
            dim=dim,
            n_heads=4,
            n_kv_heads=2,
            head_dim=HEAD_DIM,
            moe_hidden_dim=moe_hidden,
            num_experts=experts,
            top_k=2,
            attn_backend="sdpa",
            rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=seq, theta=1e6),
            moe_comm_backend="standard",
        ),
    )
    if ep:  # what the trainer's update_from_config does: the sharding configs, experts on ``ep``
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

        set_qwen3_sharding_config(config, enable_sp=False, enable_ep=True)
    return build_titan(config)


def build_titan(config: Any) -> torch.nn.Module:
    model: torch.nn.Module = config.build()
    gen = torch.Generator().manual_seed(0)  # the same values in every process
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(
                torch.ones_like(param) if param.ndim == 1 else torch.randn(param.shape, generator=gen) * 0.1
            )
    return model
