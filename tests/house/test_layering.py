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
    """``_state`` for ``fsdp2/runtime/_state.py``, ``testing._threads`` for ``fsdp2/testing/_threads.py``."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts)


def _internal_imports(path: Path, package: Path = PACKAGE) -> set[str]:
    """Names of the ``fsdp2`` modules and subpackages that ``path`` imports (``runtime._state``, ...).

    ``from ..base._api import X`` counts as ``base._api``; ``from ..trace import _events`` as both
    ``trace`` (its ``__init__`` runs) and ``trace._events``; ``graph`` keeps the names that exist.
    A subpackage's ``__init__`` stands for the subpackage (``testing``); the top-level ``__init__`` is
    ``__init__``. Relative imports are resolved from ``path``'s own package.
    """
    here = list(path.parent.relative_to(package).parts)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                module = [*base, *node.module.split(".")] if node.module else base
            elif node.module and node.module.split(".")[0] == "fsdp2":
                module = node.module.split(".")[1:]
            else:
                continue
            if module and module != here:  # ``from . import _x``: the module, not its own package
                found.add(".".join(module))
            found.update(".".join([*module, alias.name]) for alias in node.names)
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
    assert "plan" in graph["testing._measure"], "imports from a parent package are not resolved"
    cycle = _find_cycle({k: v for k, v in graph.items() if k != "__init__"})
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


# The subpackages bottom up: a module imports only its own subpackage and those on lower floors.
FLOORS = {
    "base": 0,
    "comm": 1,
    "trace": 2,
    "param": 2,
    "group": 3,
    "compile": 4,
    "runtime": 5,
    "frontend": 6,
    # rooms above the engine, each named for what it does; they read it through runtime's and group's queries
    "optim": 7,
    "debug": 7,
    "plan": 7,
    "resilience": 7,  # snapshots in node memory and on a buddy node; restore and reshard
    "experts": 7,  # expert parallelism declared once: the expert mesh, the token exchange; calls fully_shard
    "weights": 8,  # debug mode's agreement on entering an export or import
    "testing": 9,
}


def _subpackage(name: str) -> str:
    return name.split(".")[0]


def test_every_module_lives_in_a_subpackage() -> None:
    flat = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert not flat, f"modules directly in fsdp2/ (give each a subpackage that owns its concern): {flat}"
    assert {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} == set(FLOORS)


def test_the_wheel_ships_every_subpackage() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert set(listed) == {"fsdp2"} | {f"fsdp2.{package}" for package in FLOORS}


def test_subpackages_import_only_lower_floors() -> None:
    upward = []
    for name, deps in _graph().items():
        if name == "__init__":
            continue
        here = _subpackage(name)
        for dep in deps:
            there = _subpackage(dep)
            if there != here and FLOORS[there] >= FLOORS[here]:
                upward.append(f"{name} ({here}, floor {FLOORS[here]}) imports {dep} (floor {FLOORS[there]})")
    assert not upward, "imports across or up the floors:\n" + "\n".join(sorted(upward))


# Rooms import one another only through faces: ``from ..comm import X``, ``X`` in ``fsdp2/comm/__init__.py``'s
# ``__all__``. The crossings that do not, as (importing module, imported module.name). Only shrinks: a
# new crossing fails, and so does a listed one that is gone (remove it here).
PRIVATE_CROSSINGS: set[tuple[str, str]] = set()  # none left: a new one must go through a face


def _face(room: Path) -> set[str]:
    """The names ``fsdp2/<room>/__init__.py`` lists in ``__all__``: what the rooms above may use."""
    for node in ast.parse((room / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def _crossings(package: Path = PACKAGE) -> set[tuple[str, str]]:
    """Every import of one room by another that does not go through the imported room's face.

    The top-level ``fsdp2/__init__.py`` is exempt: it is the package's public face and names what it
    re-exports where it is defined.
    """
    faces = {room.name: _face(room) for room in package.iterdir() if (room / "__init__.py").exists()}
    found: set[tuple[str, str]] = set()
    for path in sorted(package.rglob("*.py")):
        if path == package / "__init__.py":
            continue
        name = ".".join(path.relative_to(package).with_suffix("").parts).removesuffix(".__init__")
        here = list(path.parent.relative_to(package).parts)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - (node.level - 1)]
                    module = [*base, *node.module.split(".")] if node.module else base
                elif node.module and node.module.split(".")[0] == "fsdp2":
                    module = node.module.split(".")[1:]
                else:
                    continue
                if module[:1] == here[:1]:
                    continue
                for alias in node.names:
                    if len(module) != 1 or alias.name not in faces[module[0]]:
                        found.add((name, ".".join([*module, alias.name])))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == "fsdp2" and parts[1:2] != here[:1]:
                        found.add((name, ".".join(parts[1:])))
    return found


def test_rooms_import_one_another_through_their_faces() -> None:
    found = _crossings()
    new = sorted(found - PRIVATE_CROSSINGS)
    assert not new, (
        "imports of another room's private names (export them from its face, fsdp2/<room>/__init__.py, "
        "and import them from there):\n" + "\n".join(f"{a} imports {b}" for a, b in new)
    )
    gone = sorted(PRIVATE_CROSSINGS - found)
    assert not gone, "crossings fixed: remove them from PRIVATE_CROSSINGS:\n" + "\n".join(map(str, gone))


def test_the_face_check_sees_private_crossings(tmp_path: Path) -> None:
    for room in ("low", "high"):
        (tmp_path / room).mkdir()
    (tmp_path / "__init__.py").write_text("from .low._m import Y\n")  # the public face: exempt
    (tmp_path / "low" / "__init__.py").write_text('from ._m import X\n\n__all__ = ["X"]\n')
    (tmp_path / "low" / "_m.py").write_text("X = Y = 1\n")
    (tmp_path / "high" / "__init__.py").write_text("")
    (tmp_path / "high" / "_a.py").write_text(
        "from ..low import X, Y\nfrom ..low._m import X as X2\nfrom . import _b\n"
        "def f():\n    from fsdp2.low import _m\n    import fsdp2.low._m\n"
    )
    (tmp_path / "high" / "_b.py").write_text("from .. import low\n")
    assert _crossings(tmp_path) == {
        ("high._a", "low.Y"),
        ("high._a", "low._m.X"),
        ("high._a", "low._m"),
        ("high._b", "low"),
    }


def test_no_subpackage_holds_more_than_a_fifth_of_the_code() -> None:
    """Every capability gets a room named for it; none grows into a grab-bag (``.ci/sizes`` counts)."""
    import importlib.util
    from importlib.machinery import SourceFileLoader

    loader = SourceFileLoader("ci_sizes", str(PACKAGE.parent / ".ci" / "sizes"))
    spec = importlib.util.spec_from_loader("ci_sizes", loader)
    assert spec is not None
    sizes = importlib.util.module_from_spec(spec)
    loader.exec_module(sizes)
    code = {package: sum(sizes.counts(p)[0] for p in (PACKAGE / package).glob("*.py")) for package in FLOORS}
    total = sum(code.values()) + sum(sizes.counts(p)[0] for p in PACKAGE.glob("*.py"))
    over = {package: f"{n / total:.1%}" for package, n in code.items() if n > total / 5}
    assert not over, f"subpackages over a fifth of fsdp2's {total} code lines: {over}"


def test_every_subpackage_says_what_it_owns() -> None:
    for package in FLOORS:
        doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text()))
        assert doc, f"fsdp2/{package}/__init__.py has no docstring saying what it owns"


@pytest.mark.parametrize(
    "leaf",
    ["base._api", "base._lifecycle", "base._autograd", "comm._comms", "comm._comm_context", "param._dtensor"],
)
def test_leaves_import_nothing_from_fsdp2(leaf: str) -> None:
    assert {dep for dep in _graph()[leaf] if not dep.startswith(_subpackage(leaf))} <= {"base"}


def test_cycle_finder_sees_type_checking_imports(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"
    )
    (tmp_path / "b.py").write_text("from . import a\n")
    graph = {p.stem: _internal_imports(p, tmp_path) for p in tmp_path.glob("*.py")}
    assert _find_cycle(graph) == ["a", "b", "a"]


# The only names of torch's FSDP fsdp2 may import: its public classes, as the bases that make fsdp2 modules
# FSDP (and replicate) modules to torch's ecosystem, and its public functions, as the keys of torch's
# fully_shard.state() and replicate.state().
_ALLOWED_TORCH_FSDP_IMPORTS = {
    ("_module.py", "FSDPModule"),
    ("_composable.py", "fully_shard"),
    ("_module.py", "ReplicateModule"),
    ("_composable.py", "replicate"),
}
_TORCH_REPLICATE = "torch.distributed._composable.replicate_with_fsdp"  # torch's FSDP-based replicate
_TORCH_FSDP = ("torch.distributed.fsdp", _TORCH_REPLICATE)


def test_fsdp2_never_imports_torch_fsdp() -> None:
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in _TORCH_FSDP:
                for alias in node.names:
                    found = (path.name, alias.name)
                    assert found in _ALLOWED_TORCH_FSDP_IMPORTS, f"{path.name} imports {alias.name}"
                continue
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                assert not name.startswith(_TORCH_FSDP), f"{path.name} imports {name}"


# The engine's stateful classes: the rooms above reach them only through the queries on the faces of
# ``runtime`` (``runtime/_queries.py``) and ``group`` (``group/_queries.py``).
ENGINE_INTERNALS = {
    "runtime._state",
    "group._param_group",
    "param._param",
    "runtime._root",
    "runtime._schedule",
    "group._reduce",
    "group._gather",
}
TOOLS = [
    "weights/_copy",
    "plan/_memory",
    "optim/_accumulate",
    "debug/_guard",
    "testing/_recording",
]
# Fields of states, groups and parameters that only the engine (and its queries) may read.
ENGINE_FIELDS = {"groups", "fsdp_params", "hook_handles", "shard_args", "controls", "unreduced_grads"}


@pytest.mark.parametrize("tool", TOOLS)
def test_tools_reach_the_engine_through_the_faces(tool: str) -> None:
    path = PACKAGE / f"{tool}.py"
    internals = _internal_imports(path) & ENGINE_INTERNALS
    assert not internals, f"{tool} imports the engine's internals {sorted(internals)}: use runtime's queries"
    assert "runtime" in _internal_imports(path), f"{tool} does not read the engine through runtime's face"
    reads = {
        node.attr
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_FIELDS
    }
    assert not reads, f"{tool} reads engine fields {sorted(reads)}: add a query to runtime or group"


def test_the_communication_report_reads_recordings_only() -> None:
    # Pure data processing over what record_events yielded: nothing of the engine.
    assert _graph()["trace._report"] == {"trace._events"}


def test_import_time_registrations_are_listed_in_one_place() -> None:
    """Only ``fsdp2/__init__.py`` calls anything at module level: importing a room installs nothing."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "__init__.py":
            continue
        for node in ast.parse(path.read_text(), filename=str(path)).body:
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                found.append(f"{path.relative_to(PACKAGE).as_posix()}:{node.lineno}")
    assert found == [], f"module-level calls outside fsdp2/__init__.py (list them there): {found}"
    listed = [
        node.value.func.id  # type: ignore[attr-defined]
        for node in ast.parse((PACKAGE / "__init__.py").read_text()).body
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
    ]
    assert len(listed) == 8, listed
