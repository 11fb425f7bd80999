"""The benchmark suite: every figure of docs/performance.md in one run (about 3 minutes on 2 cores).

(a) overhead per group per step by phase at world 1 (``step_overhead.py``), (b) step time at world 2
and 4 in gloo processes (also with debug mode's divergence guard on) and (d) bytes per collective
against the unpadded minimum (``scale.py``),
(c) peak memory per rank at world 4 and 8 against torch and the floor (``memory_floor.py``),
(e) a model of 64 tiny groups at world 4: collectives per step and step time, bucketed or not,
against torch (``bucketing.py`` under ``torchrun``), (f) the gradient reductions fsdp2 adds (accumulation
within a budget, a bf16 wire, deterministic sums) at world 2: bytes, held gradients and step time
against the default and torch (``reductions.py`` under ``torchrun``), (g) the cost of
``record_events()`` (what ``communication_report`` reads) on the step-time model of (b) at world 2:
step time with and without a recorder, and the recording work alone (``recording.py`` under
``torchrun``); (h) the reduce-scatter bytes of a mixture-of-experts model (``moe_bytes.py``).
Each part interleaves torch's ``fully_shard`` and fsdp2 (and an unsharded baseline
where it applies) round by round in one run; (g) interleaves recorded and plain steps.

Run:  python benchmarks/suite.py [--quick]      (or: nox -s bench)
Writes benchmarks/results/suite.json, suite.md (the tables) and suite.png (one panel per part),
next to each part's own JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import memory_floor  # noqa: E402 - the parts live next to this file
import scale  # noqa: E402
import step_overhead  # noqa: E402


def run_torchrun(script: str, nproc: int, out: Path, quick: bool) -> dict[str, Any]:
    """Run ``benchmarks/<script>.py`` under torchrun (gloo processes); its JSON figures."""
    path = out / f"{script}.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
        str(HERE / f"{script}.py"), "--json", str(path), "--rounds", "3" if quick else "5",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    result: dict[str, Any] = json.loads(path.read_text())
    return result


def tables(results: dict[str, Any]) -> str:
    lines = [f"Machine: {results['machine']}; suite time {results['seconds']:.0f} s.", ""]
    a = results["a_overhead"]
    per, ratio, local = (
        a["overhead_us_per_group_per_step"],
        a["ratio_fsdp2_over_torch"],
        a["ratio_fsdp2_local_step_over_torch"],
    )
    lines += [
        "(a) Overhead over the unsharded model, µs per group per step, world 1 "
        f"({a['config']['blocks']} blocks of dim {a['config']['dim']} + root, AdamW, clipping):",
        "",
        "| phase | torch | fsdp2 | fsdp2 / torch (p05-p95) | fsdp2 + local_step | / torch |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for phase in (*step_overhead.PHASES, "step"):
        r, rl = ratio[phase], local[phase]
        lines.append(
            f"| {phase} | {per['torch'][phase]:.0f} | {per['fsdp2'][phase]:.0f} | {r['median']:.2f} "
            f"({r['p05']:.2f}-{r['p95']:.2f}) | {per['fsdp2-local'][phase]:.0f} | {rl['median']:.2f} |"
        )
    b = results["b_scale"]
    lines += [
        "",
        "(b) Step time, gloo processes, slowest rank, median over rounds "
        f"({b['config']['blocks']} blocks of dim {b['config']['dim']}, AdamW):",
        "",
        "| world | DDP ms | torch ms | fsdp2 ms | fsdp2 / torch (p05-p95) | fsdp2 + local_step / torch "
        "| debug mode / fsdp2 (p05-p95) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for world, row in b["worlds"].items():
        ms, r, rl = row["step_ms"], row["ratio_fsdp2_over_torch"], row["ratio_fsdp2_local_over_torch"]
        d = row["ratio_debug_over_fsdp2"]  # FSDP2_DEBUG's divergence guard and watchdog
        lines.append(
            f"| {world} | {ms['ddp']:.1f} | {ms['torch']:.1f} | {ms['fsdp2']:.1f} | {r['median']:.2f} "
            f"({r['p05']:.2f}-{r['p95']:.2f}) | {rl['median']:.2f} | {d['median']:.2f} "
            f"({d['p05']:.2f}-{d['p95']:.2f}) |"
        )
    low = b["minimum_bytes"]
    lines += [
        "",
        "(d) Bytes per step in collective buffers on rank 0 (all-gather outputs, reduce-scatter inputs) "
        "against the unpadded minimum of the same schedule:",
        "",
        "| world | library | all-gather B | / minimum | reduce-scatter B | / minimum | all-reduce B |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for world, row in b["worlds"].items():
        for kind in ("torch", "fsdp2"):
            got = row["bytes"][kind]
            lines.append(
                f"| {world} | {kind} | {got['all_gather']:,} | {got['all_gather'] / low['all_gather']:.4f} | "
                f"{got['reduce_scatter']:,} | {got['reduce_scatter'] / low['reduce_scatter']:.4f} | "
                f"{got['all_reduce']:,} |"
            )
    c = results["c_memory"]
    lines += [
        "",
        "(c) Peak memory of rank 0 over a training step (live tensor bytes, thread ranks), against the floor "
        "(shards of parameters, gradients and AdamW states + the root and two blocks unsharded + "
        "activations):",
        "",
        "| world | floor MiB | torch MiB | torch / floor | fsdp2 MiB | fsdp2 / floor | fsdp2 / torch |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for world, row in c["worlds"].items():
        mib = lambda n: n / 2**20  # noqa: E731
        lines.append(
            f"| {world} | {mib(row['floor']['floor']):.2f} | {mib(row['torch']['peak_bytes']):.2f} | "
            f"{row['torch']['over_floor']:.3f} | {mib(row['fsdp2']['peak_bytes']):.2f} | "
            f"{row['fsdp2']['over_floor']:.3f} | {row['ratio_fsdp2_over_torch']:.3f} |"
        )
    e = results.get("e_bucketing")
    if e:
        lines += [
            "",
            f"(e) {e['config']['layers']} tiny groups (dim {e['config']['dim']}) at world {e['world_size']}, "
            "gloo processes: collectives and step time per step (median over rounds):",
            "",
            "| model | all-gathers | reduce-scatters | step ms | / torch |",
            "|---|---:|---:|---:|---:|",
        ]
        torch_ms = e["models"]["torch"]["step_ms"]
        for name, row in e["models"].items():
            lines.append(
                f"| {name} | {row['all_gather']:.0f} | {row['reduce_scatter']:.0f} | {row['step_ms']:.1f} | "
                f"{row['step_ms'] / torch_ms:.2f} |"
            )
        lines += _auto_lines(e.get("auto"))
    f = results.get("f_reductions")
    if f:
        cfg = f["config"]
        lines += [
            "",
            f"(f) Gradient reductions, {cfg['layers']} blocks of dim {cfg['dim']}, bf16 params / fp32 "
            f"reduce, {cfg['micro']} micro-batches + AdamW per step, world {f['world_size']}, "
            "gloo processes:",
            "",
            "| variant | reductions / step | bytes sent / step | held grad bytes | step ms | / fsdp2 "
            "| / torch |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, row in f["variants"].items():
            count = row.get("collectives")
            sent = row.get("sent_bytes")
            count_text = "-" if count is None else f"{count:.0f}"
            sent_text = "-" if sent is None else f"{sent:.0f}"
            lines.append(
                f"| {name} | {count_text} | {sent_text} | {row['held_bytes']:.0f} | {row['step_ms']:.1f} | "
                f"{row['over_fsdp2']:.2f} | {row['over_torch']:.2f} |"
            )
    g = results.get("g_recording")
    if g:
        cfg, ratio = g["config"], g["ratio_recorded_over_plain"]
        lines += [
            "",
            f"(g) record_events() on the model of (b) ({cfg['blocks']} blocks of dim {cfg['dim']}), world "
            f"{g['world_size']}, gloo processes: {g['events_per_step']} events, {g['spans_per_step']} spans "
            f"and {g['waits_per_step']} waits per step; building a step's communication report takes "
            f"{g['report_ms']:.2f} ms:",
            "",
            "| plain step ms | recorded step ms | recorded / plain (p05-p95) | recording work µs / step "
            "| / step |",
            "|---:|---:|---:|---:|---:|",
            f"| {g['plain_ms']:.1f} | {g['recorded_ms']:.1f} | {ratio['median']:.3f} "
            f"({ratio['p05']:.3f}-{ratio['p95']:.3f}) | {g['recording_us_per_step']:.0f} "
            f"| {100 * g['recording_fraction_of_step']:.2f}% |",
        ]
    h = results.get("h_moe_bytes")
    if h:
        lines += [
            "",
            f"(h) Reduce-scatter MB per step and rank, mixture of experts (2 layers of 8 experts, top-1, "
            f"dim {h['dim']}, world {h['world']}; torch and 'fsdp2 all' with "
            "set_reduce_scatter_unused_params):",
            "",
            "| routing | tokens / rank | experts idle everywhere / layer | torch | fsdp2 all | fsdp2 "
            "| fsdp2 / torch | after step 1 | agreements / step |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in h["rows"]:
            mb = {v: row[v]["bytes_per_step"] / 2**20 for v in ("torch", "fsdp2 all", "fsdp2")}
            later = row["fsdp2"]["bytes_per_step_after_first"] / row["torch"]["bytes_per_step_after_first"]
            lines.append(
                f"| {row['routing']} | {row['tokens_per_rank']} "
                f"| {row['fsdp2']['idle_experts_per_layer_step']:.2f} | {mb['torch']:.3f} "
                f"| {mb['fsdp2 all']:.3f} | {mb['fsdp2']:.3f} | {mb['fsdp2'] / mb['torch']:.3f} "
                f"| {later:.3f} | {row['fsdp2']['agreements_per_step']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def _auto_lines(auto: dict[str, Any] | None) -> list[str]:
    """The automatic caps of (e): what was measured and chosen, against the two targets."""
    if not auto or "targets" not in auto:
        return []
    parts = []
    for kind, label in (("all_gather", "all-gather"), ("reduce_scatter", "reduce-scatter")):
        row = auto[kind]
        if row["latency_us"] is None:
            parts.append(f"{label} cap {row['cap_mb']}")
        else:
            parts.append(
                f"{label} cap {row['cap_mb']:.2f} MiB (latency {row['latency_us']:.0f} µs, "
                f"{row['gb_per_s']:.2f} GB/s)"
            )
    targets = auto["targets"]
    over_best = targets.get("step_over_best_fixed")
    best = "" if over_best is None else f", step {over_best:.2f}x the best fixed cap's (target at most 1.05)"
    return [
        "",
        f"Automatic caps (measured in {auto['measure_s']:.2f} s): {'; '.join(parts)}; "
        f"{targets['fewer_collectives_than_torch']:.0f}x fewer collectives than torch (target at least 4)"
        f"{best}.",
    ]


def _peak_mib(row: dict[str, Any], kind: str) -> float:
    nbytes = row["floor"]["floor"] if kind == "floor" else row[kind]["peak_bytes"]
    return float(nbytes) / 2**20


def plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    a = results["a_overhead"]["overhead_us_per_group_per_step"]
    phases = list(step_overhead.PHASES)
    for offset, kind in ((-0.27, "torch"), (0.0, "fsdp2"), (0.27, "fsdp2-local")):
        axes[0].bar([i + offset for i in range(len(phases))], [a[kind][p] for p in phases], 0.27, label=kind)
    axes[0].set_xticks(range(len(phases)), phases)
    axes[0].set_title("(a) µs per group per step, world 1")
    axes[0].legend(fontsize=7)
    worlds = list(results["b_scale"]["worlds"])
    for offset, kind in ((-0.3, "ddp"), (-0.1, "torch"), (0.1, "fsdp2"), (0.3, "fsdp2-local")):
        values = [results["b_scale"]["worlds"][w]["step_ms"][kind] for w in worlds]
        axes[1].bar([i + offset for i in range(len(worlds))], values, 0.2, label=kind)
    axes[1].set_xticks(range(len(worlds)), [f"world {w}" for w in worlds])
    axes[1].set_title("(b) step time, ms")
    axes[1].legend(fontsize=7)
    mem = results["c_memory"]["worlds"]
    worlds = list(mem)
    for offset, kind in ((-0.25, "floor"), (0.0, "torch"), (0.25, "fsdp2")):
        values = [_peak_mib(mem[w], kind) for w in worlds]
        axes[2].bar([i + offset for i in range(len(worlds))], values, 0.25, label=kind)
    axes[2].set_xticks(range(len(worlds)), [f"world {w}" for w in worlds])
    axes[2].set_title("(c) peak MiB, rank 0")
    axes[2].legend(fontsize=7)
    e = results.get("e_bucketing")
    if e:
        names = list(e["models"])
        axes[3].bar(names, [e["models"][n]["step_ms"] for n in names])
        for i, n in enumerate(names):
            row = e["models"][n]
            count = row["all_gather"] + row["reduce_scatter"]
            axes[3].annotate(f"{count:.0f} coll.", (i, row["step_ms"]), ha="center")
        axes[3].set_title(f"(e) {e['config']['layers']} tiny groups, world {e['world_size']}: ms/step")
        axes[3].tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--skip-bucketing", action="store_true")
    parser.add_argument("--skip-reductions", action="store_true")
    parser.add_argument("--skip-recording", action="store_true")
    parser.add_argument("--skip-moe", action="store_true")
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    rounds = ["--rounds", "3"] if args.quick else []
    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "a_overhead": step_overhead.main(["--out", str(out), *(["--rounds", "4"] if args.quick else [])]),
        "b_scale": scale.main(["--out", str(out), *rounds]),
        "c_memory": memory_floor.main(["--out", str(out)]),
    }
    if not args.skip_bucketing:
        results["e_bucketing"] = run_torchrun("bucketing", 4, out, args.quick)
    if not args.skip_reductions:
        results["f_reductions"] = run_torchrun("reductions", 2, out, args.quick)
    if not args.skip_recording:
        results["g_recording"] = run_torchrun("recording", 2, out, args.quick)
    if not args.skip_moe:
        results["h_moe_bytes"] = run_torchrun("moe_bytes", 2, out, args.quick)
    results["seconds"] = time.perf_counter() - start
    (out / "suite.json").write_text(json.dumps(results, indent=2))
    text = tables(results)
    (out / "suite.md").write_text(text)
    plot(results, out / "suite.png")
    print(text)
    return results


if __name__ == "__main__":
    main()
