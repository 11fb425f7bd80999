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
    full = {n: p.full_tensor() for n, p in model.named_parameters()}  # all sharded DTensors between steps
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


# ---- kept weights are the sharded parameters between steps -------------------------------------------

_UNFROZEN = "blocks.1.base.weight"


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _unfreeze_and_train(base: Net, sharded: bool) -> dict:
    """One step with the backbone kept, then a kept weight unfrozen through ``get_parameter`` and added
    to the optimizer; every read between steps (and a weight sync) must see the trained values."""
    model = copy.deepcopy(base)
    if sharded:
        _shard(model)
        fsdp2.keep_frozen_gathered(model)
        sync = fsdp2.WeightSync(model, torch.float32)
    optim = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    reads = ("get_parameter", "parameters", "synced", "resharded")
    seen: dict[str, list[torch.Tensor]] = {how: [] for how in reads}
    consumer = {name: torch.zeros_like(_full(p)) for name, p in model.named_parameters()}
    for step in range(3):
        if step == 1:
            weight = model.get_parameter(_UNFROZEN)
            weight.requires_grad_(True)
            optim.add_param_group({"params": [weight]})
        ranks = [dist.get_rank()] if sharded else range(dist.get_world_size())
        for rank in ranks:
            model(_batch(rank, step, 0)).pow(2).mean().backward()
        if not sharded:
            for param in model.parameters():
                if param.grad is not None:
                    param.grad /= dist.get_world_size()
        optim.step()
        optim.zero_grad()
        seen["get_parameter"].append(_full(model.get_parameter(_UNFROZEN)))
        seen["parameters"].append(_full(dict(model.named_parameters())[_UNFROZEN]))
        if sharded:
            for name, tensor in sync.updates():
                consumer[name] = tensor.to_dense() if tensor.is_sparse else tensor.clone()
            seen["synced"].append(consumer[_UNFROZEN].clone())
            model.reshard()
            seen["resharded"].append(_full(model.get_parameter(_UNFROZEN)))
    return seen


def test_an_unfrozen_kept_weight_trains_and_is_never_read_stale() -> None:
    """Unfreezing a kept weight through the registered parameter and adding it to an optimizer trains
    it as the unsharded model does; parameters(), get_parameter(), reshard() and WeightSync all read it
    as trained after each step (a kept weight used to be registered unsharded between steps: a plain
    tensor that neither trained nor saw the optimizer's update)."""
    base = _base()
    expected = run_threaded(2, _unfreeze_and_train, base, False)[0]["get_parameter"]
    assert not torch.equal(expected[1], expected[0])  # it moves once unfrozen
    for seen in run_threaded(2, _unfreeze_and_train, base, True):
        for how in ("get_parameter", "parameters", "synced", "resharded"):
            for step, (got, ref) in enumerate(zip(seen[how], expected, strict=True)):
                torch.testing.assert_close(got, ref, rtol=0, atol=0, msg=f"{how}, step {step}")


def _sync_around_state_dicts(base: Net) -> list[list[str]]:
    """The RL loop: a sync before training, then after each step, with a load_state_dict and a
    state_dict between two of them."""
    model = _shard(copy.deepcopy(base))
    fsdp2.keep_frozen_gathered(model)
    sync = fsdp2.WeightSync(model, torch.float32)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    consumer = {}
    sent = []
    for step in range(4):
        received = list(sync.updates())
        consumer.update({n: t.to_dense() if t.is_sparse else t for n, t in received})
        sent.append([n for n, _ in received])
        for name, param in model.named_parameters():
            torch.testing.assert_close(consumer[name], _full(param), rtol=0, atol=0, msg=f"{step} {name}")
        if step == 3:
            break
        model(_batch(dist.get_rank(), step, 0)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
        if step == 1:
            model.load_state_dict(model.state_dict())
        if step == 2:
            model.state_dict()
    return sent


def test_weight_sync_across_steps_state_dicts_and_loads() -> None:
    for sent in run_threaded(2, _sync_around_state_dicts, _base()):
        assert len(sent[0]) == 10  # every parameter first
        assert all("base" not in name and not name.startswith("head") for name in sent[1] + sent[2] + sent[3])


def _write(model: Net, edited: dict[str, torch.Tensor], how: str, directory: str) -> None:
    """Every way a job writes new values into the parameters of a trained sharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if how == "set_model_state_dict":
        set_model_state_dict(model, edited, options=StateDictOptions(full_state_dict=True))
    elif how == "load_full_state_dict":
        fsdp2.load_full_state_dict(model, f"{directory}/model.safetensors")
    elif how == "load_pretrained":
        fsdp2.load_pretrained(model, directory)
    elif how == "into_state_dict":  # as DCP's in-place load writes: into state_dict()'s local tensors
        with torch.no_grad():
            for name, value in model.state_dict().items():
                mine = value.device_mesh.get_local_rank()
                value.to_local().copy_(edited[name].tensor_split(2)[mine][: value.to_local().shape[0]])
    else:  # a user's copy_ under no_grad
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(_shard_of(edited[name], param))


def _shard_of(full: torch.Tensor, like: DTensor) -> DTensor:
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements)


def _load_after_steps(base: Net, how: str, directory: str) -> None:
    """New weights written after two AdamW steps: the next forwards use them, not the kept copy."""
    edited = {k: v * 2 for k, v in base.state_dict().items()}
    ref = copy.deepcopy(base)
    ref.load_state_dict(edited)
    model = _shard(copy.deepcopy(base))
    fsdp2.keep_frozen_gathered(model)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(2):
        model(_batch(dist.get_rank(), step, 0)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    _write(model, edited, how, directory)
    for step in (8, 9):  # a forward with gradients, then one without
        x = _batch(0, step, 0)
        with torch.set_grad_enabled(step == 8):
            torch.testing.assert_close(model(x).detach(), ref(x).detach(), rtol=0, atol=0)


@pytest.mark.parametrize(
    "how", ["set_model_state_dict", "load_full_state_dict", "load_pretrained", "into_state_dict", "copy_"]
)
def test_a_load_after_steps_is_not_hidden_by_kept_weights(how: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import save_file

    base = _base()
    save_file({k: v * 2 for k, v in base.state_dict().items()}, tmp_path / "model.safetensors")
    run_threaded(2, _load_after_steps, base, how, str(tmp_path))


def _replicas_of_kept_weights(base: Net) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = copy.deepcopy(base)
    for block in model.blocks:
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    fsdp2.keep_frozen_gathered(model)
    model(_batch(mesh.get_local_rank("shard"), 0, 0)).pow(2).mean().backward()
    assert fsdp2.check_replicas(model) is None
    if mesh.get_local_rank("replicate") == 1:
        with torch.no_grad():  # a frozen weight drifted on one replica
            model.get_parameter("blocks.0.base.weight").to_local().add_(1e-3)
    with pytest.raises(RuntimeError, match="check_replicas") as error:
        fsdp2.check_replicas(model)
    return str(error.value)


def test_check_replicas_compares_kept_frozen_weights() -> None:
    for message in run_threaded(4, _replicas_of_kept_weights, _base()):
        assert "blocks.0.base.weight: replicas [0, 1] do not agree" in message


def _kept_storage(model: Net) -> int:
    """Bytes of the kept copies: the unsharded storage of the kept groups, between steps."""
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name  # every parameter is registered sharded between steps
    group_bytes = 0
    for module in [*model.blocks, model]:
        for group in module._get_fsdp_state().groups:
            if group.controls.keep_gathered:
                group_bytes += sum(
                    p.unsharded.data.untyped_storage().nbytes()
                    for p in group.fsdp_params
                    if p.unsharded.data is not None
                )
    return group_bytes


def _keep_calls(base: Net) -> list:
    model = _shard(copy.deepcopy(base))
    with pytest.raises(ValueError, match="not the root"):
        fsdp2.keep_frozen_gathered(model.blocks[0])  # before the first forward: still not the root
    first = fsdp2.keep_frozen_gathered(model)
    model(_batch(dist.get_rank(), 0, 0)).sum().backward()
    held = _kept_storage(model)
    again = fsdp2.keep_frozen_gathered(model)  # the same choice again
    with record_collectives(model) as log:
        model(_batch(dist.get_rank(), 1, 0)).sum().backward()
    regathered = log.sent_bytes("all_gather")
    none = fsdp2.keep_frozen_gathered(model, 0)  # a later call replaces the choice: none kept
    model(_batch(dist.get_rank(), 2, 0)).sum().backward()
    fsdp2.keep_frozen_gathered(model)
    model(_batch(dist.get_rank(), 3, 0)).sum().backward()
    before_reshard = _kept_storage(model)
    model.reshard()
    return [first, again, none, held, before_reshard, _kept_storage(model), regathered]


def test_calls_before_the_first_forward_and_again_and_reshard() -> None:
    for first, again, none, held, before, after, regathered in run_threaded(2, _keep_calls, _base()):
        assert len(first) == 6
        assert again == first
        assert none == []
        assert held > 0
        assert before == held
        assert after == 0  # model.reshard() frees the kept copies
        assert regathered > 0  # the second call re-kept: the first forward after it gathers again
