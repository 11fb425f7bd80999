"""Checks that the job's nodes can keep snapshots, made when ``Snapshots`` is built, on every rank alike.

Owns: ``check_restartable`` (torchrun's shared store breaks the restart a snapshot is for: refused,
with the setting that fixes it), ``check_separate_storage`` (two nodes whose snapshot directories are
one storage, a network file system shared by their hosts, would keep one copy where two are counted:
refused) and ``warn_other_jobs``. Does not own the ring (``_ring``) or the files (``_store``).

[Note: Restarts under torchrun's shared store]
By default torchrun's agents keep one TCP store for all rounds of a job and hand it to the workers
(``TORCHELASTIC_USE_AGENT_STORE=True``). The keys a gloo group's ranks publish their addresses under
depend only on the group's name and rank, so a restarted worker can read an address of the previous
round and fail in ``connectFullMesh`` ("Connection refused") until the restarts run out. On torch 2.13
the default group, which the training script creates before fsdp2 runs, failed so in the README's demo:
no group fsdp2 builds can mend that. So an elastic job that torchrun may restart
(``TORCHELASTIC_MAX_RESTARTS`` > 0) is refused at its start with the one setting that gives every round
a store of its own, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``; a launch that cannot restart is left alone.
"""

from __future__ import annotations

import os
import secrets
from typing import Any

import torch
import torch.distributed as dist

from ..base import warn_user
from ..comm import raise_everywhere
from ._ring import Ring
from ._store import NodeStore


def check_restartable() -> None:
    """Raise when torchrun may restart this job on a store shared between rounds (see the Note)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if not restarts.isdigit() or int(restarts) == 0:
        return  # no restart can happen: nothing to restore into
    raise RuntimeError(
        f"fsdp2.Snapshots: torchrun may restart this job (--max-restarts {restarts}) but shares one store "
        "between its rounds (TORCHELASTIC_USE_AGENT_STORE=True), so the restarted workers fail to connect "
        "and never restore. Launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment."
    )


def check_separate_storage(
    store: NodeStore, ring: Ring, key: str, rank: int, group: dist.ProcessGroup
) -> None:
    """Raise on every rank when a node cannot write its directory or sees another node's in its own.

    Each node's first rank leaves a marker (named by a token of this call, holding its node's ``key``) in
    its job directory; after every node has (the first ``raise_everywhere`` gathers from every rank), a
    node that finds another node's marker shares its storage with it (and reads that node's key from
    it). Each check raises the lowest rank's problem.
    """
    token: list[Any] = [secrets.token_hex(8) if rank == 0 else None]
    dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
    node, leader = ring.node(rank), ring.is_leader(rank)
    marker = store.directory / f".node-{token[0]}-{node}"
    problem = ""
    if leader:
        try:
            store.directory.mkdir(parents=True, exist_ok=True)
            marker.write_text(key)
        except OSError as error:
            problem = (
                f"fsdp2.Snapshots cannot write in its snapshot directory on {key}: {error}. Set "
                "FSDP2_SNAPSHOT_DIR (or directory=) to a writable node-local directory."
            )
    try:
        raise_everywhere(problem, group, RuntimeError, device=_CPU, combine=_first)
        seen: list[int] = []
        if leader:
            names = [path.name for path in store.directory.glob(f".node-{token[0]}-*")]
            seen = sorted(int(name.rsplit("-", 1)[1]) for name in names if name != marker.name)
        shared = ""
        if seen:
            theirs = (store.directory / f".node-{token[0]}-{seen[0]}").read_text()
            ours = key
            shared = (
                f"fsdp2.Snapshots: nodes {ours} and {theirs} keep their snapshots in one "
                f"storage ({store.directory} is the same directory on both: a network file system?), so a "
                "rank's copy on its buddy node would replace its own file and one copy would be kept where "
                "two are counted. Give each node a directory in its own memory: FSDP2_SNAPSHOT_DIR (or "
                "directory=) on a node-local file system such as /dev/shm."
            )
        raise_everywhere(shared, group, ValueError, device=_CPU, combine=_first)
    finally:
        if leader and not problem:  # only a marker put down (unlinking under a file would raise anew)
            marker.unlink(missing_ok=True)  # after every rank has looked (the second gather), or raised


_CPU = torch.device("cpu")  # the snapshots' gloo group: a flag first, messages only on a problem


def _first(problems: list[str]) -> str:
    return next(problem for problem in problems if problem)


def warn_other_jobs(store: NodeStore) -> None:
    """Warn (on a node's first rank) when the ``<name>`` folder holds other jobs' snapshots."""
    others = store.others()
    if not others:
        return
    size = sum(path.stat().st_size for folder in others for path in folder.rglob("*") if path.is_file())
    warn_user(
        f"fsdp2.Snapshots: {store.directory.parent} also holds the snapshots of {len(others)} other "
        f"job(s) ({', '.join(folder.name for folder in others[:3])}; {size / 2**20:.1f} MiB), which this "
        "job never restores or drops: remove them if those jobs are over"
    )
