# /// script
# dependencies = ["nox>=2024.4.15"]
# ///
"""Developer sessions: ``nox -l`` lists them, ``nox -s NAME`` runs one.

Every session installs ``torch==2.13.0`` before the package: on these machines that resolves to a
CPU wheel already on disk, while the bare ``torch>=2.7`` requirement would pull several GB of CUDA
wheels. uv does not look where that wheel is, so sessions use the ``venv`` backend.
"""

from __future__ import annotations

from pathlib import Path

import nox

nox.needs_version = ">=2024.4.15"
nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True

TORCH = "torch==2.13.0"
LINT_PATHS = ["fsdp2", "tests", "examples", "benchmarks"]


@nox.session
def tests(session: nox.Session) -> None:
    """Single-process and thread-rank tests: no spawned processes, no GPU."""
    _install(session, "test")
    session.run("pytest", "-m", "not multiprocess and not gpu", *session.posargs)


@nox.session
def quick(session: nox.Session) -> None:
    """The quick loop: every behaviour once at world 2, no spawns (about 3 minutes on 2 cores)."""
    _install(session, "test")
    session.run("pytest", "-m", "not slow", *session.posargs)


@nox.session
def multiprocess(session: nox.Session) -> None:
    """Tests in real gloo ranks (forked from a preloaded server; about 4 minutes on 2 cores)."""
    _install(session, "test")
    session.run("pytest", "-m", "multiprocess", *session.posargs)


@nox.session
def gpu(session: nox.Session) -> None:
    """NCCL tests; skipped unless this session's torch sees a CUDA device."""
    _install(session, "test")
    has_cuda = session.run("python", "-c", "import torch; print(torch.cuda.is_available())", silent=True)
    if not isinstance(has_cuda, str) or has_cuda.strip() != "True":
        session.skip("torch.cuda.is_available() is False in this session's Python: no GPU tests to run")
    session.run("pytest", "-m", "gpu", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff lint and format check."""
    _install(session, "lint")
    session.run("ruff", "check", *LINT_PATHS, *session.posargs)
    session.run("ruff", "format", "--check", *LINT_PATHS)


@nox.session
def typecheck(session: nox.Session) -> None:
    """Type-check the package with mypy --strict (settings in pyproject.toml)."""
    _install(session, "typecheck")
    session.run("mypy", "fsdp2", *session.posargs)
    if Path("tests/typing").is_dir():
        session.run("mypy", "tests/typing")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the Sphinx docs with warnings as errors."""
    _install(session, "docs")
    session.run(
        "sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html", *session.posargs
    )


@nox.session(python=False)
def sizes(session: nox.Session) -> None:
    """Lines per fsdp2 subpackage (code, docs, blank): growth is a decision, not an accident."""
    session.run("python", ".ci/sizes", *session.posargs)


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """The benchmark suite against torch's fully_shard (benchmarks/suite.py, about 3 minutes)."""
    _install(session, "test")
    session.run("python", "benchmarks/suite.py", *session.posargs)
    session.run("python", "examples/bench_clip.py")


def _install(session: nox.Session, extra: str) -> None:
    # torch first and pinned, so the package's torch>=2.7 is already satisfied (see module docstring).
    session.install(TORCH)
    session.install("-e", f".[{extra}]")
