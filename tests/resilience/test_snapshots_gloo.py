"""The main job survives a lost node from memory snapshots, and resumes exactly, at any world size.

``examples/train.py --snapshot-every 2`` runs as 2 simulated nodes x 2 gloo ranks (each node its own
``FSDP2_SNAPSHOT_DIR``). One node's ranks are killed with SIGKILL during the forward, the backward, the
optimizer step, or the copy of a snapshot, and its directory is deleted, as a lost machine's memory
would be. The survivors restart on 2 ranks and restore the newest snapshot whole among them: their
losses equal those of a run that switched from 4 to 2 ranks at the same step through a DCP checkpoint,
bit for bit, and so do they restarted on 3. A single killed worker restarts at 4 ranks with the
uninterrupted run's losses, also when its own copy is damaged (the buddy's copy is read). Two adjacent
nodes lost at once (4 nodes of one rank) fall back to the checkpoint on disk, or stop with one line
when there is none. A disk full for two snapshots in a row (each write stopping part-way): neither is
committed, every rank warns, and no node keeps more than the committed snapshot (no refused step, no
partial file); the next one that fits commits. Damaged copies make a restore lost, not absent, and are
named: both copies of a rank, every file of the newest step, and a damaged step over an older whole one
(restored). Two jobs of one name in one directory each restore only their own snapshots; two hosts
sharing one directory are refused; ``close(discard=True)`` leaves no empty folder of fsdp2's.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from tests._harness import run_multiprocess
from tests.shared.main_job import SMALL, _load_train

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(400)]

COMMON = ["--steps", "6", *SMALL, "--snapshot-every", "2"]  # snapshots of steps 2 and 4 (6: discarded)
KILL_STEP = 3  # the 4th step: the snapshot of step 2 is committed, the one of step 4 not yet taken


def _run(node_dir: str, argv: list[str], out: str | None, train: Any = None) -> list[float]:
    os.environ["FSDP2_SNAPSHOT_DIR"] = node_dir
    os.environ["FSDP2_SNAPSHOT_JOB"] = "test"  # every run of a test is one job (the restart restores)
    losses: list[float] = (train or _load_train()).main(argv)
    if out is not None and dist.get_rank() == 0:
        torch.save(losses, out)
    return losses


def _node_dir(root: str, rank: int, ranks_per_node: int) -> str:
    return f"{root}/node{rank // ranks_per_node}"


def _first_run(root: str, ranks_per_node: int, out: str) -> None:
    """Uninterrupted, with DCP checkpoints of steps 2, 4 and 6 (the references' switch points)."""
    rank = dist.get_rank()
    _run(
        _node_dir(root, rank, ranks_per_node),
        [*COMMON, "--ckpt-dir", f"{root}/ckpt", "--ckpt-every", "2"],
        out,
    )


def _killed(root: str, ranks_per_node: int, victims: list[int], where: str) -> None:
    """Train; the ranks in ``victims`` SIGKILL themselves at ``where`` (a phase or a copy's stage)."""
    import fsdp2.resilience._snapshots as snapshots

    train = _load_train()
    rank = dist.get_rank()
    committed = threading.Event()

    def stage(name: str, step: int) -> None:
        if name == "committed" and step == 2:
            committed.set()
        if rank in victims and name == where and step == 4:
            os.kill(os.getpid(), signal.SIGKILL)

    def phase(name: str, step: int) -> None:
        if rank in victims and name == where and step == KILL_STEP:
            assert committed.wait(60), "the snapshot of step 2 was never committed"
            os.kill(os.getpid(), signal.SIGKILL)

    snapshots._stage = stage
    train.phase = phase
    extra = ["--ckpt-dir", f"{root}/ckpt", "--ckpt-every", "2"] if ranks_per_node == 1 else []
    _run(_node_dir(root, rank, ranks_per_node), [*COMMON, *extra], None, train)
    time.sleep(120)  # a survivor: the spawn ends it when the victims die


def _restarts(runs: list[tuple[list[str], list[str]]], out: str) -> None:
    """Each run: this rank's snapshot directory (by new rank) and the command line; losses or the error."""
    results: list[Any] = []
    for node_dirs, argv in runs:
        try:
            results.append(_run(node_dirs[dist.get_rank()], argv, None))
        except Exception as error:
            results.append(f"{type(error).__name__}: {error}")
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, out)


def _kill(root: Path, ranks_per_node: int, victims: list[int], where: str) -> None:
    with pytest.raises((ProcessExitedException, ProcessRaisedException)):
        run_multiprocess(4, _killed, str(root), ranks_per_node, victims, where)


def test_a_lost_node_restores_from_memory_on_fewer_ranks_and_a_lost_worker_on_as_many(tmp_path: Path) -> None:
    whole = tmp_path / "whole"
    run_multiprocess(4, _first_run, str(whole), 2, str(tmp_path / "whole.pt"))
    uninterrupted: list[float] = torch.load(tmp_path / "whole.pt")
    assert not (whole / "node0" / "train").exists(), "a finished run frees its snapshots and folders"
    assert (whole / "node0").is_dir()  # FSDP2_SNAPSHOT_DIR is the user's: it stays
    switched = tmp_path / "switched"  # the reference: 4 ranks to step 2, then 2 ranks through DCP
    shutil.copytree(whole / "ckpt" / "step_2", switched / "step_2")

    lost_node = ["forward", "backward", "optimizer", "own_written"]
    for where in lost_node:
        _kill(tmp_path / where, 2, [2, 3], where)
        shutil.rmtree(tmp_path / where / "node1")  # the lost machine's memory
    shutil.copytree(tmp_path / "forward" / "node0", tmp_path / "three" / "node0")  # for a restart on 3
    _kill(tmp_path / "worker", 2, [3], "forward")
    damaged = tmp_path / "worker" / "node0" / "train" / "job-test" / "step-2" / "rank-0.snap"
    data = bytearray(damaged.read_bytes())
    data[-5] ^= 0x10  # a flipped bit in rank 0's own copy: its buddy's copy on node 1 is read instead
    damaged.write_bytes(bytes(data))

    runs = [([str(tmp_path / "none")] * 2, [*COMMON, "--ckpt-dir", str(switched), "--resume"])]
    runs += [([str(tmp_path / where / "node0")] * 2, COMMON) for where in lost_node]
    run_multiprocess(2, _restarts, runs, str(tmp_path / "restarted.pt"))
    reference, *restored = torch.load(tmp_path / "restarted.pt")
    assert len(reference) == 4
    assert reference[0] != uninterrupted[2]  # 2 ranks draw other batches
    for where, losses in zip(lost_node, restored, strict=True):
        assert losses == reference, (where, losses, reference)

    worker = tmp_path / "worker"
    run_multiprocess(
        4, _restarts, [([f"{worker}/node{r // 2}" for r in range(4)], COMMON)], str(tmp_path / "w.pt")
    )
    assert torch.load(tmp_path / "w.pt")[0] == uninterrupted[2:]

    # 4 -> 3 ranks: chunks of 4 meet chunks of 3 at other rows; the reference switches through DCP
    runs = [([str(tmp_path / "none3")] * 3, [*COMMON, "--ckpt-dir", str(switched), "--resume"])]
    runs += [([str(tmp_path / "three" / "node0")] * 3, COMMON)]
    run_multiprocess(3, _restarts, runs, str(tmp_path / "three.pt"))
    reference_3, restored_3 = torch.load(tmp_path / "three.pt")
    assert restored_3 == reference_3, (restored_3, reference_3)


def test_two_lost_nodes_fall_back_to_disk_or_stop_with_one_line(tmp_path: Path) -> None:
    _kill(tmp_path, 1, [0, 1, 2, 3], "forward")  # 4 nodes of one rank; all stop in step 3
    shutil.rmtree(tmp_path / "node1")  # rank 1's own copy...
    shutil.rmtree(tmp_path / "node2")  # ...and its buddy's: step 2 survives nowhere for rank 1
    survivors = [str(tmp_path / "node0"), str(tmp_path / "node3")]
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "node0", copy / "node0")
    shutil.copytree(tmp_path / "node3", copy / "node3")
    reference = tmp_path / "reference"
    shutil.copytree(tmp_path / "ckpt" / "step_2", reference / "step_2")
    runs = [
        ([str(copy / "node0"), str(copy / "node3")], COMMON),  # no disk: a clear error, snapshots kept
        (survivors, [*COMMON, "--ckpt-dir", str(tmp_path / "ckpt")]),
        ([str(tmp_path / "none")] * 2, [*COMMON, "--ckpt-dir", str(reference), "--resume"]),
    ]
    run_multiprocess(2, _restarts, runs, str(tmp_path / "out.pt"))
    error, fell_back, reference_losses = torch.load(tmp_path / "out.pt")
    assert isinstance(error, str)
    assert error.startswith("CheckpointError: no whole snapshot"), error
    assert "rank(s) 1" in error, error
    assert "no --ckpt-dir to fall back to" in error, error
    assert fell_back == reference_losses, (fell_back, reference_losses)


def _tiny(step: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A two-layer sharded model and its SGD, trained ``step`` steps (the same on every run)."""
    import fsdp2

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    for layer in model:
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(step):
        _train_step(model, optim)
    return model, optim


def _train_step(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    optim.zero_grad()


def _files(root: Path) -> list[str]:
    """Every file under ``root``, relative, sorted (``.tmp`` leftovers and markers included)."""
    return sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file())


def _a_full_disk(root: str, out: str) -> None:
    """Node 1's disk is full for steps 2 and 3 (each write stops part-way), then has room again."""
    import builtins
    import warnings

    import fsdp2
    import fsdp2.resilience._format as file_format

    rank = dist.get_rank()
    model, optim = _tiny()
    snapshots = fsdp2.Snapshots(model, optim, every=1, directory=f"{root}/node{rank}", name="job", job="j")

    class Full:
        """A file on a full disk: the first write puts 100 bytes down, then fails."""

        def __init__(self, path: Any) -> None:
            self.handle = builtins.open(path, "wb")  # noqa: SIM115 - closed by __exit__, as open's is

        def __enter__(self) -> Full:
            return self

        def __exit__(self, *exc: object) -> None:
            self.handle.close()

        def write(self, data: Any) -> int:
            self.handle.write(bytes(memoryview(data)[:100]))
            self.handle.flush()
            raise OSError(28, "No space left on device")

    def full_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if rank == 1 and "w" in mode and Path(path).parent.name in {"step-2", "step-3"}:
            return Full(path)
        return builtins.open(path, mode, *args, **kwargs)

    file_format.open = full_open  # type: ignore[attr-defined]
    seen = []
    for step in range(1, 5):
        _train_step(model, optim)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            snapshots.save(step)
            snapshots.wait()
        dist.barrier()
        assert snapshots.last is not None
        last = snapshots.last
        seen.append((last.failed, last.host_bytes, [str(w.message) for w in caught], _files(Path(root))))
    del file_format.open  # type: ignore[attr-defined]
    snapshots.close(discard=True)
    outcomes: list[Any] = [None] * 2
    dist.all_gather_object(outcomes, seen)
    if rank == 0:
        torch.save(outcomes, out)


def test_a_full_disk_keeps_only_the_committed_snapshot_and_no_partial_file(tmp_path: Path) -> None:
    run_multiprocess(2, _a_full_disk, str(tmp_path), str(tmp_path / "out.pt"))
    outcomes = torch.load(tmp_path / "out.pt")

    def step_files(step: int) -> list[str]:
        return [f"node{node}/job/job-j/step-{step}/rank-{rank}.snap" for node in (0, 1) for rank in (0, 1)]

    for rank, seen in enumerate(outcomes):
        (failed_1, bytes_1, warned_1, files_1), *refused, (failed_4, bytes_4, warned_4, files_4) = seen
        assert (failed_1, warned_1, files_1) == ("", [], step_files(1)), rank
        assert bytes_1 > 0
        for step, (failed, kept, warned, files) in zip((2, 3), refused, strict=True):
            assert failed, (rank, step)
            assert kept == 0, (rank, step)  # not kept: its files are gone
            assert len(warned) == 1, (rank, warned)
            assert f"snapshot of step {step} not kept" in warned[0], (rank, warned)
            # the committed step 1 stays; neither the refused step nor a partial file is kept anywhere
            assert files == step_files(1), (rank, step, files)
        assert (failed_4, warned_4, files_4) == ("", [], step_files(4)), rank
        assert bytes_4 > 0
    assert "No space left on device" in outcomes[1][1][0], outcomes[1][1][0]
    assert outcomes[0][1][0] == "a copy failed on another rank"


def _damaged(root: str, out: str) -> None:
    """Snapshots whose every copy of a rank, or every file, is damaged; then an older whole one."""
    import fsdp2

    rank = dist.get_rank()
    model, optim = _tiny()
    snapshots = fsdp2.Snapshots(model, optim, every=1, directory=f"{root}/node{rank}", name="job", job="j")
    job = [Path(root) / f"node{node}" / "job" / "job-j" for node in (0, 1)]
    seen = []

    def snapshot(step: int) -> None:
        _train_step(model, optim)
        snapshots.save(step)
        snapshots.wait()
        dist.barrier()

    def damage(step: int, ranks: list[int], offset: int) -> None:  # on rank 0, both nodes' copies
        if rank == 0:
            for folder in job:
                for old in ranks:
                    path = folder / f"step-{step}" / f"rank-{old}.snap"
                    data = bytearray(path.read_bytes())
                    data[offset] ^= 0x10
                    path.write_bytes(bytes(data))
        dist.barrier()

    snapshot(1)
    snapshot(2)
    damage(2, [1], -5)  # a bit of rank 1's payload, in its own copy and in its buddy's
    seen.append(snapshots.restore())
    snapshot(3)
    damage(3, [0, 1], 0)  # the magic of every file of the newest (and only) step
    seen.append(snapshots.restore())
    snapshot(4)
    if rank == 0:
        for folder in job:
            shutil.copytree(folder / "step-4", folder.parent / "step-4")
    dist.barrier()
    snapshot(5)  # committed: step 4 is dropped, and put back from its copy
    if rank == 0:
        for folder in job:
            shutil.copytree(folder.parent / "step-4", folder / "step-4")
    damage(5, [0, 1], 0)
    seen.append(snapshots.restore())
    snapshots.close(discard=True)
    if rank == 0:
        torch.save([(r.step, r.lost, r.message) for r in seen], out)


def test_damaged_snapshots_are_lost_not_absent_and_named(tmp_path: Path) -> None:
    run_multiprocess(2, _damaged, str(tmp_path), str(tmp_path / "out.pt"))
    both_copies, every_file, older = torch.load(tmp_path / "out.pt")
    # both copies of rank 1 damaged: lost, and the message blames the bytes, not lost nodes
    assert (both_copies[:2]) == (None, True), both_copies
    assert "step 2 of 2 ranks, has only damaged copies of rank(s) 1" in both_copies[2], both_copies
    assert "CRC-32 mismatch" in both_copies[2], both_copies
    assert f"{tmp_path}/node0/job/job-j/step-2/rank-1.snap" in both_copies[2], both_copies
    assert "survives nowhere" not in both_copies[2], both_copies
    # every file of the newest step unreadable: lost (the caller falls back), not a fresh start
    assert (every_file[:2]) == (None, True), every_file
    assert "every snapshot file found is damaged" in every_file[2], every_file
    assert "step-3/rank-0.snap is not an fsdp2 snapshot file" in every_file[2], every_file
    assert "starting afresh" not in every_file[2], every_file
    # an older whole snapshot under a damaged newest one is restored, the damaged files named
    assert (older[:2]) == (4, False), older
    assert "skipped 4 damaged file(s)" in older[2], older
    assert "step-5/rank-" in older[2], older


def _two_jobs(root: str, out: str) -> None:
    """Jobs a and b, same name, same directory, same model; then b restarts, and a job c starts."""
    import warnings

    import fsdp2

    rank = dist.get_rank()
    os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_MAX_RESTARTS="0")
    directory = f"{root}/node{rank}"
    model, optim = _tiny()
    with warnings.catch_warnings(record=True) as caught:  # a launch that cannot restart: no warning
        warnings.simplefilter("always")
        os.environ["TORCHELASTIC_RUN_ID"] = "a"  # torchrun's run id names the job
        job_a = fsdp2.Snapshots(model, optim, every=1, directory=directory)
    assert [str(w.message) for w in caught] == []
    for step in range(1, 5):
        _train_step(model, optim)
        job_a.save(step)
    job_a.wait()
    model_b, optim_b = _tiny(1)
    job_b = fsdp2.Snapshots(model_b, optim_b, every=1, directory=directory, job="b")
    job_b.save(1)
    job_b.wait()
    restarted, optim_r = _tiny()
    b_again = fsdp2.Snapshots(restarted, optim_r, every=1, directory=directory, job="b").restore()
    same = all(
        torch.equal(p.to_local(), q.to_local())
        for p, q in zip(restarted.parameters(), model_b.parameters(), strict=True)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        job_c = fsdp2.Snapshots(*_tiny(), every=1, directory=directory, job="c")
    c_fresh = job_c.restore()
    job_c.close(discard=True)
    files = _files(Path(directory))
    if rank == 0:
        restores = [(r.step, r.lost, r.message) for r in (b_again, c_fresh)]
        torch.save((*restores[:1], same, *restores[1:], [str(w.message) for w in caught], files), out)


def test_a_restore_takes_only_its_own_jobs_snapshots(tmp_path: Path) -> None:
    run_multiprocess(2, _two_jobs, str(tmp_path), str(tmp_path / "out.pt"))
    b_again, same, c_fresh, warned, files = torch.load(tmp_path / "out.pt")
    assert b_again[:2] == (1, False), b_again  # job b's own step 1, not job a's step 4
    assert same, "job b restored job b's parameters"
    assert c_fresh[:2] == (None, False), c_fresh
    assert "no snapshot of this job" in c_fresh[2], c_fresh
    assert len(warned) == 1, warned
    assert "holds the snapshots of 2 other job(s) (job-a, job-b" in warned[0], warned
    # job a's snapshot is untouched by b's restore and by c's discard; b's restore kept only its own step
    kept = [("a", 4, 0), ("a", 4, 1), ("b", 1, 0), ("b", 1, 1)]
    assert files == [f"default/job-{job}/step-{step}/rank-{r}.snap" for job, step, r in kept], files


def _shared_directory(root: str, out: str) -> None:
    """Two hosts (as ``socket.gethostname`` says) given one snapshot directory, as an NFS mount would be."""
    import socket

    import fsdp2

    rank = dist.get_rank()
    socket.gethostname = lambda: f"host{rank}"  # type: ignore[assignment]
    try:
        fsdp2.Snapshots(*_tiny(), every=1, directory=root, job="j")
        outcome = "built"
    except ValueError as error:
        outcome = str(error)
    outcomes: list[Any] = [None] * 2
    dist.all_gather_object(outcomes, outcome)
    if rank == 0:
        torch.save(outcomes, out)


def test_two_hosts_sharing_one_snapshot_directory_are_refused(tmp_path: Path) -> None:
    run_multiprocess(2, _shared_directory, str(tmp_path / "shared"), str(tmp_path / "out.pt"))
    for outcome in torch.load(tmp_path / "out.pt"):  # every rank raises, naming both nodes
        assert "nodes host0:" in outcome, outcome
        assert "and host1:" in outcome, outcome
        assert "keep their snapshots in one storage" in outcome, outcome
        assert "FSDP2_SNAPSHOT_DIR" in outcome, outcome
    assert _files(tmp_path / "shared") == []  # no marker left behind


def _default_root(root: str) -> None:
    """Snapshots in fsdp2's default root (here under ``root``), then discarded."""
    import fsdp2
    import fsdp2.resilience._snapshots as module

    os.environ.pop("FSDP2_SNAPSHOT_DIR", None)
    module.default_root = lambda: Path(root) / "fsdp2-snapshots-test"  # type: ignore[attr-defined]
    model, optim = _tiny()
    snapshots = fsdp2.Snapshots(model, optim, every=1, name="train", job="j")
    snapshots.save(1)
    snapshots.wait()
    assert snapshots.directory == Path(root) / "fsdp2-snapshots-test" / "train" / "job-j"
    assert snapshots.directory.is_dir()
    snapshots.close(discard=True)


def test_close_with_discard_leaves_no_empty_folder(tmp_path: Path) -> None:
    run_multiprocess(2, _default_root, str(tmp_path))
    assert list(tmp_path.iterdir()) == []
