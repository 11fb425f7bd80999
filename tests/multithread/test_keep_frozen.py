"""``fsdp2.keep_frozen_gathered``: a LoRA model's frozen backbone gathered once, numbers unchanged.

The reference is the same sharded model without it (exact: the same collectives on the same values)
and, for the choice and the counts, what the model holds: the frozen weights are all-gathered at the
first step only, the adapters (trainable, in the same modules, as PEFT builds them) every step.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2.testing import record_collectives
from tests._harness import run_threaded


class LoRALinear(nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.base = nn.Linear(n_in, n_out)
        self.base.requires_grad_(False)  # the frozen backbone
        self.lora_a = nn.Parameter(torch.randn(4, n_in) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(n_out, 4) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([LoRALinear(16, 24), LoRALinear(24, 16)])
        self.head = nn.Linear(16, 3)  # frozen too (a classifier kept as is)
        self.head.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _base() -> Net:
    torch.manual_seed(0)  # built once, in the main thread
    return Net()


def _shard(model: Net) -> Net:
    for block in model.blocks:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    return model


def _batch(rank: int, step: int, micro: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(1000 * rank + 10 * step + micro))


def _train(base: Net, budget: int | str | None) -> dict:
    model = _shard(copy.deepcopy(base))
    kept = [] if budget == "off" else fsdp2.keep_frozen_gathered(model, budget)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)  # frozen ones have no gradients: skipped
    losses, gathered = [], []
    for step in range(3):
        with record_collectives(model) as log:
            for micro in range(2):  # two micro-batches, the first without gradient sync
                model.set_requires_gradient_sync(micro == 1)
                loss = model(_batch(dist.get_rank(), step, micro)).pow(2).mean()
                loss.backward()
                losses.append(loss.detach())
        optim.step()
        optim.zero_grad()
        gathered.append(log.sent_bytes("all_gather"))
    # kept parameters are registered unsharded between steps (plain tensors), the others as DTensors
    full = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in model.named_parameters()}
    return {"kept": kept, "losses": losses, "params": full, "gathered": gathered}


def test_the_frozen_backbone_is_gathered_once_and_the_numbers_do_not_change() -> None:
    base = _base()
    kept, plain = run_threaded(2, _train, base, None), run_threaded(2, _train, base, "off")
    frozen = ["blocks.0.base.weight", "blocks.1.base.weight", "head.weight", "blocks.0.base.bias"]
    for ours, ref in zip(kept, plain, strict=True):
        assert ours["kept"][:4] == frozen  # largest first: 24x16, 16x24 (name order), 3x16, 24
        assert len(ours["kept"]) == 6  # and the two other biases
        torch.testing.assert_close(ours["losses"], ref["losses"], rtol=0, atol=0)
        for name, value in ours["params"].items():
            torch.testing.assert_close(value, ref["params"][name], rtol=0, atol=0, msg=name)
        # the frozen weights are gathered at the first use only; then each step gathers the adapters
        assert ref["gathered"][0] == ref["gathered"][1] == ref["gathered"][2]
        assert ours["gathered"][0] > ours["gathered"][1] == ours["gathered"][2]
        assert ours["gathered"][1] < ref["gathered"][1] / 2


def test_a_budget_keeps_the_largest_that_fit_and_zero_keeps_none() -> None:
    base = _base()
    weight_bytes = 24 * 16 * 4  # one of the two largest frozen weights, fp32, unsharded
    for ours in run_threaded(2, _train, base, weight_bytes + 100):
        # the other 24x16 weight and the head's do not fit; a smaller bias does
        assert ours["kept"] == ["blocks.0.base.weight", "blocks.0.base.bias"]
    for ours, ref in zip(run_threaded(2, _train, base, 0), run_threaded(2, _train, base, "off"), strict=True):
        assert ours["kept"] == []
        assert ours["gathered"] == ref["gathered"]


def _written_in_place(base: Net) -> list[torch.Tensor]:
    """Kept weights changed three ways between forwards: every later output must see the new values."""
    model = _shard(copy.deepcopy(base))
    fsdp2.keep_frozen_gathered(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.5)  # the sharded parameters, frozen ones too
    head_weight = model.head.weight  # the sharded parameter, as the optimizer holds it
    x = _batch(0, 0, 0)  # the same on every rank: the averaged gradient is this one
    outputs = [model(x).detach()]
    with torch.no_grad():  # 1. its shard written in place (as init_like_unsharded or an optimizer does)
        head_weight.to_local().mul_(2)
    outputs.append(model(x).detach())
    # 2. loaded from a state dict
    state = {k: v * 0.5 if k == "blocks.0.base.weight" else v for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    outputs.append(model(x).detach())
    # 3. unfrozen through the registered tensor (the unsharded one while kept), then trained
    model.blocks[1].base.weight.requires_grad_(True)
    model(x).pow(2).sum().backward()
    optim.step()
    optim.zero_grad()
    outputs.append(model(x).detach())
    return outputs


def _unsharded_reference(base: Net) -> list[torch.Tensor]:
    model = copy.deepcopy(base)
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    x = _batch(0, 0, 0)
    outputs = [model(x).detach()]
    with torch.no_grad():
        model.head.weight.mul_(2)
    outputs.append(model(x).detach())
    with torch.no_grad():
        model.blocks[0].base.weight.mul_(0.5)
    outputs.append(model(x).detach())
    model.blocks[1].base.weight.requires_grad_(True)
    model(x).pow(2).sum().backward()
    optim.step()
    outputs.append(model(x).detach())
    return outputs


def test_kept_weights_written_after_are_gathered_again() -> None:
    """The sharded model without keep_frozen_gathered serves the stale weight after edit 1 (its root
    keeps its parameters after forward, as torch's does); the kept one gathers again."""
    base = _base()
    expected = _unsharded_reference(base)
    for ours in run_threaded(2, _written_in_place, base):
        for index, (out, ref_out) in enumerate(zip(ours, expected, strict=True)):
            torch.testing.assert_close(out, ref_out, rtol=0, atol=0, msg=f"output {index}")
        assert not torch.equal(ours[0], ours[1])  # the edits changed the outputs


def _misuse() -> None:
    model = _shard(_base())
    model(torch.zeros(1, 16))  # the root's lazy init: the blocks are not roots
    with pytest.raises(ValueError, match="not the root"):
        fsdp2.keep_frozen_gathered(model.blocks[0])
    with pytest.raises(ValueError, match=">= 0"):
        fsdp2.keep_frozen_gathered(model, -1)
    with pytest.raises(TypeError, match="int or None"):
        fsdp2.keep_frozen_gathered(model, True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a fully_shard module"):
        fsdp2.keep_frozen_gathered(nn.Linear(2, 2))


def test_misuse_is_refused() -> None:
    run_threaded(2, _misuse)
