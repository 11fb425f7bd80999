"""The main job's checkpoints are complete or invisible, and resume on any number of ranks.

``examples/train.py`` writes each checkpoint into ``step_<n>.partial`` and renames it to ``step_<n>``
once every rank's files and the ``COMPLETE`` marker are written. Here both ranks are killed with
SIGKILL at each point of the second save (after DCP's files, after the training state, after the
marker, after the rename); ``--resume`` then continues from the latest complete checkpoint and gives
the uninterrupted run's losses bit for bit. A checkpoint saved on 2 ranks loads on 3, which train on
and save again, and that one loads on 2: the full model and optimizer state after each load equal the
saved ones exactly (`fsdp2.load_sharded` reshards them: the checkpoints are `ShardedCheckpointer`'s) and
training continues.
"""

from __future__ import annotations

import gc
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing import ProcessExitedException

from tests._harness import run_multiprocess
from tests.shared.main_job import SMALL, _load_train

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

COMMON = ["--steps", "6", *SMALL, "--ckpt-every", "2"]  # saves step_2, step_4 and step_6 (the last)


def _uninterrupted(ckpt_dir: str, out: str) -> None:
    losses = _load_train().main([*COMMON, "--ckpt-dir", ckpt_dir])
    if dist.get_rank() == 0:
        torch.save(losses, out)
    gc.collect()


def _killed_during_second_save(ckpt_dir: str, stage: str) -> None:
    train = _load_train()
    seen: list[str] = []

    def stage_hook(name: str) -> None:
        seen.append(name)
        if name == stage and seen.count(name) == 2:  # the save of step_4
            os.kill(os.getpid(), signal.SIGKILL)

    train.checkpoint_stage = stage_hook
    train.main([*COMMON, "--ckpt-dir", ckpt_dir])


def _resume_each(ckpt_dirs: list[str], out: str) -> None:
    train = _load_train()
    results = {}
    for ckpt_dir in ckpt_dirs:
        steps, skipped = train.complete_checkpoints(Path(ckpt_dir))
        results[ckpt_dir] = (steps, skipped, train.main([*COMMON, "--ckpt-dir", ckpt_dir, "--resume"]))
    if dist.get_rank() == 0:
        torch.save(results, out)
    gc.collect()


def test_a_kill_at_any_point_of_a_save_resumes_like_the_uninterrupted_run(tmp_path: Path) -> None:
    run_multiprocess(2, _uninterrupted, str(tmp_path / "whole"), str(tmp_path / "whole.pt"))
    uninterrupted: list[float] = torch.load(tmp_path / "whole.pt")
    stages = ["dcp_written", "state_written", "marked", "renamed"]
    for stage in stages:
        with pytest.raises(ProcessExitedException):
            run_multiprocess(2, _killed_during_second_save, str(tmp_path / stage), stage)
    run_multiprocess(2, _resume_each, [str(tmp_path / s) for s in stages], str(tmp_path / "resumed.pt"))
    results: dict[str, Any] = torch.load(tmp_path / "resumed.pt")
    for stage in stages:
        steps, skipped, losses = results[str(tmp_path / stage)]
        if stage == "renamed":  # the rename happened: step_4 is complete
            assert (steps, skipped) == ([2, 4], []), stage
            assert losses == uninterrupted[4:], stage
        else:  # killed before the rename: step_4 stays invisible, the run resumes from step_2
            assert (steps, skipped) == ([2], ["step_4.partial"]), stage
            assert losses == uninterrupted[2:], (stage, losses, uninterrupted)


# ---- another number of ranks ------------------------------------------------------------------------


def _full_state(train: Any, ckpt_dir: str) -> dict[str, Any]:
    """The model and optimizer (full tensors) and schedule after loading the latest checkpoint."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    args = train.parse_args([*COMMON, "--ckpt-dir", ckpt_dir])
    _, _, model, optimizer, schedule = train.build(args, torch.device("cpu"))
    step = train.load_checkpoint(Path(ckpt_dir), model, optimizer, schedule)
    full = StateDictOptions(full_state_dict=True)
    state = {
        "step": step,
        "model": get_model_state_dict(model, options=full),
        "optim": get_optimizer_state_dict(model, optimizer, options=full),
        "schedule": schedule.state_dict(),
    }
    del model, optimizer, schedule
    gc.collect()
    return state


def _save_then_record(ckpt_dir: str, out: str) -> None:
    train = _load_train()
    train.main(["--steps", "2", *SMALL, "--ckpt-every", "2", "--ckpt-dir", ckpt_dir])  # saves step_2
    state = _full_state(train, ckpt_dir)  # loaded on the ranks that saved it
    if dist.get_rank() == 0:
        torch.save(state, out)
    gc.collect()


def _load_compare_continue(ckpt_dir: str, saved: str, step: int, argv: list[str], record: str | None) -> None:
    """Load the latest checkpoint (``step``) on these ranks: it must equal what the saving ranks
    loaded (``saved``); then continue training with ``argv`` and, with ``record``, record the
    checkpoint that run saved as loaded on these ranks."""
    train = _load_train()
    state = _full_state(train, ckpt_dir)
    expected = torch.load(saved, weights_only=False)
    assert state["step"] == expected["step"] == step
    torch.testing.assert_close(state["model"], expected["model"], rtol=0, atol=0)
    torch.testing.assert_close(state["optim"]["state"], expected["optim"]["state"], rtol=0, atol=0)
    assert state["optim"]["param_groups"] == expected["optim"]["param_groups"]
    assert state["schedule"]["last_epoch"] == expected["schedule"]["last_epoch"]
    losses = train.main([*argv, *SMALL, "--ckpt-dir", ckpt_dir, "--resume"])
    assert len(losses) == int(argv[argv.index("--steps") + 1]) - step  # the steps after the checkpoint ran
    assert all(loss == loss for loss in losses)  # no NaN
    if record is not None:
        state = _full_state(train, ckpt_dir)
        if dist.get_rank() == 0:
            torch.save(state, record)
    gc.collect()


def test_resume_on_more_ranks_then_on_fewer(tmp_path: Path) -> None:
    """step_2 saved on 2 ranks loads on 3 (more ranks, uneven shards), which train on and save step_4;
    that loads on 2 (fewer ranks)."""
    ckpt = str(tmp_path / "ckpt")
    on_2, on_3 = str(tmp_path / "saved_on_2.pt"), str(tmp_path / "saved_on_3.pt")
    run_multiprocess(2, _save_then_record, ckpt, on_2)
    run_multiprocess(3, _load_compare_continue, ckpt, on_2, 2, ["--steps", "4", "--ckpt-every", "2"], on_3)
    run_multiprocess(2, _load_compare_continue, ckpt, on_3, 4, ["--steps", "6"], None)
