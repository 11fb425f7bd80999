"""Shared pytest configuration: Hypothesis profiles, default timeouts, the ``impl`` fixture.

Owns: the Hypothesis profiles ("ci" when the CI environment variable is set, else "dev"), the
``impl`` fixture that runs a behaviour test against both ``fsdp2`` and torch's ``fully_shard``
(ids ``fsdp2`` / ``torch``), and a default ``pytest.mark.timeout`` for tests that set none
(hangs are the failure mode of multi-rank tests; a module that spawns processes says so with
``pytestmark = pytest.mark.multiprocess`` and gets their longer limit), and the ``slow`` marker that
keeps the quick loop (``-m "not slow"``) within minutes: spawned processes, the torch side of
differential tests, thread-rank worlds of 4 and more (``_quick_loop_leaves_out``), all but the first
quick case of a test marked ``first_case_in_quick_loop`` (its cases are combinations of settings), plus
tests marked ``slow``. Markers are declared in pyproject.toml. Tests live by room (``tests/<room>/``
mirrors ``fsdp2/<room>/``; ``house`` checks the package's shape, ``end_to_end`` runs the README, the
docs and real clients); cost is in the markers, not the folders.
Does not own: process groups (``_harness.py``) or the implementations (``_impls.py``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# Make ``tests`` importable as a package root for ``from tests... import`` and plain imports alike.
_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from tests._impls import IMPL_NAMES, Impl, get_impl  # noqa: E402

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

DEFAULT_TIMEOUT_S = 120
MULTIPROCESS_TIMEOUT_S = 300


def _quick_loop_leaves_out(item: pytest.Item) -> bool:
    """Whether ``-m "not slow"`` leaves this thread-rank test to the whole suite.

    The quick loop tests fsdp2 once per behaviour at the smallest world: the torch side of a
    differential test (``impl``/``impl_name`` = torch: the reference, checked again by the whole
    suite) and world sizes of 4 and more (2 shows the behaviour; 4 and 8 its scaling) are left out.
    """
    params = getattr(item, "callspec", None)
    values = params.params if params is not None else {}
    if "torch" in values.values():  # impl, impl_name, name: the torch side
        return True
    worlds = [values[name] for name in ("world_size", "world") if isinstance(values.get(name), int)]
    return _runs_thread_ranks(item) and any(world >= 4 for world in worlds)


def _runs_thread_ranks(item: pytest.Item) -> bool:
    """Whether ``item``'s module runs threads as ranks (it uses the harness's rank runners)."""
    names = vars(getattr(item, "module", None) or object)
    return "run_threaded" in names or "run_ranks" in names


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    sampled: set[str] = set()  # tests marked first_case_in_quick_loop whose first case was kept
    for item in items:
        if item.get_closest_marker("first_case_in_quick_loop") is not None and "[" in item.nodeid:
            function = item.nodeid.split("[")[0]
            if function in sampled or _quick_loop_leaves_out(item):
                item.add_marker(pytest.mark.slow)
            else:
                sampled.add(function)
        if item.get_closest_marker("multiprocess") is not None or _quick_loop_leaves_out(item):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("timeout") is None:
            limit = MULTIPROCESS_TIMEOUT_S if item.get_closest_marker("multiprocess") else DEFAULT_TIMEOUT_S
            item.add_marker(pytest.mark.timeout(limit))


@pytest.fixture(params=IMPL_NAMES)
def impl(request: pytest.FixtureRequest) -> Impl:
    """The implementation under test (``fsdp2`` or torch's ``fully_shard``)."""
    return get_impl(request.param)
