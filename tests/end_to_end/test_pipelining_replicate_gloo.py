"""Pipeline parallelism over ``replicate``d stages, fsdp2's ``replicate`` against torch's.

Four gloo processes form a (pp 2, dp 2) mesh. Every schedule torch 2.13 has for one or two stages
per rank (GPipe, 1F1B, interleaved 1F1B, and the zero-bubble ones, which split each backward into
an input pass and a weight pass: interleaved zero bubble, ZBV and DualPipeV, the last two V-shaped)
trains the same 8-block model for two AdamW steps, once with every stage's blocks and stage module
replicated over ``dp`` by torch's FSDP-based ``replicate`` and once by fsdp2's (only the name
swapped). Every rank checks, for its own stages: the losses, the gradients and the parameters after
the steps are bit-equal to torch's; the gradients match the unsharded model's (micro-batch gradients
summed, scaled by the schedule's 1 / micro-batches, averaged over dp); fsdp2 issues no all-gather or
reduce-scatter, and as many all-reduces per step as torch (one per group); the zero-bubble plans
hold weight passes. Unlike sharded stages, replicated ones need no ``reshard_after_forward=False``
for zero bubble: nothing is ever resharded, so the weight pass finds the parameters the forward
used. Pipelining reaches the state of a replicated stage through torch's ``replicate.state`` and
its ``ReplicateModule`` class, which fsdp2's modules answer.

The same spawned world then runs torchtitan's DDP pattern before 0.3.0 across the 4 processes
(``replicate`` on the embeddings, each block, ``[norm, output]`` as one group, the root; only the
name swapped): losses, gradients and parameters over 3 AdamW steps equal torch's ``replicate`` bit
for bit, and the unsharded model's within float32 rounding (its gradients are averaged one tensor
at a time, and gloo's ring sums 4 ranks in an order that follows each element's place in the
buffer). One spawned run: every schedule, the DDP pattern and both implementations.
"""

from __future__ import annotations

import collections
import copy
from typing import Any

import pytest
import torch
from torch import nn

from tests._harness import C10dOps, run_multiprocess
from tests.shared.pipeline_model import BLOCKS, MICROBATCHES, batch, full_model, loss, reference_grads

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

STEPS = 2
SCHEDULES = [
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleLoopedBFS",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
]
ZERO_BUBBLE = SCHEDULES[4:]
_P2P = ("send", "recv_", "recv_any_source_")


def _train(impl: str, schedule_name: str, mesh: Any) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, schedules

    if impl == "fsdp2":
        import fsdp2

        replicate: Any = fsdp2.replicate
    else:
        from torch.distributed._composable.replicate_with_fsdp import replicate
    pp, dp = mesh["pp"], mesh["dp"]
    pp_rank, pp_size = pp.get_local_rank(), pp.size()
    schedule_cls = getattr(schedules, schedule_name)
    single = issubclass(schedule_cls, schedules.PipelineScheduleSingle)
    n_stages = pp_size if single else 2 * pp_size
    if single:
        stage_ids = [pp_rank]
    elif schedule_name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):  # V: rank 0 has the first and last
        stage_ids = [pp_rank, n_stages - 1 - pp_rank]
    else:
        stage_ids = [pp_rank + pp_size * i for i in range(2)]
    per_stage = BLOCKS // n_stages
    full = full_model()
    x, target = batch(dp.get_local_rank())
    stages, modules = [], {}
    for stage_id in stage_ids:
        first = stage_id * per_stage
        module = nn.Sequential(*[copy.deepcopy(full[first + i]) for i in range(per_stage)])
        for block in module:
            replicate(block, mesh=dp)
        replicate(module, mesh=dp)
        modules[first] = module
        stages.append(
            PipelineStage(
                module, stage_id, n_stages, torch.device("cpu"), group=pp.get_group(), input_args=(x[:2],)
            )
        )
    schedule = schedule_cls(stages[0] if single else stages, n_microbatches=MICROBATCHES, loss_fn=loss)
    optim = torch.optim.AdamW([p for m in modules.values() for p in m.parameters()], lr=1e-2)
    order = getattr(schedule, "pipeline_order", None) or {}  # the multi-stage schedules' action plan
    kinds = {action.computation_type.value for action in order.get(pp_rank, []) if action is not None}
    out: dict[str, Any] = {"losses": [], "grads": [], "counts": [], "kinds": kinds}
    for _ in range(STEPS):
        losses: list[torch.Tensor] = []
        args = (x,) if 0 in stage_ids else ()
        kwargs = {"target": target, "losses": losses} if n_stages - 1 in stage_ids else {}
        with C10dOps() as ops:
            schedule.step(*args, **kwargs)
        out["counts"].append(
            collections.Counter({op.__name__: n for op, n in ops.counts.items() if op.__name__ not in _P2P})
        )
        out["losses"].append([value.detach() for value in losses])
        out["grads"].append(
            {
                (first + int(name.split(".")[0]), name.split(".", 1)[1]): p.grad.full_tensor()
                for first, m in modules.items()
                for name, p in m.named_parameters()
            }
        )
        optim.step()
        optim.zero_grad()
    out["params"] = [p.full_tensor() for m in modules.values() for p in m.parameters()]
    return out


def _compare_schedules() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    reference = reference_grads(mesh["dp"].size())
    exact = {"rtol": 0.0, "atol": 0.0}
    for case in SCHEDULES:
        theirs = _train("torch", case, mesh)
        ours = _train("fsdp2", case, mesh)
        if case in ZERO_BUBBLE:  # the backward really is split: input passes, then weight passes
            assert {"I", "W"} <= ours["kinds"], (case, ours["kinds"])
        for our_losses, their_losses in zip(ours["losses"], theirs["losses"], strict=True):
            assert len(our_losses) == len(their_losses), case
            for a, b in zip(our_losses, their_losses, strict=True):
                torch.testing.assert_close(a, b, **exact, msg=lambda m, c=case: f"{c} loss: {m}")
        for our_grads, their_grads in zip(ours["grads"], theirs["grads"], strict=True):
            assert our_grads.keys() == their_grads.keys(), case
            for key, grad in our_grads.items():
                torch.testing.assert_close(
                    grad, their_grads[key], **exact, msg=lambda m, c=case, k=key: f"{c} {k}: {m}"
                )
        for key, grad in ours["grads"][0].items():
            block, name = key
            torch.testing.assert_close(
                grad, reference[block][name], msg=lambda m, c=case, k=key: f"{c} ref {k}: {m}"
            )
        for a, b in zip(ours["params"], theirs["params"], strict=True):
            torch.testing.assert_close(a, b, **exact, msg=lambda m, c=case: f"{c} params: {m}")
        for step, (our_counts, their_counts) in enumerate(zip(ours["counts"], theirs["counts"], strict=True)):
            shown = (case, step, dict(our_counts), dict(their_counts))
            assert set(our_counts) == {"allreduce_"}, shown  # nothing gathered, nothing scattered
            assert our_counts == their_counts, shown  # one all-reduce per group, as torch's


def _schedules_then_ddp_pattern() -> None:
    from tests.shared.replicate_layouts import train_three

    _compare_schedules()
    train_three("torchtitan", False, threads=False)  # checks itself against torch and the reference


def test_pipelining_replicated_stages_and_the_ddp_pattern_match_torch_replicate() -> None:
    run_multiprocess(4, _schedules_then_ddp_pattern)
