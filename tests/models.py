"""Small models shared by the multi-rank tests.

Owns: ``MLP``, ``DoubleLinear`` and a tiny decoder-only ``Transformer`` (``ModelArgs``,
``TransformerBlock``) sized so that threaded runs of 2-4 ranks stay fast.
Invariants: sizes are deliberately uneven in places (vocab 37, 9 positions) so that dim-0
sharding with padding is exercised by every test that uses the defaults.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class MLP(nn.Module):
    """Two linears with a ReLU in between: ``dim -> hidden_dim -> dim``."""

    def __init__(self, dim: int, hidden_dim: int | None = None) -> None:
        super().__init__()
        hidden = 4 * dim if hidden_dim is None else hidden_dim
        self.in_proj = nn.Linear(dim, hidden)
        self.out_proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(F.relu(self.in_proj(x)))


class DoubleLinear(nn.Module):
    """Two independent linears over the same input; returns both ReLU'd outputs."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.relu(self.lin1(x)), F.relu(self.lin2(x))


@dataclass
class ModelArgs:
    """Hyper-parameters of :class:`Transformer` (defaults are tiny and partly uneven)."""

    n_layers: int = 2
    vocab_size: int = 37
    dim: int = 16
    n_heads: int = 4
    max_seq_len: int = 9
    dropout_p: float = 0.0
    weight_tying: bool = False
    checkpoint_activations: bool = False


class SelfAttention(nn.Module):
    """Causal multi-head self-attention with separate q/k/v projections."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        if args.dim % args.n_heads:
            raise ValueError(
                f"dim must be divisible by n_heads: expected a multiple of {args.n_heads}, got {args.dim}"
            )
        self.n_heads = args.n_heads
        self.dropout_p = args.dropout_p
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = h.shape
        head_dim = dim // self.n_heads

        def split_heads(t: torch.Tensor) -> torch.Tensor:
            # (batch, seq, dim) -> (batch, heads, seq, head_dim)
            return t.view(batch, seq, self.n_heads, head_dim).transpose(1, 2)

        q, k, v = split_heads(self.wq(h)), split_heads(self.wk(h)), split_heads(self.wv(h))
        p = self.dropout_p if self.training else 0.0
        attn = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.wo(attn.transpose(1, 2).reshape(batch, seq, dim))


class FeedForward(nn.Module):
    """Position-wise GELU feed-forward; the hidden width is not a power of two."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        hidden = 3 * args.dim + 2
        self.w_in = nn.Linear(args.dim, hidden)
        self.w_out = nn.Linear(hidden, args.dim)
        self.dropout = nn.Dropout(args.dropout_p)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w_out(F.gelu(self.w_in(h))))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention then feed-forward."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = SelfAttention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.feed_forward = FeedForward(args)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attention(self.attention_norm(h))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Token + learned position embeddings, ``n_layers`` blocks, final norm, vocab projection."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.dropout = nn.Dropout(args.dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.weight_tying:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.size(1)
        if seq > self.args.max_seq_len:
            raise ValueError(f"sequence too long: expected at most {self.args.max_seq_len} tokens, got {seq}")
        positions = torch.arange(seq, device=tokens.device)
        h = self.dropout(self.tok_embeddings(tokens) + self.pos_embeddings(positions))
        for block in self.layers:
            # Non-reentrant checkpointing: the block's forward is re-run during backward.
            h = checkpoint(block, h, use_reentrant=False) if self.args.checkpoint_activations else block(h)
        return self.output(self.norm(h))


def make_tokens(args: ModelArgs, rank: int, batch: int = 2, seq: int | None = None) -> torch.Tensor:
    """Per-rank token ids from a generator seeded by ``rank`` (threads share the global RNG)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, args.vocab_size, (batch, seq or args.max_seq_len), generator=gen)


def make_input(shape: tuple[int, ...], rank: int, seed: int = 0) -> torch.Tensor:
    """Per-rank float input from a generator seeded by ``rank`` and ``seed``."""
    gen = torch.Generator().manual_seed(10_000 * seed + 7 + rank)
    return torch.randn(shape, generator=gen)


class SleepyLinear(nn.Linear):
    """A ``Linear`` whose forward sleeps ``seconds`` on rank ``slow_rank``: a straggler (more data to
    load, a throttled device, a noisy neighbour)."""

    def __init__(self, dim: int, seconds: float, slow_rank: int = 1) -> None:
        super().__init__(dim, dim)
        self.seconds, self.slow_rank = seconds, slow_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == self.slow_rank:
            time.sleep(self.seconds)
        return super().forward(x)


def sleepy_chain(seconds: float, dim: int = 8) -> nn.Sequential:
    """Three blocks (unsharded); rank 1 sleeps ``seconds`` in block ``1``'s forward."""
    return nn.Sequential(nn.Linear(dim, dim), SleepyLinear(dim, seconds), nn.Linear(dim, dim))


def sharded_sleepy_chain(seconds: float) -> nn.Module:
    """``sleepy_chain`` with each block and then the root sharded by fsdp2 (the same on every rank)."""
    import fsdp2

    torch.manual_seed(0)
    model = sleepy_chain(seconds)
    for layer in model:
        fsdp2.fully_shard(layer)
    return fsdp2.fully_shard(model)
