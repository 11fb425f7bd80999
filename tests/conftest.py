"""Shared pytest configuration: Hypothesis profiles, default timeouts, the ``impl`` fixture.

Owns: the Hypothesis profiles ("ci" when the CI environment variable is set, else "dev"), the
``impl`` fixture that runs a behaviour test against both ``fsdp2`` and torch's ``fully_shard``
(ids ``fsdp2`` / ``torch``), and a default ``pytest.mark.timeout`` for tests that set none
(hangs are the failure mode of multi-rank tests; every test under ``tests/multiprocess`` gets the
``multiprocess`` marker and its longer limit). Markers are declared in pyproject.toml.
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        # every test under tests/multiprocess spawns processes, marked or not: give it their limit
        if "multiprocess" in item.path.parent.parts and item.get_closest_marker("multiprocess") is None:
            item.add_marker(pytest.mark.multiprocess)
        if item.get_closest_marker("timeout") is None:
            limit = MULTIPROCESS_TIMEOUT_S if item.get_closest_marker("multiprocess") else DEFAULT_TIMEOUT_S
            item.add_marker(pytest.mark.timeout(limit))


@pytest.fixture(params=IMPL_NAMES)
def impl(request: pytest.FixtureRequest) -> Impl:
    """The implementation under test (``fsdp2`` or torch's ``fully_shard``)."""
    return get_impl(request.param)
