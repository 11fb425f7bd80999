"""fsdp2's Python work as one rank of a simulated world, counted in lines, never timed.

``fsdp2_lines(setup, worlds)`` runs, in a fresh interpreter, one rank (rank 1) of each world size
under torch's fake process group (no rank talks to another; every collective returns at once), and
counts the lines of fsdp2's own code (files under ``fsdp2/``) that one call executes: a loop of
Python over every rank of the world shows as thousands more lines at 4,096 ranks than at 8, whatever
the machine's speed. ``setup`` is the source of a function ``setup(world)`` returning the call to
count (built, and run once, before counting: caches warm, as in training). The fake group leaves
received buffers unwritten; the tensor all-to-all and all-gathers zero them here, so received
floats are numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]

_RUNNER = """
import json, sys, os
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

def _zeroed(plain):
    def collective(output, tensor, *args, **kwargs):
        work = plain(output, tensor, *args, **kwargs)
        output.zero_()
        return work
    return collective
for _name in ("all_to_all_single", "all_gather_into_tensor", "all_gather_single"):
    setattr(dist, _name, _zeroed(getattr(dist, _name)))

import fsdp2
_PACKAGE = os.path.dirname(fsdp2.__file__) + os.sep
_count = [0]

def _local(frame, event, arg):
    if event == "line":
        _count[0] += 1
    return _local

def _global(frame, event, arg):
    return _local if frame.f_code.co_filename.startswith(_PACKAGE) else None

{setup}

lines = {{}}
for world in {worlds}:
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=world)
    run = setup(world)
    run()
    _count[0] = 0
    sys.settrace(_global)
    try:
        run()
    finally:
        sys.settrace(None)
    lines[world] = _count[0]
    dist.destroy_process_group()
print(json.dumps(lines))
"""


def fsdp2_lines(setup: str, worlds: Sequence[int] = (8, 4096), timeout: float = 240) -> dict[int, int]:
    """Lines of fsdp2 executed by one call ``setup(world)()`` on rank 1 of each world (see the module)."""
    code = _RUNNER.format(setup=setup, worlds=list(worlds))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return {int(world): count for world, count in json.loads(out.stdout.strip().splitlines()[-1]).items()}
