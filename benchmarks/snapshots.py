"""Memory snapshots (``fsdp2.Snapshots``): their cost per step, and a restart from them against one from disk.

The main job (``examples/train.py``) runs in 4 gloo processes as 2 simulated nodes of 2 ranks, each
node with its own snapshot directory under ``/dev/shm``, for two model sizes: the example's default
(``--dim 128 --layers 4``, 0.82M parameters) and a larger one (``--dim 384 --layers 6``). Per size:

- a run without snapshots, and runs with ``--snapshot-every 1`` and ``10``: the median step time
  (from one step's forward to the next's, rank 0), and per snapshot (``Snapshots.last``, every rank's
  mean): seconds on the training path (the capture, plus any wait for the previous copy), seconds in
  all (capture, file, the buddy's copy, the commit), bytes sent to the buddy and host bytes kept
  (own file + the buddy copies it keeps);
- recovery: a run with ``--snapshot-every 10 --ckpt-dir D --ckpt-every 10`` is killed (SIGKILL,
  every rank) in step 21's forward, node 1's directory is deleted, and 2 ranks restart twice: from
  memory (the example's default with ``--snapshot-every``) and from the DCP checkpoint on disk
  (``--resume`` without snapshots). Reported: from the restart's spawn to the end of its first step,
  and the restore's own seconds (``Restored.seconds`` / the DCP load's).

Run:  python benchmarks/snapshots.py [--steps 30]   (about 6 minutes on a 2-core VM)
Writes benchmarks/results/snapshots.json and prints a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests._harness import run_multiprocess  # noqa: E402 - after the path

SIZES = {
    "example (0.82M)": ["--dim", "128", "--layers", "4", "--heads", "4"],
    "larger": ["--dim", "384", "--layers", "6", "--heads", "6"],
}


def _train_module() -> Any:
    spec = importlib.util.spec_from_file_location("bench_train", REPO / "examples" / "train.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _record(out: str, root: str, argv: list[str], kill_at: int | None) -> None:
    """One rank of a run: step times and snapshot figures to ``out`` (rank 0: the ranks' means)."""
    import fsdp2
    import fsdp2.resilience._snapshots as snapshots_module

    train = _train_module()
    rank = dist.get_rank()
    os.environ["FSDP2_SNAPSHOT_DIR"] = f"{root}/node{rank // 2}"
    os.environ["FSDP2_SNAPSHOT_JOB"] = "bench"  # the killed run and its restart are one job
    starts: list[float] = []
    stats: list[Any] = []
    committed: set[int] = set()
    lock = threading.Condition()
    spawn_time = float(os.environ.get("BENCH_SPAWN", "0"))
    original_save = fsdp2.Snapshots.save

    def save(self: Any, step: int, *, force: bool = False) -> bool:
        before = self.last
        started = original_save(self, step, force=force)
        if self.last is not before and self.last is not None:
            stats.append(self.last)
        return started

    def stage(name: str, step: int) -> None:
        if name == "committed":
            with lock:
                committed.add(step)
                lock.notify_all()

    def phase(name: str, step: int) -> None:
        if name != "forward":
            return
        starts.append(time.time())
        if kill_at is not None and step == kill_at:
            with lock:
                lock.wait_for(lambda: kill_at - 1 in committed, timeout=60)
            os.kill(os.getpid(), signal.SIGKILL)

    restores: list[float] = []
    original_restore, original_load = fsdp2.Snapshots.restore, train.load_checkpoint

    def timed(function: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            result = function(*args, **kwargs)
            restores.append(time.perf_counter() - start)
            return result

        return call

    fsdp2.Snapshots.save = save  # type: ignore[method-assign]
    fsdp2.Snapshots.restore = timed(original_restore)  # type: ignore[method-assign]
    train.load_checkpoint = timed(original_load)
    snapshots_module._stage = stage  # noqa: SLF001 - the copy's stages, as the tests watch them
    train.phase = phase
    train.main(argv)
    fsdp2.Snapshots.save = original_save  # type: ignore[method-assign]
    fsdp2.Snapshots.restore = original_restore  # type: ignore[method-assign]
    steps = [b - a for a, b in itertools.pairwise(starts)][2:]  # after the first steps
    mine = {
        "step_s": statistics.median(steps) if steps else None,
        "restore_s": sum(restores) if restores else None,
        "first_step_end_s": (starts[1] - spawn_time) if len(starts) > 1 and spawn_time else None,
        "critical_s": statistics.mean(s.critical_s for s in stats) if stats else None,
        "total_s": statistics.mean(s.total_s for s in stats) if stats else None,
        "bytes_sent": statistics.mean(s.bytes_sent for s in stats) if stats else None,
        "host_bytes": statistics.mean(s.host_bytes for s in stats) if stats else None,
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        merged = {
            key: (statistics.mean(v[key] for v in gathered) if gathered[0][key] is not None else None)
            for key in mine
        }
        merged["step_s"] = mine["step_s"]
        Path(out).write_text(json.dumps(merged))


def _run(world: int, out: Path, root: Path, argv: list[str], kill_at: int | None = None) -> dict[str, Any]:
    os.environ["BENCH_SPAWN"] = str(time.time())
    try:
        run_multiprocess(world, _record, str(out), str(root), argv, kill_at)
    except Exception:  # the killed run ends in an exception by design
        if kill_at is None:
            raise
        return {}
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    base = Path(
        tempfile.mkdtemp(prefix="fsdp2-bench-snap-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    )
    results: dict[str, Any] = {}
    try:
        for label, size in SIZES.items():
            common = ["--steps", str(args.steps), *size, "--seq-len", "64", "--batch-size", "16"]
            row: dict[str, Any] = {}
            for every in (0, 1, 10):
                root = base / f"{label}-{every}"
                row[f"N={every}"] = _run(
                    4, base / "out.json", root, [*common, "--snapshot-every", str(every)]
                )
            killed = base / f"{label}-killed"
            argv = [
                *common,
                "--snapshot-every",
                "10",
                "--ckpt-dir",
                str(killed / "ckpt"),
                "--ckpt-every",
                "10",
            ]
            _run(4, base / "out.json", killed, argv, kill_at=20)
            shutil.rmtree(killed / "node1", ignore_errors=True)
            row["restart from memory"] = _run(
                2, base / "out.json", killed, [*common, "--snapshot-every", "10"]
            )
            disk = [*common, "--ckpt-dir", str(killed / "ckpt"), "--resume"]
            row["restart from disk"] = _run(2, base / "out.json", killed, disk)
            results[label] = row
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out = REPO / "benchmarks" / "results" / "snapshots.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    for label, row in results.items():
        print(f"\n{label}")
        for case, figures in row.items():
            shown = {
                k: (round(v, 4) if isinstance(v, float) else v) for k, v in figures.items() if v is not None
            }
            print(f"  {case:22} {shown}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
