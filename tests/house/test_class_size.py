"""Every class in ``fsdp2/`` fits in a head: at most 250 lines of code.

Lines of code are a class's source lines without docstrings, comment-only lines and blank lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp2"
LIMIT = 250


def code_lines(source: str, node: ast.ClassDef) -> int:
    """Lines of ``node`` that hold code (not docstrings, comments or blank lines)."""
    lines = source.splitlines()
    docstrings: set[int] = set()
    for inner in ast.walk(node):
        if isinstance(inner, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and inner.body:
            first = inner.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    end = node.end_lineno or node.lineno
    return sum(
        1
        for number in range(node.lineno, end + 1)
        if number not in docstrings
        and lines[number - 1].strip()
        and not lines[number - 1].strip().startswith("#")
    )


def class_sizes() -> dict[str, int]:
    sizes: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        for node in ast.walk(ast.parse(source, filename=str(path))):
            if isinstance(node, ast.ClassDef):
                sizes[f"{path.relative_to(PACKAGE).as_posix()}:{node.name}"] = code_lines(source, node)
    return sizes


def test_every_class_is_under_the_limit() -> None:
    sizes = class_sizes()
    assert len(sizes) > 20, "the package was not found"
    over = {name: size for name, size in sizes.items() if size > LIMIT}
    assert not over, f"classes over {LIMIT} lines of code (split them by what they own): {over}"


def test_code_lines_skip_docstrings_comments_and_blanks() -> None:
    source = (
        'class A:\n    """Doc.\n\n    More."""\n\n    # note\n    x = 1\n\n'
        '    def f(self):\n        """One."""\n        return 2\n'
    )
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.ClassDef)
    assert code_lines(source, node) == 4  # class line, x = 1, def, return
