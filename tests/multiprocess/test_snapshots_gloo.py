"""The main job survives a lost node from memory snapshots, and resumes exactly, at any world size.

``examples/train.py --snapshot-every 2`` runs as 2 simulated nodes x 2 gloo ranks (each node its own
``FSDP2_SNAPSHOT_DIR``). One node's ranks are killed with SIGKILL during the forward, the backward, the
optimizer step, or the copy of a snapshot, and its directory is deleted, as a lost machine's memory
would be. The survivors restart on 2 ranks and restore the newest snapshot whole among them: their
losses equal those of a run that switched from 4 to 2 ranks at the same step through a DCP checkpoint,
bit for bit, and so do they restarted on 3. A single killed worker restarts at 4 ranks with the
uninterrupted run's losses, also when its own copy is damaged (the buddy's copy is read). Two adjacent
nodes lost at once (4 nodes of one rank) fall back to the checkpoint on disk, or stop with one line
when there is none. A copy that cannot be written (a full disk) is not committed: every rank warns,
the previous snapshot stays, and the next one commits.
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
from tests.multiprocess.test_examples import SMALL, _load_train

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(400)]

COMMON = ["--steps", "6", *SMALL, "--snapshot-every", "2"]  # snapshots of steps 2 and 4 (6: discarded)
KILL_STEP = 3  # the 4th step: the snapshot of step 2 is committed, the one of step 4 not yet taken


def _run(node_dir: str, argv: list[str], out: str | None, train: Any = None) -> list[float]:
    os.environ["FSDP2_SNAPSHOT_DIR"] = node_dir
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
    assert not any((whole / "node0" / "train").glob("step-*")), "a finished run frees its snapshots"
    switched = tmp_path / "switched"  # the reference: 4 ranks to step 2, then 2 ranks through DCP
    shutil.copytree(whole / "ckpt" / "step_2", switched / "step_2")

    lost_node = ["forward", "backward", "optimizer", "own_written"]
    for where in lost_node:
        _kill(tmp_path / where, 2, [2, 3], where)
        shutil.rmtree(tmp_path / where / "node1")  # the lost machine's memory
    shutil.copytree(tmp_path / "forward" / "node0", tmp_path / "three" / "node0")  # for a restart on 3
    _kill(tmp_path / "worker", 2, [3], "forward")
    damaged = tmp_path / "worker" / "node0" / "train" / "step-2" / "rank-0.snap"
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


def _a_copy_that_cannot_be_written(root: str, out: str) -> None:
    """Rank 1's own file of step 2 cannot be written (a full disk): no commit, every rank warns."""
    import warnings

    import fsdp2
    from fsdp2.resilience._store import NodeStore

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    for layer in model:
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    snapshots = fsdp2.Snapshots(model, optim, every=1, directory=f"{root}/node{rank}", name="job")
    original = NodeStore.write

    def write(self: NodeStore, step: int, owner: int, parts: list[Any]) -> None:
        if rank == 1 and step == 2 and owner == 1:
            raise OSError(28, "No space left on device")
        original(self, step, owner, parts)

    NodeStore.write = write  # type: ignore[method-assign]
    seen = []
    for step in range(1, 4):
        model(torch.ones(2, 4)).sum().backward()
        optim.step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            snapshots.save(step)
            snapshots.wait()
        assert snapshots.last is not None
        steps_here = sorted(p.name for p in Path(f"{root}/node{rank}/job").glob("step-*"))
        seen.append((snapshots.last.failed, [str(w.message) for w in caught], steps_here))
    NodeStore.write = original  # type: ignore[method-assign]
    snapshots.close(discard=True)
    outcomes: list[Any] = [None] * 2
    dist.all_gather_object(outcomes, seen)
    if rank == 0:
        torch.save(outcomes, out)


def test_a_copy_that_cannot_be_written_is_not_committed_and_every_rank_warns(tmp_path: Path) -> None:
    run_multiprocess(2, _a_copy_that_cannot_be_written, str(tmp_path), str(tmp_path / "out.pt"))
    for rank, seen in enumerate(torch.load(tmp_path / "out.pt")):
        (failed_1, warned_1, steps_1), (_, warned_2, steps_2), (failed_3, warned_3, steps_3) = seen
        assert (failed_1, warned_1, steps_1) == ("", [], ["step-1"]), rank
        assert len(warned_2) == 1, (rank, warned_2)
        assert "snapshot of step 2 not kept" in warned_2[0], (rank, warned_2)
        assert steps_2 == ["step-1", "step-2"], (rank, steps_2)  # step 1 stays: step 2 is not whole
        assert (failed_3, warned_3, steps_3) == ("", [], ["step-3"]), rank
    rank1 = torch.load(tmp_path / "out.pt")[1][1][0]
    assert "No space left on device" in rank1, rank1
    assert torch.load(tmp_path / "out.pt")[0][1][0] == "a copy failed on another rank"
