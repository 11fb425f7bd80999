"""Debug mode (``fsdp2.set_debug`` / ``FSDP2_DEBUG=1``): errors and reports instead of silent hangs.

- Ranks whose models differ raise the same error on every rank at the first forward, naming the
  first parameter that differs, instead of hanging in mismatched collectives (threads here; real gloo
  processes in ``tests/debug/test_debug_gloo.py``).
- A collective that does not finish within the deadline is reported with its module group, kind and
  training state while it waits.
- With debug off, the same mismatch is not checked (no extra collective).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import fsdp2
from fsdp2.testing import RanksTimeoutError, count_collectives, run_ranks


@pytest.fixture
def debug() -> Iterator[list[str]]:
    reports: list[str] = []
    lock = threading.Lock()

    def report(message: str) -> None:
        with lock:
            reports.append(message)

    fsdp2.set_debug(True, deadline=1.0, report=report)
    try:
        yield reports
    finally:
        fsdp2.set_debug(False)


def _model(rank: int, wide_on_rank: int | None) -> nn.Module:
    torch.manual_seed(0)
    width = 8 if rank == wide_on_rank else 4
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, width), nn.Linear(width, 2))
    for layer in (model[0], model[2]):
        fsdp2.fully_shard(layer)
    fsdp2.fully_shard(model)
    return model


def test_different_models_raise_on_every_rank(debug: list[str]) -> None:
    def body(rank: int, world_size: int) -> str:
        model = _model(rank, wide_on_rank=1)
        with pytest.raises(RuntimeError, match=r"ranks manage different models") as info:
            model(torch.ones(2, 4))
        return str(info.value)

    start = time.monotonic()
    messages = run_ranks(3, body, timeout=60)
    assert time.monotonic() - start < 30
    assert len(set(messages)) == 1  # the same error on every rank
    # The root's group comes first (pre-order), and its head is where the shapes first differ.
    assert "parameter '3.weight' on rank 0 (shape (2, 4)" in messages[0]
    assert "'3.weight' on rank 1 (shape (2, 8)" in messages[0]


def test_same_models_pass_with_one_extra_collective(debug: list[str]) -> None:
    def body(rank: int, world_size: int) -> int:
        model = _model(rank, wide_on_rank=None)
        with count_collectives() as counts:
            model(torch.ones(2, 4)).sum().backward()
            model(torch.ones(2, 4)).sum().backward()  # checked once, at the first forward only
        return counts["all_gather"]

    fsdp2.set_debug(False)
    plain = run_ranks(2, body)
    fsdp2.set_debug(True, deadline=1.0)
    checked = run_ranks(2, body)
    assert checked[0] == plain[0] + 2  # all_gather_object of the fingerprint: sizes, then payloads


@pytest.mark.slow
def test_a_stuck_collective_is_reported_with_its_group_and_state(debug: list[str]) -> None:
    def body(rank: int, world_size: int) -> None:
        model = _model(rank, wide_on_rank=None)
        model(torch.ones(2, 4)).sum().backward()
        if rank == 0:
            model(torch.ones(2, 4))  # rank 1 skips this forward: rank 0 waits in the root's all-gather

    with pytest.raises(RanksTimeoutError, match=r"ranks \[0\]"):
        run_ranks(2, body, timeout=4.0)
    assert debug, "no report"
    # On a loaded machine the first forward's model check may outlast 1 s too and be reported first.
    expected = "rank 0 has waited 1 s in the all-gather of module group <root> (training state FORWARD)"
    assert any(expected in report for report in debug), debug


# ---- the FSDP2_DEBUG_* variables ----------------------------------------------------------------------

BAD_VARIABLES = [
    ("FSDP2_DEBUG_STRAGGLER", "abc", "a fraction of a step in (0, 1]"),
    ("FSDP2_DEBUG_STRAGGLER", "5", "a fraction of a step in (0, 1]"),
    ("FSDP2_DEBUG_REPLICAS", "abc", "a whole number of optimizer steps, 0 or more"),
    ("FSDP2_DEBUG_STRAGGLER_STEPS", "-3", "a whole number of optimizer steps, 0 or more"),
    ("FSDP2_DEBUG_DEADLINE", "0", "a positive number of seconds"),
    ("FSDP2_DEBUG_TIMEOUT", "nan", "a positive number of seconds"),
]


@pytest.fixture
def from_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Debug off, every numeric setting taken from its variable (as in a fresh process)."""
    from fsdp2.trace import _debug

    for key in ("deadline_s", "timeout_s", "replicas_every", "straggler_fraction", "straggler_steps"):
        monkeypatch.setattr(_debug._Settings, key, None)  # None: not given to set_debug
    monkeypatch.setattr(_debug._Settings, "enabled", False)
    return monkeypatch


@pytest.mark.parametrize(("variable", "value", "allowed"), BAD_VARIABLES)
def test_a_bad_debug_variable_is_named_when_debug_mode_is_turned_on(
    from_environment: pytest.MonkeyPatch, variable: str, value: str, allowed: str
) -> None:
    """Before, these were read at import: "abc" failed ``import fsdp2`` naming no variable, "5" and "-3"
    were taken although set_debug refuses them."""
    from fsdp2.trace._debug import debug_enabled

    from_environment.setenv(variable, value)
    with pytest.raises(ValueError, match="fsdp2 debug: ") as info:
        fsdp2.set_debug(True)
    assert f"{variable}={value!r} is not {allowed}" in str(info.value)
    assert not debug_enabled()  # nothing was switched on


def test_a_bad_variable_is_ignored_for_a_setting_passed_to_set_debug(
    from_environment: pytest.MonkeyPatch,
) -> None:
    from fsdp2.trace._debug import straggler_fraction

    from_environment.setenv("FSDP2_DEBUG_STRAGGLER", "abc")
    try:
        fsdp2.set_debug(True, straggler=0.3)
        assert straggler_fraction() == 0.3
    finally:
        fsdp2.set_debug(False)


def test_with_fsdp2_debug_set_the_first_forward_names_the_variable_on_every_rank(
    from_environment: pytest.MonkeyPatch,
) -> None:
    from fsdp2.trace import _debug

    from_environment.setenv("FSDP2_DEBUG_STRAGGLER_STEPS", "-3")
    from_environment.setattr(_debug._Settings, "enabled", True)  # as FSDP2_DEBUG=1 at import

    def body(rank: int, world_size: int) -> str:
        model = _model(rank, wide_on_rank=None)
        expected = "FSDP2_DEBUG_STRAGGLER_STEPS='-3' is not a whole number"
        with pytest.raises(ValueError, match=expected) as info:
            model(torch.ones(2, 4))
        return str(info.value)

    assert len(set(run_ranks(2, body, timeout=60))) == 1


def test_import_with_bad_variables_succeeds() -> None:
    """``import fsdp2`` does not read them: a bad value is reported where debug mode is turned on."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "FSDP2_DEBUG_STRAGGLER": "abc", "FSDP2_DEBUG_REPLICAS": "abc"}
    script = "import fsdp2\ntry:\n    fsdp2.set_debug(True)\nexcept ValueError as e:\n    print(e)\n"
    command = [sys.executable, "-c", script]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "FSDP2_DEBUG_REPLICAS='abc'" in done.stdout
    assert "FSDP2_DEBUG_STRAGGLER='abc'" in done.stdout


@pytest.mark.parametrize("name", ["deadline", "timeout", "straggler"])
def test_set_debug_names_an_argument_that_is_not_a_number(name: str) -> None:
    from fsdp2.trace._debug import debug_enabled

    with pytest.raises(TypeError, match=rf"set_debug\({name}=\.\.\.\) takes a number, got '0.2' \(str\)"):
        fsdp2.set_debug(True, **{name: "0.2"})
    assert not debug_enabled()
