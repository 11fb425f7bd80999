"""The package's layering: no import cycles inside ``fsdp2/`` and no import of torch's FSDP.

Imports are read from the source (``ast``), so imports under ``if TYPE_CHECKING:`` and imports inside
functions count too: a cycle hidden behind type checking is still a lower layer reaching up.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp2"


def _module_name(path: Path) -> str:
    """``_state`` for ``fsdp2/_state.py``, ``testing._threads`` for ``fsdp2/testing/_threads.py``."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts)


def _internal_imports(path: Path, package: Path = PACKAGE) -> set[str]:
    """Names of the ``fsdp2`` modules that ``path`` imports (``_state``, ``testing._threads``, ...).

    A module named ``__init__`` of a subpackage stands for the subpackage (``testing``); the top-level
    ``__init__`` is ``__init__``. Relative imports are resolved from ``path``'s own package.
    """
    here = list(path.parent.relative_to(package).parts)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                if node.module:  # from ._x import y / from .._x import y
                    found.add(".".join([*base, node.module.split(".")[0]]))
                else:  # from . import _x
                    found.update(".".join([*base, alias.name]) for alias in node.names)
            elif node.module and node.module.split(".")[0] == "fsdp2":
                found.add(".".join(node.module.split(".")[1:]) or "__init__")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "fsdp2":
                    found.add(".".join(parts[1:]) or "__init__")
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    names = set(modules) | {name.removesuffix(".__init__") for name in modules}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        node = name.removesuffix(".__init__")
        graph[node] = {dep.removesuffix(".__init__") for dep in _internal_imports(path)} & names - {node}
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or ``None``."""
    visiting: list[str] = []
    done: set[str] = set()

    def visit(node: str) -> list[str] | None:
        if node in visiting:
            return [*visiting[visiting.index(node) :], node]
        if node in done:
            return None
        visiting.append(node)
        for dep in sorted(graph[node]):
            cycle = visit(dep)
            if cycle is not None:
                return cycle
        visiting.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start)
        if cycle is not None:
            return cycle
    return None


def test_no_import_cycles_in_fsdp2() -> None:
    graph = _graph()
    assert len(graph) > 10, "the package was not found"
    assert {"testing", "testing._threads", "testing._counting"} <= graph.keys(), (
        "fsdp2/testing is not covered"
    )
    assert "_memory" in graph["testing._measure"], "imports from a parent package are not resolved"
    cycle = _find_cycle({k: v for k, v in graph.items() if k != "__init__"})
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("leaf", ["_api", "_lifecycle", "_autograd", "_comms", "_comm_context", "_dtensor"])
def test_leaves_import_nothing_from_fsdp2(leaf: str) -> None:
    assert _graph()[leaf] == set()


def test_cycle_finder_sees_type_checking_imports(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"
    )
    (tmp_path / "b.py").write_text("from . import a\n")
    graph = {p.stem: _internal_imports(p, tmp_path) for p in tmp_path.glob("*.py")}
    assert _find_cycle(graph) == ["a", "b", "a"]


# The only names of torch's FSDP fsdp2 may import: its public class, as the base that makes fsdp2 modules
# FSDP modules to torch's ecosystem, and its public function, as the key of torch's fully_shard.state().
_ALLOWED_TORCH_FSDP_IMPORTS = {("_module.py", "FSDPModule"), ("_composable.py", "fully_shard")}


def test_fsdp2_never_imports_torch_fsdp() -> None:
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed.fsdp":
                for alias in node.names:
                    found = (path.name, alias.name)
                    assert found in _ALLOWED_TORCH_FSDP_IMPORTS, f"{path.name} imports {alias.name}"
                continue
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                assert not name.startswith("torch.distributed.fsdp"), f"{path.name} imports {name}"


# The engine's stateful classes: tools on top reach them only through ``_engine``.
ENGINE_INTERNALS = {"_state", "_param_group", "_param", "_root", "_schedule", "_reduce", "_gather"}
TOOLS = ["_copy", "_memory", "_accumulate", "_guard", "testing/_recording"]
# Fields of states, groups and parameters that only the engine (and ``_engine``) may read.
ENGINE_FIELDS = {"groups", "fsdp_params", "hook_handles", "shard_args", "controls", "unreduced_grads"}


@pytest.mark.parametrize("tool", [*TOOLS, "_step_guard"])
def test_tools_reach_the_engine_through_its_interface(tool: str) -> None:
    path = PACKAGE / f"{tool}.py"
    internals = _internal_imports(path) & ENGINE_INTERNALS
    if tool == "_step_guard":
        internals -= {"_param_group"}  # the groups it watches, for typing; every read goes through _engine
    assert not internals, f"{tool} imports the engine's internals {sorted(internals)}: use _engine instead"
    assert "_engine" in _internal_imports(path)
    reads = {
        node.attr
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_FIELDS
    }
    assert not reads, f"{tool} reads engine fields {sorted(reads)}: add what it needs to _engine instead"


def test_the_communication_report_reads_recordings_only() -> None:
    # Pure data processing over what record_events yielded: nothing of the engine.
    assert _graph()["_report"] == {"_events"}
