"""A whole-matrix optimizer of a user's own with every kind of state the owner step moves.

``GramMomentum`` keeps, per matrix, a step count (a 0-dim tensor), a momentum shaped like the
parameter (its rows travel), the Gram matrix of the gradients (``[n, n]``: copied to every rank) and
a plain Python count (``scalar=False``: none); its update needs the whole matrix (the Gram matrix's
trace). Declared ``"whole_tensor"`` by the tests that use it, so fsdp2 steps it on owner ranks
(the general owner step, ``optim._owner_exchange``); its matrices must not be square (a square Gram
matrix would be taken for a parameter-shaped state).
"""

from __future__ import annotations

from typing import Any

import torch


class GramMomentum(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float, *, scalar: bool = True) -> None:
        super().__init__(params, {"lr": lr})
        self.scalar = scalar  # keep the plain count (it changes every step, so it is announced every step)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["momentum"] = torch.zeros_like(param)
                    state["gram"] = torch.zeros(param.shape[1], param.shape[1], dtype=param.dtype)
                    if self.scalar:
                        state["count"] = 0
                state["step"] += 1
                if self.scalar:
                    state["count"] += 1
                state["momentum"].mul_(0.9).add_(param.grad)
                state["gram"].add_(param.grad.T @ param.grad)
                scale = 1.0 / (1.0 + state["gram"].trace().sqrt())
                update = state["momentum"] @ (torch.eye(param.shape[1]) - 0.01 * state["gram"])
                param.add_(update * scale, alpha=-group["lr"] / float(state["step"]))
