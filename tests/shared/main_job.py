"""The main job (examples/train.py) at a small size, loaded in a process, shared by the examples, resume and
snapshot tests.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[2]


SMALL = ["--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "32", "--batch-size", "8"]


def _load_train() -> ModuleType:
    return _load_example("train")


def _load_example(name: str) -> ModuleType:
    # examples/ is not a package: load the example from its path. The module must be in sys.modules
    # before it runs, because dataclasses look their module up there.
    path = REPO_ROOT / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"fsdp2_example_{name}", path)
    assert spec is not None, f"cannot load {path}"
    assert spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
