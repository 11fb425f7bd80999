"""The main job's checkpoints are verified before a resume: a damaged one is named and skipped.

examples/train.py on thread ranks: an uninterrupted run of 6 steps saves step_2 and step_4 (each with
a manifest of its files' sizes and sha256). Then step_4 is damaged one way at a time and ``--resume``
must say what is wrong, fall back to step_2 and reproduce the uninterrupted run's losses from there
exactly; with every checkpoint damaged it raises one ``CheckpointError`` naming them.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests._harness import run_threaded

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ARGS = ["--steps", "6", "--dim", "32", "--layers", "2", "--heads", "2", "--batch-size", "4"]
ARGS += ["--seq-len", "16", "--ckpt-every", "2"]


def _main(argv: list[str]) -> list[float]:
    sys.path.insert(0, str(EXAMPLES))
    import train  # examples/train.py

    return train.main(argv)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "train_state missing": (lambda d: (d / "train_state.pt").unlink(), "train_state.pt missing"),
    "train_state truncated": (lambda d: _truncate(d / "train_state.pt"), "train_state.pt has"),
    "shard truncated": (lambda d: _truncate(d / "__1_0.distcp"), "__1_0.distcp has"),
    "shard flipped byte": (lambda d: _flip_byte(d / "__0_0.distcp"), "__0_0.distcp changed"),
    "metadata missing": (lambda d: (d / ".metadata").unlink(), ".metadata missing"),
    "manifest missing": (lambda d: (d / "MANIFEST.json").unlink(), "MANIFEST.json missing"),
    "manifest garbled": (lambda d: (d / "MANIFEST.json").write_text("{"), "MANIFEST.json unreadable"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    root = tmp_path_factory.mktemp("ckpt")
    losses = run_threaded(2, _main, [*ARGS, "--ckpt-dir", str(root / "run")])[0]
    assert sorted(p.name for p in (root / "run").iterdir()) == ["step_2", "step_4"]
    return root / "run", losses


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_named_and_the_previous_one_resumes(
    kind: str, saved: tuple[Path, list[float]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, uninterrupted = saved
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    damage, what = DAMAGE[kind]
    damage(copy / "step_4")
    resumed = run_threaded(2, _main, [*ARGS, "--ckpt-dir", str(copy), "--resume"])[0]
    assert resumed == uninterrupted[2:]  # from step 2, exactly the uninterrupted run's losses
    out = capsys.readouterr().out
    assert f"skipped damaged checkpoint {copy / 'step_4'}: " in out
    assert what in out
    assert f"resumed from {copy / 'step_2'}" in out


def test_with_every_checkpoint_damaged_one_error_names_them(
    saved: tuple[Path, list[float]], tmp_path: Path
) -> None:
    run, _ = saved
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "step_4" / ".metadata").unlink()
    _truncate(copy / "step_2" / "__0_0.distcp")
    with pytest.raises(
        Exception, match=r"every checkpoint in .* is damaged: step_4 \(.metadata missing\), step_2"
    ):
        run_threaded(2, _main, [*ARGS, "--ckpt-dir", str(copy), "--resume"])
