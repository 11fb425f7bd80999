"""The main job's checkpoints are verified before a resume: a damaged one is named and skipped.

examples/train.py on thread ranks: an uninterrupted run of 6 steps with ``--ckpt-every 2`` saves
step_2, step_4 and step_6, the last step included (each with a manifest of its files' sizes and
sha256). Then the newest is damaged one way at a time and ``--resume`` must say what is wrong, fall
back to the one before and reproduce the uninterrupted run's losses from there exactly, whatever
the damage (a manifest of another shape or one that vouches for too little is damage, not a
traceback on one rank); with every checkpoint damaged it raises one ``CheckpointError`` naming them.
"""

from __future__ import annotations

import json
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


def _drop_entry(folder: Path, name: str, key: str | None = None) -> None:
    """Remove ``name``'s entry from the manifest (with ``key``: only that field of it)."""
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    if key is None:
        del manifest["files"][name]
    else:
        del manifest["files"][name][key]
    (folder / "MANIFEST.json").write_text(json.dumps(manifest))


def _drop_shard_and_entry(folder: Path) -> None:
    _drop_entry(folder, "__1_0.distcp")
    (folder / "__1_0.distcp").unlink()


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "train_state missing": (lambda d: (d / "train_state.pt").unlink(), "train_state.pt missing"),
    "train_state truncated": (lambda d: _truncate(d / "train_state.pt"), "train_state.pt has"),
    "shard truncated": (lambda d: _truncate(d / "__1_0.distcp"), "__1_0.distcp has"),
    "shard flipped byte": (lambda d: _flip_byte(d / "__0_0.distcp"), "__0_0.distcp changed"),
    "metadata missing": (lambda d: (d / ".metadata").unlink(), ".metadata missing"),
    "manifest missing": (lambda d: (d / "MANIFEST.json").unlink(), "MANIFEST.json missing"),
    "manifest garbled": (lambda d: (d / "MANIFEST.json").write_text("{"), "MANIFEST.json unreadable"),
    # Rank 1 checks __0_0.distcp: before, a KeyError there while rank 0 waited in the exchange.
    "manifest entry without sha256": (
        lambda d: _drop_entry(d, "__0_0.distcp", "sha256"),
        "MANIFEST.json unreadable (the entry of __0_0.distcp has no sha256)",
    ),
    "manifest a JSON list": (
        lambda d: (d / "MANIFEST.json").write_text("[]"),
        "MANIFEST.json unreadable (a JSON list where",
    ),
    "manifest lists no files": (  # before, it verified nothing and DCP raised EOFError
        lambda d: (d / "MANIFEST.json").write_text('{"files": {}}'),
        ".metadata, __0_0.distcp, __1_0.distcp, train_state.pt not in MANIFEST.json",
    ),
    "manifest entry dropped": (
        lambda d: _drop_entry(d, "__1_0.distcp"),
        "__1_0.distcp not in MANIFEST.json",
    ),
    "shard and its entry removed": (
        _drop_shard_and_entry,
        ".metadata reads __1_0.distcp, which MANIFEST.json does not list",
    ),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    root = tmp_path_factory.mktemp("ckpt")
    losses = run_threaded(2, _main, [*ARGS, "--ckpt-dir", str(root / "run")])[0]
    return root / "run", losses


def _steps(run: Path) -> list[int]:
    return sorted(int(p.name[len("step_") :]) for p in run.iterdir())


def test_the_last_step_is_saved_on_the_cadence_or_not(
    saved: tuple[Path, list[float]], tmp_path: Path
) -> None:
    run, _ = saved
    assert _steps(run) == [2, 4, 6]  # 6 steps, every 2: the last one too
    run_threaded(2, _main, [*ARGS[:1], "3", *ARGS[2:], "--ckpt-dir", str(tmp_path / "odd")])
    assert _steps(tmp_path / "odd") == [2, 3]  # 3 steps, every 2: step 2, then the last


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_named_and_the_previous_one_resumes(
    kind: str, saved: tuple[Path, list[float]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, uninterrupted = saved
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    *_, previous, newest = _steps(copy)
    damage, what = DAMAGE[kind]
    damage(copy / f"step_{newest}")
    resumed = run_threaded(2, _main, [*ARGS, "--ckpt-dir", str(copy), "--resume"])[0]
    assert resumed == uninterrupted[previous:]  # exactly the uninterrupted run's losses from there
    out = capsys.readouterr().out
    assert f"skipped damaged checkpoint {copy / f'step_{newest}'}: " in out
    assert what in out
    assert f"resumed from {copy / f'step_{previous}'}" in out


@pytest.mark.parametrize("leading_zero", [True, False])
def test_a_renamed_step_folder_is_skipped_with_a_message(
    leading_zero: bool, saved: tuple[Path, list[float]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """step_<n> renamed: to step_0<n> (before: FileNotFoundError for step_<n>), or to a later step's name
    (before: loaded as that step while its files hold another)."""
    run, uninterrupted = saved
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    *_, previous, newest = _steps(copy)
    name = f"step_0{newest}" if leading_zero else f"step_{newest + 1}"
    (copy / f"step_{newest}").rename(copy / name)
    resumed = run_threaded(2, _main, [*ARGS, "--ckpt-dir", str(copy), "--resume"])[0]
    assert resumed == uninterrupted[previous:]
    out = capsys.readouterr().out
    if leading_zero:
        assert f"skipped {copy / name}: not a name a save writes (step_<n>, n without leading zeros)" in out
    else:
        said = f"COMPLETE says 'step {newest}', not 'step {newest + 1}' (a folder renamed after the save)"
        assert f"skipped damaged checkpoint {copy / name}: {said}" in out
    assert f"resumed from {copy / f'step_{previous}'}" in out


def test_with_every_checkpoint_damaged_one_error_names_them(
    saved: tuple[Path, list[float]], tmp_path: Path
) -> None:
    run, _ = saved
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    newest, *older = reversed(_steps(copy))
    (copy / f"step_{newest}" / ".metadata").unlink()
    for step in older:
        _truncate(copy / f"step_{step}" / "__0_0.distcp")
    with pytest.raises(Exception, match=r"every checkpoint in .* is damaged: ") as info:
        run_threaded(2, _main, [*ARGS, "--ckpt-dir", str(copy), "--resume"])
    message = str(info.value)
    assert f"step_{newest} (.metadata missing)" in message
    for step in older:
        assert f"step_{step} (__0_0.distcp has " in message
