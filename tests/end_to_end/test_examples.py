"""Smoke tests of examples/train.py, the README's main job, in two real gloo processes, and of the
tensor- and pipeline-parallel examples in four.

Some tests import an example and call its ``main()`` inside the harness's ranks (several runs share
one world); the others run the exact ``torchrun`` command line a user types (train.py: with
``--trace``, and interrupted with Ctrl-C). All use models small enough to take a few seconds per
rank, so a ``torchrun`` run's cost is mostly its interpreters' start-up.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests._harness import run_multiprocess
from tests.shared.main_job import REPO_ROOT, SMALL, _load_example, _load_train

TRAIN_PY = REPO_ROOT / "examples" / "train.py"

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def _train_and_check(runs: list[list[str]]) -> None:
    """Runs on every spawned rank; an assertion error here fails the spawn and so the test."""
    train = _load_train()
    first: list[float] = []
    for argv in runs:
        losses: list[float] = train.main(argv)
        first = first or losses
        if "--compile" in argv:  # the same run as the first, compiled whole: the same numbers
            assert losses == first, f"{argv}: {losses} against eager {first}"
        per_rank: list[list[float] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, losses)
        steps = int(argv[argv.index("--steps") + 1])
        assert len(losses) == steps, f"{argv}: expected {steps} losses, got {losses}"
        assert all(math.isfinite(x) for x in losses), f"{argv}: non-finite loss: {losses}"
        assert all(other == losses for other in per_rank), (
            f"{argv}: ranks disagree on the mean loss: {per_rank}"
        )
        assert losses[-1] < losses[0], f"{argv}: loss did not fall: {losses}"
    # The harness destroys the process group next; free DTensor's reference cycles (which hold the
    # groups) first, as train.py's main() does when it owns the group.
    gc.collect()


def test_main_trains_in_two_gloo_processes() -> None:
    # Both prefetching modes and --compile (aot_eager: bit for bit) in one spawn: starting processes
    # is what costs here.
    runs = [
        ["--steps", "8", *SMALL],
        ["--steps", "8", "--explicit-prefetching", "--prefetch-depth", "2", *SMALL],
        ["--steps", "8", "--compile", "--compile-backend", "aot_eager", *SMALL],
    ]
    run_multiprocess(2, _train_and_check, runs)


def test_torchrun_command_line(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    trace = tmp_path / "trace"
    command = [
        *launcher,
        "--standalone",
        "--nproc-per-node",
        "2",
        str(TRAIN_PY),
        "--steps",
        "5",
        *SMALL,
        "--trace",
        str(trace),
    ]
    # The checkout's fsdp2 first, as pytest itself imports it (also when it is not pip-installed).
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=100, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"torchrun exited with {result.returncode}:\n{output[-4000:]}"
    assert "final: first loss" in result.stdout, f"no final loss line in:\n{output[-4000:]}"
    # --trace: each rank's timeline (JSON with durations, PNG) and the merged one.
    assert sorted(p.name for p in trace.iterdir()) == [
        "rank0.json",
        "rank0.png",
        "rank1.json",
        "rank1.png",
        "timeline.json",
    ]
    merged = json.loads((trace / "timeline.json").read_text())["traceEvents"]
    assert {e["pid"] for e in merged if e["ph"] == "X"} == {0, 1}
    # --trace prints rank 0's communication report of the traced steps (1 and 2): a row per block and
    # collective, and a total row whose count is the sum of the rows'.
    lines = result.stdout[result.stdout.index("rank 0: Communication per group") :].splitlines()
    assert lines[0] == "rank 0: Communication per group over 2 steps"
    assert lines[1].split()[:3] == ["module", "collective", "count"]
    end = lines.index(lines[2], 3)  # the rule under the header, repeated above the total row
    rows = [line.split() for line in lines[3:end]]
    collectives = {(cells[0], cells[1]) for cells in rows}
    assert {c for _, c in collectives} == {"all_gather", "reduce_scatter"}
    assert len(collectives) == len(rows) >= 4
    total = lines[end + 1].split()
    assert total[:2] == ["total", "all"]
    assert int(total[2]) == sum(int(cells[2]) for cells in rows)
    for cells in [*rows, total]:
        count, total_ms, exposed_ms = int(cells[2]), float(cells[3]), float(cells[4])
        assert count > 0
        assert 0 <= exposed_ms <= total_ms + 0.01 * count  # printed to 0.01 ms per row


TP_PLACEMENTS = "(_StridedShard(dim=0, sf=2), Shard(dim=0)) on mesh (2, 2)"


def _parallel_examples() -> None:
    """On each of 4 ranks: each example's ``main()`` with docs/parallelism.md's arguments, in turn;
    rank 0 checks what it printed (each example asserts its own numbers on every rank)."""
    runs = [
        ("tp_fsdp", ["--steps", "3"], ["parameters equal the unsharded reference", TP_PLACEMENTS]),
        (
            "pp_fsdp",
            ["--schedule", "ZBVZeroBubble", "--steps", "2"],
            ["every stage's parameters equal the unsharded reference"],
        ),
    ]
    for name, argv, expected in runs:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            _load_example(name).main(argv)
        if dist.get_rank() == 0:
            for text in expected:
                assert text in printed.getvalue(), (name, argv, printed.getvalue()[-4000:])
        gc.collect()
        dist.barrier()


def test_tensor_and_pipeline_parallel_examples() -> None:
    """docs/parallelism.md's two examples, (dp=2, tp=2) and (pp=2, dp=2) zero-bubble, in one world of 4.

    Their ``main()`` runs in the harness's ranks instead of under ``torchrun`` (4 more interpreters
    each); the ``torchrun`` command line itself is tested with train.py above.
    """
    run_multiprocess(4, _parallel_examples)


def test_ctrl_c_ends_the_main_job_with_one_line_per_rank(tmp_path: Path) -> None:
    """A terminal's Ctrl-C (SIGINT to the whole process group) mid-training: no worker traceback."""
    import signal
    import time

    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    command = [*launcher, "--standalone", "--nproc-per-node", "2", str(TRAIN_PY), "--steps", "100000", *SMALL]
    command += ["--ckpt-dir", str(tmp_path)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    job = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert job.stdout is not None
    seen = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # wait until training runs
        line = job.stdout.readline()
        seen.append(line)
        if line.startswith("step ") or not line:
            break
    os.killpg(job.pid, signal.SIGINT)
    rest, _ = job.communicate(timeout=60)
    output = "".join(seen) + rest
    assert f"rank 0: interrupted; continue with --ckpt-dir {tmp_path} --resume" in output, output[-3000:]
    assert "rank 1: interrupted" in output, output[-3000:]
    for rank in (0, 1):
        assert f"[rank{rank}]: Traceback" not in output, output[-3000:]


def _resume_and_check(ckpt_dir: str, export: str, *extra: str) -> None:
    train = _load_train()
    common = ["--steps", "6", *SMALL, "--ckpt-dir", ckpt_dir, *extra]
    uninterrupted = train.main([*common, "--ckpt-every", "3"])  # saves step_3 and step_6 (the last)
    if dist.get_rank() == 0:
        shutil.rmtree(Path(ckpt_dir) / "step_6")  # as if killed after step 3's save
    dist.barrier()
    resumed = train.main([*common, "--resume", "--export", export])
    assert resumed == uninterrupted[3:], (uninterrupted, resumed)  # bit for bit
    gc.collect()


def test_checkpoint_resume_with_torchs_dcp_save(tmp_path: Path) -> None:
    """``--ckpt-dcp``: torch's ``dcp.save`` instead of ``fsdp2.ShardedCheckpointer``, resumed bit for bit."""
    run_multiprocess(2, _resume_and_check, str(tmp_path / "ckpt"), str(tmp_path / "weights"), "--ckpt-dcp")


def test_checkpoint_resume_reproduces_the_uninterrupted_losses(tmp_path: Path) -> None:
    export = tmp_path / "weights"
    run_multiprocess(2, _resume_and_check, str(tmp_path / "ckpt"), str(export))
    from safetensors.torch import load_file

    index = json.loads((export / "model.safetensors.index.json").read_text())
    files = sorted(path.name for path in export.glob("*.safetensors"))
    assert files == sorted(set(index["weight_map"].values())), files  # one or more per rank
    weights = {k: v for name in files for k, v in load_file(export / name).items()}
    # The files load into the plain (unsharded) model: same names, same shapes.
    train = _load_train()
    cfg = train.GPTConfig(train.CharData(train.DATA_DIR).vocab_size, 32, 32, 2, 2)  # SMALL's sizes
    with torch.device("meta"):
        plain = train.GPT(cfg)
    expected = plain.state_dict()
    assert weights.keys() == expected.keys()
    assert all(weights[k].shape == expected[k].shape for k in expected)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps must be at least 1, got 0"),
        (["--dim", "32", "--heads", "3"], "--heads (3) must divide --dim (32)"),
        (["--resume"], "--ckpt-every and --resume need --ckpt-dir"),
        (["--compile", "--explicit-prefetching"], "--compile schedules the collectives in the graph"),
    ],
)
def test_bad_arguments_get_a_message_not_a_traceback(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    train = _load_train()
    with pytest.raises(SystemExit) as info:
        train.parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _load_train().parse_args(["--help"])
    assert "(default: 200)" in capsys.readouterr().out
