"""What ``fsdp2.record_events()`` costs a training step (it feeds ``communication_report``).

The step-time model of ``scale.py`` (8 blocks of dim 126 + root, AdamW) under fsdp2 in gloo
processes (run it under torchrun; world 2 in the suite). Round by round, the same model runs a few
whole steps without a recorder and as many inside ``record_events()``, alternating step by step;
each side's time is the slowest rank's, and the ratio recorded / plain is taken per round.
Its median and 5th-95th percentiles over the rounds are reported, with the spans and waits recorded
per step and the time one communication report of a step takes to build.

On a busy machine the step time's noise is larger than the recording's cost, so the recording work is
also timed on its own: rank 0 replays one recorded step's calls (an event per event, a span start
and end per span, a wait per wait) into an open recorder many times; that time over the plain step
time is the cost as a fraction of the step, free of the other work's noise.

Run:  torchrun --standalone --nproc-per-node 2 benchmarks/recording.py [--rounds 10 --steps 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from scale import build, train  # the step-time model and its timed steps
from step_overhead import _median_and_band

import fsdp2
from fsdp2.trace import _events as fsdp2_events  # the recording calls, timed on their own


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--dim", type=int, default=126)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3, help="steps per side per round")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file (rank 0)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=r"(?s).*(view tensor|is a view)")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(args.batch, args.seq, args.dim, generator=torch.Generator().manual_seed(rank))
    model, optim = build("fsdp2", args.blocks, args.dim)
    train(model, optim, x, 2)  # warm-up: lazy init, allocator
    with fsdp2.record_events() as events:
        train(model, optim, x, 1)
    start = time.perf_counter()
    report = fsdp2.communication_report(events)
    report_ms = (time.perf_counter() - start) * 1e3
    replay_us = _replay_us(events)
    rounds: list[dict[str, float]] = []
    for i in range(args.rounds):
        times = {"plain": 0.0, "recorded": 0.0}
        for j in range(args.steps):  # step by step, alternating: load on the machine hits both alike
            for side in ("plain", "recorded") if (i + j) % 2 == 0 else ("recorded", "plain"):
                if side == "plain":
                    times[side] += train(model, optim, x, 1) / args.steps
                else:
                    with fsdp2.record_events():
                        times[side] += train(model, optim, x, 1) / args.steps
        rounds.append(times)
    gathered: list[list[dict[str, float]] | None] = [None] * world
    dist.all_gather_object(gathered, rounds)
    if rank == 0:
        slowest = [
            {side: max(r[i][side] for r in gathered if r is not None) for side in ("plain", "recorded")}
            for i in range(args.rounds)
        ]
        ratio = _median_and_band([r["recorded"] / r["plain"] for r in slowest])
        plain_ms = statistics.median(r["plain"] for r in slowest) * 1e3
        result = {
            "machine": f"{platform.machine()}, torch {torch.__version__}, gloo",
            "world_size": world,
            "config": {k: getattr(args, k) for k in ("blocks", "dim", "batch", "seq", "rounds", "steps")},
            "plain_ms": plain_ms,
            "recorded_ms": statistics.median(r["recorded"] for r in slowest) * 1e3,
            "ratio_recorded_over_plain": ratio,
            "events_per_step": len(events),
            "spans_per_step": len(events.spans),
            "waits_per_step": len(events.waits),
            "recording_us_per_step": replay_us,
            "recording_fraction_of_step": replay_us / (plain_ms * 1e3),
            "report_ms": report_ms,
        }
        print(
            f"world {world}: step {plain_ms:.1f} ms plain, {result['recorded_ms']:.1f} ms recorded: "
            f"recorded / plain {ratio['median']:.3f} ({ratio['p05']:.3f}-{ratio['p95']:.3f}); "
            f"recording work {replay_us:.0f} us per step ({100 * replay_us / (plain_ms * 1e3):.2f}% of it) "
            f"for {len(events)} events, {len(events.spans)} spans, {len(events.waits)} waits; "
            f"report {report_ms:.2f} ms"
        )
        print(report)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
    del model, optim
    gc.collect()  # the model holds the process group: free it before destroying the group (scale.py)
    dist.destroy_process_group()


def _replay_us(recorded: fsdp2_events.EventList, repeats: int = 200) -> float:
    """Microseconds per step of the recording calls themselves, replaying one recorded step."""
    module = recorded.spans[0].module_fqn if recorded.spans else ""
    state = fsdp2.TrainingState.FORWARD
    best = float("inf")
    for _ in range(5):  # the fastest of a few batches: the least disturbed by the other processes
        with fsdp2.record_events():
            start = time.perf_counter()
            for _ in range(repeats):
                for event in recorded:
                    fsdp2_events.record(event.kind, event.module_fqn, event.training_state, None)
                for _ in recorded.spans:
                    t = fsdp2_events.span_start(None)
                    fsdp2_events.span_end(t, "all-gather", module, state, None)
                for _ in recorded.waits:
                    t = fsdp2_events.span_start(None)
                    fsdp2_events.wait_end(t, "all-gather", module, state, None)
            best = min(best, (time.perf_counter() - start) / repeats)
    return best * 1e6


if __name__ == "__main__":
    main()
