"""``fsdp2.check_replicas`` compares the replicas' fingerprints as tensors, whatever the replica count.

Counted: the Python values each rank builds from tensors (``Tensor.tolist``'s elements) inside
``check_replicas`` on 8 replicas of a 4-parameter model. Replicas that agree build none; one differing
parameter builds its 8 replicas' 3 sums (24) and its index (1), never ``parameters x replicas x 3``.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from tests._harness import run_threaded

_counting = threading.local()


def _counted_tolist(original: Any) -> Any:
    def tolist(self: torch.Tensor) -> Any:
        if getattr(_counting, "values", None) is not None:
            _counting.values += self.numel()
        return original(self)

    return tolist


def _values_built(base: nn.Module, flip: bool) -> int:
    mesh = init_device_mesh("cpu", (8, 1), mesh_dim_names=("replicate", "shard"))
    model = copy.deepcopy(base)
    fsdp2.fully_shard(model, mesh=mesh)
    if flip and mesh.get_local_rank("replicate") == 5:
        with torch.no_grad():
            model[0].weight.to_local().view(-1).view(torch.int32)[3] ^= 1 << 7
    _counting.values = 0
    if flip:
        named = r"0\.weight: replica\(s\) \[5\] differ from the other 7 on mesh dim 'replicate'"
        with pytest.raises(RuntimeError, match=named):
            fsdp2.check_replicas(model)
    else:
        fsdp2.check_replicas(model)
    values, _counting.values = _counting.values, None
    return int(values)


def test_python_values_built_are_zero_when_replicas_agree_and_one_parameters_worth_when_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.Tensor, "tolist", _counted_tolist(torch.Tensor.tolist))
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4))
    assert run_threaded(8, _values_built, base, False) == [0] * 8
    assert run_threaded(8, _values_built, base, True) == [25] * 8
