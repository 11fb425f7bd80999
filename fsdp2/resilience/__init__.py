"""Floor 7: a job that survives a lost node from memory.

Owns: ``Snapshots`` (every N-th step, each rank's shards of the model and optimizer and the job's own
state, kept in node memory and on a buddy node; on a restart, the newest whole snapshot is resharded
onto the new ranks through collectives, at any world size), the snapshot file format, the buddy ring
and the restore's plan. Calls torch.distributed.checkpoint's state-dict functions, which read and load
the sharded model through its ``state_dict`` hooks; the engine knows nothing of it. See
docs/resilience.md.

The face: ``__all__`` is what the rooms above may use, and they import nothing else of this room
(``tests/house/test_layering.py`` checks). fsdp2's public names are in ``fsdp2``.
"""

from ._snapshots import Restored, Snapshots, SnapshotStats

__all__ = ["Restored", "SnapshotStats", "Snapshots"]
