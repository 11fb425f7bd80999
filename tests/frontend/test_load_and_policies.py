"""Loading full state dicts, torch's policy objects, and meta-device init with CPU offload.

- ``load_state_dict`` with the unsharded model's plain full-size tensors, with and without
  ``assign=True``, uneven shards (world 4), HSDP and ``Shard(1)``: parameters equal the reference and
  training continues like it; wrong-shape plain tensors raise before anything changes (torch 2.13
  fails on plain tensors either way, and with ``assign=True`` after replacing parameters);
- torch's ``MixedPrecisionPolicy`` / ``CPUOffloadPolicy`` objects work where fsdp2's do, with
  identical numbers, and fsdp2 never imports torch's FSDP package to recognise them;
- building under ``torch.device("meta")`` with ``CPUOffloadPolicy`` (torch handles it), then
  materializing on the CPU and loading weights, trains like the reference.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import fsdp2
from tests._harness import assert_sharded_parity, run_threaded
from tests._training import EXACT, seeded, train_in_lockstep
from tests.models import make_input
from tests.shared.uneven import _Net


def _inputs(rank: int, step: int) -> torch.Tensor:
    return make_input((3, 4), rank, seed=step)


def _shard(model: _Net, layout: str) -> None:
    kwargs: dict[str, Any] = {}
    if layout == "hsdp":
        kwargs["mesh"] = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("r", "s"))
    if layout == "shard1":  # Shard(1) where the size divides, Shard(0) otherwise
        world = dist.get_world_size()
        kwargs["shard_placement_fn"] = lambda p: Shard(1) if p.ndim == 2 and p.size(1) % world == 0 else None
    fsdp2.fully_shard(model.a, **kwargs)
    fsdp2.fully_shard(model, **kwargs)


def _load_full(layout: str, assign: bool) -> None:
    ref = seeded(_Net)
    model = seeded(_Net)  # other values: the load must overwrite them
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-2.0)
    _shard(model, layout)
    model(_inputs(dist.get_rank(), 9)).sum().backward()  # after lazy init and a step's state
    model.zero_grad(set_to_none=True)
    full = {k: v.clone() for k, v in ref.state_dict().items()}
    result = model.load_state_dict(full, assign=assign)
    assert not result.missing_keys
    assert not result.unexpected_keys
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert isinstance(param, DTensor), name
        torch.testing.assert_close(param.full_tensor(), ref_param, **EXACT, msg=lambda m, n=name: f"{n}: {m}")
    train_in_lockstep(model, ref, _inputs, 3, assert_sharded_parity)


@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
@pytest.mark.parametrize(("layout", "world_size"), [("fsdp", 2), ("fsdp", 4), ("hsdp", 4), ("shard1", 2)])
def test_load_full_plain_state_dict(layout: str, world_size: int, assign: bool) -> None:
    run_threaded(world_size, _load_full, layout, assign)


def _load_wrong_shape(assign: bool) -> None:
    model = seeded(_Net)
    _shard(model, "fsdp")
    before = {name: (p, p.full_tensor()) for name, p in model.named_parameters()}
    bad = {k: v.to_local().clone() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    bad["head.bias"] = torch.zeros(5)  # one correct full tensor: still nothing may be loaded
    with pytest.raises(RuntimeError, match=r"Nothing was loaded.*set_model_state_dict\(model, sd, options="):
        model.load_state_dict(bad, assign=assign)
    for name, param in model.named_parameters():
        old_param, old_value = before[name]
        assert param is old_param, f"{name} was replaced"
        torch.testing.assert_close(param.full_tensor(), old_value, **EXACT)


@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
def test_load_wrong_shape_plain_tensors_raises_before_any_change(assign: bool) -> None:
    run_threaded(2, _load_wrong_shape, assign)


# ---- torch's policy objects -------------------------------------------------------------------


def _torch_policies_match_ours() -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffload
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import OffloadPolicy as TorchOffload

    base = seeded(_Net)
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    ours_mp = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    theirs_mp = TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fsdp2.fully_shard(ours.a, mp_policy=ours_mp, offload_policy=fsdp2.CPUOffloadPolicy(pin_memory=False))
    fsdp2.fully_shard(theirs.a, mp_policy=theirs_mp, offload_policy=TorchCPUOffload(pin_memory=False))
    fsdp2.fully_shard(ours, mp_policy=ours_mp, offload_policy=fsdp2.OffloadPolicy())
    fsdp2.fully_shard(theirs, mp_policy=theirs_mp, offload_policy=TorchOffload())
    for step in range(2):
        x = _inputs(dist.get_rank(), step)
        losses = [m(x).float().sum() for m in (ours, theirs)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[0], losses[1], **EXACT)
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor(), **EXACT, msg=name)
        assert theirs(x).dtype == torch.bfloat16  # the policy took effect
    with pytest.raises(TypeError, match=r"mp_policy must be a MixedPrecisionPolicy, got dict"):
        fsdp2.fully_shard(seeded(_Net), mp_policy={"param_dtype": torch.bfloat16})  # type: ignore[arg-type]


def test_torch_policy_objects_are_accepted() -> None:
    run_threaded(2, _torch_policies_match_ours)


def test_only_torchs_own_policy_classes_are_converted() -> None:
    """Recognised by class (looked up in ``sys.modules``, never imported by fsdp2), not by name."""
    from fsdp2.base._api import as_fsdp2_policy

    class MixedPrecisionPolicy:  # same name, unrelated class
        param_dtype = torch.bfloat16

    stranger = MixedPrecisionPolicy()
    assert as_fsdp2_policy(stranger) is stranger  # fully_shard then raises its TypeError
    ours = fsdp2.MixedPrecisionPolicy()
    assert as_fsdp2_policy(ours) is ours
    # fsdp2's own sources never import torch.distributed.fsdp: tests/house/test_layering.py.


# ---- meta-device init with CPU offload --------------------------------------------------------


def _meta_init_with_offload(pin_memory: bool) -> None:
    ref = seeded(_Net)
    with torch.device("meta"):
        model = _Net()
    policy = fsdp2.CPUOffloadPolicy(pin_memory=pin_memory)
    fsdp2.fully_shard(model.a, offload_policy=policy)
    fsdp2.fully_shard(model, offload_policy=policy)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    model.load_state_dict(ref.state_dict())  # full plain tensors (or reset_parameters + a seed)
    for param in model.parameters():
        assert param.to_local().device.type == "cpu"
    train_in_lockstep(model, ref, _inputs, 3, assert_sharded_parity)


@pytest.mark.parametrize("pin_memory", [False, True])
def test_meta_init_with_cpu_offload_trains(pin_memory: bool) -> None:
    run_threaded(2, _meta_init_with_offload, pin_memory)


def _meta_init_then_assign_full(offload: bool) -> None:
    ref = seeded(_Net)
    with torch.device("meta"):
        model = _Net()
    kwargs: dict[str, Any] = {"offload_policy": fsdp2.CPUOffloadPolicy(pin_memory=False)} if offload else {}
    fsdp2.fully_shard(model.a, **kwargs)
    fsdp2.fully_shard(model, **kwargs)
    # No to_empty: assign=True installs the loaded shards, which must land off the meta device.
    model.load_state_dict(ref.state_dict(), assign=True)
    for name, param in model.named_parameters():
        assert param.to_local().device.type == "cpu", name
    train_in_lockstep(model, ref, _inputs, 3, assert_sharded_parity)


@pytest.mark.parametrize("offload", [False, True], ids=["no-offload", "offload"])
def test_meta_init_then_assign_full_state_dict_trains(offload: bool) -> None:
    run_threaded(2, _meta_init_then_assign_full, offload)
