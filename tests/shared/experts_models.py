"""Small mixture-of-experts models in both experts conventions, for the expert-parallelism tests.

``RoutedExperts`` is called as transformers 5's experts modules are (``hidden_states, top_k_index,
top_k_weights``: it returns the weighted sum of each token's experts); ``CountedExperts`` as torchtitan's
``GroupedExperts`` (rows sorted by expert and the count of each). ``Net``: an input projection, MoE
blocks (router, softmax, top-k, renormalised weights) and a head. Single-process, these are the
reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DIM, HIDDEN = 4, 3


class RoutedExperts(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * HIDDEN, DIM))
        self.down_proj = nn.Parameter(torch.empty(experts, DIM, HIDDEN))

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for expert in range(self.num_experts):
            token, slot = torch.where(top_k_index == expert)
            if token.numel() == 0:
                continue
            gate, up = F.linear(hidden_states[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y)
        return out


class CountedExperts(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.w1 = nn.Parameter(torch.empty(experts, HIDDEN, DIM))
        self.w2 = nn.Parameter(torch.empty(experts, DIM, HIDDEN))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1, w2 = self.w1, self.w2
        outs = []
        for expert, rows in enumerate(x.split(num_tokens_per_expert.tolist())):
            outs.append(F.linear(torch.relu(F.linear(rows, w1[expert])), w2[expert]))
        return torch.cat(outs) if outs else x[:0]


class MoE(nn.Module):
    def __init__(self, experts: int, top_k: int, counted: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(DIM, experts, bias=False)
        self.experts: nn.Module = CountedExperts(experts) if counted else RoutedExperts(experts)
        self.counted = counted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.router(x).softmax(-1)
        weights, index = scores.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        if not self.counted:
            return x + self.experts(x, index, weights)
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.router.out_features)
        rows = self.experts(x[order // self.top_k], counts)
        rows = rows * weights.reshape(-1)[order, None]
        return x + torch.zeros_like(x).index_add(0, order // self.top_k, rows)


class Net(nn.Module):
    def __init__(self, experts: int, top_k: int = 2, counted: bool = False, layers: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(MoE(experts, top_k, counted) for _ in range(layers))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
