"""``StackedMuon``: ``torch.optim.Muon`` that also takes stacks of matrices (``[E, m, n]`` expert weights).

Owns: the class, its checks of what it is given, and its step over plain tensors (each matrix of a
stack stepped by torch's own Muon as a parameter of its own). Does not own: its step over the
parameters ``fully_shard`` sharded (``_muon``'s, run from ``_whole_tensor``'s step hooks).

[Note: Why a class of its own]
torch 2.13's ``Muon.__init__`` raises ``ValueError`` ("Muon only supports 2D parameters") for any
parameter that is not a matrix, after ``Optimizer.__init__`` has taken the groups; nothing a caller
passes (an option, a param-group key) gets a 3-D stack past it. Mixture-of-experts models keep
their experts' weights as one ``[E, m, n]`` parameter, and Muon's update for it is each ``[m, n]``
matrix's own. ``StackedMuon`` is that optimizer: the same arguments and settings as
``torch.optim.Muon`` (checked by torch's own constructor), matrices and stacks of matrices accepted,
anything else refused when the optimizer is built or a group added. Its step over plain tensors is
torch's own, on each matrix of a stack as a view: the numbers of ``torch.optim.Muon`` over the ``E``
matrices as separate parameters. Its momentum buffer for a stack is one ``[E, m, n]`` tensor.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch

__all__ = ["StackedMuon"]


class StackedMuon(torch.optim.Muon):
    """``torch.optim.Muon`` over matrices and stacks of matrices (``[E, m, n]``: each ``[m, n]`` its own).

    Takes ``torch.optim.Muon``'s arguments, with its defaults and checks. Each matrix of a stack gets
    the update ``torch.optim.Muon`` gives a separate ``[m, n]`` parameter with the same gradient and
    momentum (its own Newton-Schulz orthogonalisation, its learning rate adjusted for ``[m, n]``).
    Over parameters ``fully_shard`` sharded, each matrix is orthogonalised once, on a rank that holds it
    whole (see docs/optimizers.md).

    Raises:
        ValueError: a parameter is neither a matrix nor a stack of matrices (1-D, 4-D or more), or a
            setting torch's ``Muon`` refuses; nothing is built.
    """

    def __init__(self, params: Any, *args: Any, **kwargs: Any) -> None:
        # torch's own checks and defaults of the settings, on a stand-in matrix.
        defaults = torch.optim.Muon([torch.empty(0, 0)], *args, **kwargs).defaults
        torch.optim.Optimizer.__init__(self, params, defaults)  # not Muon's: it refuses stacks

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``Optimizer.add_param_group``, after checking every parameter is a matrix or a stack of them."""
        params = param_group.get("params")
        if isinstance(params, torch.Tensor):
            params = [params]
        elif params is not None and not isinstance(params, set):  # a set: torch's own TypeError
            params = list(params)
        for param in params if isinstance(params, list) else ():
            if isinstance(param, torch.Tensor) and param.ndim not in (2, 3):
                raise ValueError(
                    f"StackedMuon takes matrices ([m, n]) and stacks of matrices ([E, m, n]); got a "
                    f"parameter of shape {tuple(param.shape)}. Give it to another optimizer (e.g. "
                    "torch.optim.AdamW for biases, norms and embeddings)."
                )
        super().add_param_group(param_group if params is None else {**param_group, "params": params})

    def _init_group(
        self,
        group: MutableMapping[str, Any],
        params_with_grad: list[torch.Tensor],
        grads: list[torch.Tensor],
        muon_momentum_bufs: list[torch.Tensor],
    ) -> bool:
        """Gather as torch's ``Muon`` does (its checks, its momentum buffers), then split each stack.

        A stack's parameter, gradient and momentum are replaced by their ``E`` matrices (views), so
        torch's update runs per matrix, in place on the stack.
        """
        has_complex = super()._init_group(group, params_with_grad, grads, muon_momentum_bufs)
        lists = (params_with_grad, grads, muon_momentum_bufs)
        split: tuple[list[torch.Tensor], ...] = ([], [], [])
        for entries in zip(*lists, strict=True):
            experts = entries[0].shape[0] if entries[0].ndim == 3 else None
            for out, tensor in zip(split, entries, strict=True):
                out.extend([tensor] if experts is None else [tensor[e] for e in range(experts)])
        for out, values in zip(lists, split, strict=True):
            out[:] = values
        return has_complex
