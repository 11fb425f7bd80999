"""Pipeline parallelism (``torch.distributed.pipelining``) over fsdp2 stages, against torch's ``fully_shard``.

Four gloo processes form a (pp 2, dp 2) mesh. Each schedule (GPipe, 1F1B, interleaved 1F1B, and the
two zero-bubble schedules, which split each backward into an input pass and a weight pass) trains the
same 8-block model for two AdamW steps, once with each stage module sharded by torch's
``fully_shard`` and once by fsdp2's. Every rank checks, for its own stages: the losses, the gradients
of every parameter and the parameters after the steps are bit-equal to torch's; the gradients match
the unsharded model's (micro-batch gradients summed, scaled by the schedule's 1 / micro-batches and
averaged over dp); and fsdp2 issues no more all-gathers or reduce-scatters than torch. Pipelining
recognises FSDP modules by torch's class, so these pass only because fsdp2 modules are
``torch.distributed.fsdp.FSDPModule`` instances that answer its per-micro-batch protocol
(``set_requires_gradient_sync``, ``set_reshard_after_backward``, ``set_is_last_backward`` and the
final manual post-backward).
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

# (schedule, reshard_after_forward). Zero-bubble schedules run with False (torchtitan's setting under
# pipeline parallelism): with True, pipelining looks the weights up while they are sharded and its
# weight pass computes nothing for them, in torch's fully_shard and fsdp2 alike (docs/parallelism.md).
CASES = [
    ("ScheduleGPipe", True),
    ("Schedule1F1B", False),
    ("Schedule1F1B", True),
    ("ScheduleInterleaved1F1B", False),
    ("ScheduleInterleaved1F1B", True),
    ("ScheduleInterleavedZeroBubble", False),
    ("ScheduleZBVZeroBubble", False),
]


def _train(impl: str, schedule_name: str, reshard_after_forward: bool, mesh: Any) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, schedules

    if impl == "fsdp2":
        import fsdp2

        fully_shard: Any = fsdp2.fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    pp, dp = mesh["pp"], mesh["dp"]
    pp_rank, pp_size = pp.get_local_rank(), pp.size()
    schedule_cls = getattr(schedules, schedule_name)
    single = issubclass(schedule_cls, schedules.PipelineScheduleSingle)
    n_stages = pp_size if single else 2 * pp_size
    if single:
        stage_ids = [pp_rank]
    elif "ZBV" in schedule_name:  # V shape: rank 0 holds the first and the last stage
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
            fully_shard(block, mesh=dp, reshard_after_forward=reshard_after_forward)
        fully_shard(module, mesh=dp, reshard_after_forward=reshard_after_forward)
        modules[first] = module
        # Static shapes: torch's fully_shard fails pipelining's dynamic shape inference.
        stages.append(
            PipelineStage(
                module, stage_id, n_stages, torch.device("cpu"), group=pp.get_group(), input_args=(x[:2],)
            )
        )
    schedule = schedule_cls(stages[0] if single else stages, n_microbatches=MICROBATCHES, loss_fn=loss)
    optim = torch.optim.AdamW([p for m in modules.values() for p in m.parameters()], lr=1e-2)
    out: dict[str, Any] = {"losses": [], "grads": [], "counts": collections.Counter(), "roots": len(modules)}
    for _ in range(STEPS):
        losses: list[torch.Tensor] = []
        args = (x,) if 0 in stage_ids else ()
        kwargs = {"target": target, "losses": losses} if n_stages - 1 in stage_ids else {}
        with C10dOps() as ops:  # a dispatch mode: a third of the profiler's cost, which recorded every op
            schedule.step(*args, **kwargs)
        for op, n in ops.counts.items():  # the collectives, not pipelining's sends and receives
            if op not in (torch.ops.c10d.send, torch.ops.c10d.recv_, torch.ops.c10d.recv_any_source_):
                out["counts"][op.__name__] += n
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
    for schedule_name, raf in CASES:
        case = f"{schedule_name} reshard_after_forward={raf}"
        theirs = _train("torch", schedule_name, raf, mesh)
        ours = _train("fsdp2", schedule_name, raf, mesh)
        for our_losses, their_losses in zip(ours["losses"], theirs["losses"], strict=True):
            assert len(our_losses) == len(their_losses)
            for a, b in zip(our_losses, their_losses, strict=True):
                torch.testing.assert_close(a, b, **exact, msg=lambda m, c=case: f"{c} loss: {m}")
        for our_grads, their_grads in zip(ours["grads"], theirs["grads"], strict=True):
            assert our_grads.keys() == their_grads.keys(), case
            for key, grad in our_grads.items():
                torch.testing.assert_close(
                    grad, their_grads[key], **exact, msg=lambda m, c=case, k=key: f"{c} {k}: {m}"
                )
        for (block, name), grad in ours["grads"][0].items():
            torch.testing.assert_close(
                grad, reference[block][name], msg=lambda m, c=case, b=block, n=name: f"{c} ref {b}.{n}: {m}"
            )
        for a, b in zip(ours["params"], theirs["params"], strict=True):
            torch.testing.assert_close(a, b, **exact, msg=lambda m, c=case: f"{c} params: {m}")
        for kind, n in ours["counts"].items():
            # fsdp2's first backward of each root (a stage) agrees on which submodules ran: one all-reduce
            extra = ours["roots"] if kind == "allreduce_" else 0
            shown = (case, kind, dict(ours["counts"]), dict(theirs["counts"]))
            assert n <= theirs["counts"][kind] + extra, shown
        assert ours["counts"]["_allgather_base_"] > 0, case  # the mode saw fsdp2's collectives
        assert ours["counts"]["_reduce_scatter_base_"] > 0, case


def test_pipelining_schedules_match_torch() -> None:
    run_multiprocess(4, _compare_schedules)
