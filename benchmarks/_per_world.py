"""Run a benchmark once per simulated world size, each in a fresh interpreter, and collect its rows.

The benchmarks that act as one rank of ``N`` (torch's fake process group) start themselves again with
``--one N`` for every ``N``, so that no state of one world size (caches, meshes, process groups)
colours the next; each such run prints one JSON line last.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from typing import Any


def rows_per_world(script: str, worlds: Sequence[int], extra: Sequence[str]) -> dict[int, Any]:
    """``{N: the JSON row script --one N prints}``; exits with the child's error output if one fails."""
    rows: dict[int, Any] = {}
    for world in worlds:
        out = subprocess.run(
            [sys.executable, script, "--one", str(world), *extra], capture_output=True, text=True, check=False
        )
        if out.returncode != 0:
            sys.exit(f"N={world} failed:\n{out.stderr[-4000:]}")
        rows[world] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"N={world}: {rows[world]}", file=sys.stderr, flush=True)
    return rows
