"""``import fsdp2`` leaves torch's compile partitioner to the first compile, and still fixes it then.

The partitioner brings inductor's code cache, torch.export, sympy and networkx: about 29,000 objects
the garbage collector walks in every full collection of an eager job, which moved a full collection
into the first DCP save of a fresh process (docs/performance.md, "DCP save at torch's cost"). The
reference is a fresh interpreter's ``sys.modules``; the fix must be in place once torch imports the
module (``fsdp2.compile._compile_fixes``, [Note: The partitioner imported when torch imports it]).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_CODE = """
import sys
import fsdp2
assert "torch._functorch.partitioners" not in sys.modules, "imported by fsdp2"
from torch._functorch import partitioners
print(partitioners.functionalize_rng_ops.__module__)
"""


@pytest.mark.slow  # a fresh interpreter: about 12 s
def test_import_fsdp2_leaves_the_partitioner_to_the_first_compile() -> None:
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _CODE], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "fsdp2.compile._compile_fixes"
