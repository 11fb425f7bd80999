"""Test sharded models without GPUs: ranks as threads, checks against the unsharded model, counts.

- :func:`run_ranks` runs a function on N threads of this process, each a rank of a process group,
  and returns the results (an error names the rank; a hang ends with an error naming the ranks).
- :func:`assert_matches_unsharded` trains a sharded model and its unsharded copy in lockstep and
  asserts losses, gradients and parameters agree.
- :func:`count_collectives` counts the collectives a rank issues (any code, by patching the backend);
  :func:`record_collectives` records the FSDP collectives of one model (kind, module, bytes) through
  the engine, on any backend.
- :func:`measure_memory` measures each rank's peak memory by phase (what ``fsdp2.estimate_memory``
  predicts).

See docs/testing-your-model.md. fsdp2's own test suite runs on these.
"""

from ._compare import assert_matches_unsharded
from ._counting import count_collectives
from ._measure import measure_memory
from ._recording import CollectiveCall, CollectiveLog, record_collectives
from ._threads import RankError, RanksTimeoutError, run_ranks

__all__ = [
    "CollectiveCall",
    "CollectiveLog",
    "RankError",
    "RanksTimeoutError",
    "assert_matches_unsharded",
    "count_collectives",
    "measure_memory",
    "record_collectives",
    "run_ranks",
]
