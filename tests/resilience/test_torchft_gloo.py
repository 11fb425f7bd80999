"""fsdp2 under torchft's fault-tolerant HSDP, wired as torchtitan 0.3.0 does, against torch's ``fully_shard``.

Two replica groups of 2 shard ranks each (4 gloo processes, CPU): inside a group the model is sharded
with ``fully_shard`` over a 2-rank mesh; across groups torchft 0.2.0 averages every reduce-scatter
output through ``set_all_reduce_hook(hook)`` on a ``ManagedProcessGroup`` (torchtitan's
``TorchFTManager.maybe_set_all_reduce_hook``, reached through ``isinstance(m, FSDPModule)`` with
``FSDPModule`` from ``torch.distributed._composable.fsdp.fully_shard``), and ``torchft.Optimizer``
skips the step a group may not commit. A lighthouse runs in the test process with
``min_replicas=2``, as in torchft's own recovery tests, so no step commits with one group alone.

The scenario, run once with fsdp2 behind torch's name (``patch_torch_fsdp()``) and once with
torch's ``fully_shard``, on the same seeds and data:

- steps 0 and 1: both groups commit every step;
- step 2: group 1 dies in its backward, at its first cross-group all-reduce (its processes exit
  without shutting anything down, as a crash would): group 0's all-reduce fails, torchft swallows
  the error, the group votes not to commit and ``torchft.Optimizer`` skips the step;
- a new group 1 starts from a fresh model and rejoins: torchft fetches the live group's state dict
  (model and optimizer, DTensors pickled over HTTP) from group 0, rank by rank, and loads it into
  the new group's modules at its first commit vote (that try commits nowhere: only one group holds
  the latest step, under ``min_replica_size=2``);
- steps 2 to 4: both groups commit; the rejoined group's parameters equal the live group's.

DiLoCo and LocalSGD (torchtitan's ``semi_sync_method``) run the same two groups without failures:
two local steps, then the sync (DiLoCo's outer step on the averaged change, LocalSGD's average of
the parameters), twice. Its sync runs in the inner
optimizer's step post-hook and reads ``optimizer.state_dict()``: with fsdp2's local-shard steps that
raised ``KeyError`` until the shards were swapped back before the post-hooks ([Note: Local shards
inside the step hooks] in ``fsdp2/optim/_local_optim.py``).

Every rank's loss at every committed step, the quorum size of each commit, and the final parameters
equal torch's run bit for bit (same collectives on the same shards in the same order). How many
times step 2 is retried before the new group has caught up depends on when its processes come up
and when the lighthouse forms each quorum (one retry in some CI runs, two in others, for torch
and fsdp2 alike), so the tests compare the commits and check that every retry is of step 2, with
step 2's loss, and commits nothing.

Each run is repeated with ``replicate`` instead of ``fully_shard`` inside the groups (``KINDS``):
fsdp2's ``replicate`` against torch's FSDP-based ``replicate_with_fsdp.replicate``. The hook then
averages across groups the output of the group's own all-reduce, and the live group sends
``Replicate()`` DTensors to the rejoining one.
"""

from __future__ import annotations

import functools
import gc
import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._harness import _PRELOAD, _free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(240)]

torchft = pytest.importorskip("torchft")

# Inside a group: fsdp2's fully_shard (behind torch's name) against torch's, and fsdp2's replicate
# against torch's FSDP-based replicate (torchft averages the in-group all-reduce's output).
KINDS = ["fully_shard", "replicate"]
_STEPS = 5
_SYNC_EVERY = 2  # DiLoCo and LocalSGD: local steps between syncs
_FAIL_AT = 2  # group 1 dies in the backward of this step, at its first cross-group all-reduce
_PROCESS_TIMEOUT_S = 90.0
_FT_TIMEOUT = timedelta(seconds=20)  # every torchft collective, commit vote and HTTP transfer


def _batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randn(4, 6, generator=generator), torch.randn(4, 5, generator=generator)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 5 output rows over 2 shards: uneven (3 and 2), so the transferred DTensors are uneven too
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 5))


def _wrap(model: torch.nn.Module, kind: str, impl: str) -> None:
    """Inside a group: each layer, then the root, sharded or replicated over the group's 2 ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    if kind == "fully_shard":
        # The names torchtitan imports (fsdp2's after patch_torch_fsdp()).
        from torch.distributed._composable.fsdp import fully_shard as wrap
    elif impl == "fsdp2":
        from fsdp2 import replicate as wrap
    else:
        from torch.distributed._composable.replicate_with_fsdp import replicate as wrap
    dim = "dp_shard" if kind == "fully_shard" else "dp_replicate"
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=(dim,))
    for layer in (model[0], model[2]):
        wrap(layer, mesh=mesh)
    wrap(model, mesh=mesh)


def _manager(
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    replica: int,
    lighthouse: str,
    use_async_quorum: bool = True,  # torchtitan's, unless a semi-sync method is set
    state_dict: Callable[[], dict[str, Any]] | None = None,
) -> Any:
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    def read_now() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optim.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=_FT_TIMEOUT),
        min_replica_size=2,
        load_state_dict=None,
        state_dict=None,
        use_async_quorum=use_async_quorum,
        replica_id=f"torchtitan_ft_{replica}",
        lighthouse_addr=lighthouse,
        timeout=_FT_TIMEOUT,
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=_FT_TIMEOUT,
    )
    manager.register_state_dict_fn("train", load_state_dict, state_dict or read_now)
    return manager


def _set_all_reduce_hooks(model: torch.nn.Module, manager: Any, before: Callable[[], None]) -> dict[str, int]:
    """torchtitan's ``maybe_set_all_reduce_hook``: average every reduce-scatter output across groups."""
    from torch.distributed._composable.fsdp.fully_shard import FSDPModule
    from torchft.process_group import ManagedProcessGroup

    replicate_pg = ManagedProcessGroup(manager)
    replicate_pg.register("dp_replicate")

    def all_reduce_hook(output: torch.Tensor) -> None:
        before()
        dist.all_reduce(output, group=replicate_pg, op=dist.ReduceOp.AVG)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(all_reduce_hook)
    # torch's class under each of its names (the last is torchtitan's)
    import torch.distributed._composable.fsdp as composable
    import torch.distributed.fsdp as public

    paths = {"fsdp": public.FSDPModule, "_composable.fsdp": composable.FSDPModule, "fully_shard": FSDPModule}
    return {path: sum(isinstance(m, cls) for m in model.modules()) for path, cls in paths.items()}


def _train(kind: str, impl: str, replica: int, life: int, lighthouse: str, out: str) -> None:
    if impl == "fsdp2":
        import fsdp2

        fsdp2.patch_torch_fsdp()
    import torchft as ft

    rank = dist.get_rank()
    model = _model()
    _wrap(model, kind, impl)
    adam = torch.optim.Adam(model.parameters(), lr=0.05)
    # The state dict torchft sends: with the async quorum torchft reads it from its quorum thread
    # while this thread runs the forward, and that read races with the forward (both implementations
    # swap a module's registered parameters around its compute; fsdp2's state_dict() also reshards
    # each group first): 3 of about 15 runs handed over plain tensors that the rejoining group could
    # not load ("mixed torch.Tensor and DTensor"), torch's run too. So, as torchtitan caches its
    # state dicts, it is read at the top of each step, before the quorum starts; its tensors are the
    # live shards, unchanged until the commit vote, after which torchft serves no more reads.
    at_step_start: dict[str, Any] = {}
    manager = _manager(model, adam, replica, lighthouse, state_dict=lambda: at_step_start)
    steps: list[dict[str, Any]] = []

    def crash_in_the_backward_of_fail_at() -> None:
        if replica == 1 and life == 0 and manager.current_step() == _FAIL_AT:
            _save(out, kind, impl, replica, life, rank, {"steps": steps, "hooked": hooked})
            os._exit(0)  # a crash mid-backward: no manager shutdown, no process group teardown

    hooked = _set_all_reduce_hooks(model, manager, crash_in_the_backward_of_fail_at)
    optim = ft.Optimizer(manager, adam)
    try:
        while manager.current_step() < _STEPS:
            step = manager.current_step()
            at_step_start.update(model=model.state_dict(), optim=adam.state_dict())
            optim.zero_grad()
            inputs, target = _batch(step, 2 * replica + rank)
            loss = torch.nn.functional.mse_loss(model(inputs), target)
            loss.backward()
            optim.step()
            steps.append(
                {
                    "step": step,
                    "loss": loss.item(),
                    "committed": manager.current_step() == step + 1,
                    "participants": manager.num_participants(),
                }
            )
        params = {name: p.full_tensor() for name, p in model.named_parameters()}
        _save(out, kind, impl, replica, life, rank, {"steps": steps, "hooked": hooked, "params": params})
    finally:
        manager.shutdown(wait=False)


def _train_semi_sync(
    method: str, kind: str, impl: str, replica: int, life: int, lighthouse: str, out: str
) -> None:
    """torchtitan's ``semi_sync_method``: local steps, then a sync in the optimizer's step post-hook.

    DiLoCo: an outer step on the averaged change (torchtitan's outer SGD); LocalSGD: the averaged
    parameters.
    """
    if impl == "fsdp2":
        import fsdp2

        fsdp2.patch_torch_fsdp()
    from torchft.local_sgd import DiLoCo, LocalSGD

    rank = dist.get_rank()
    model = _model()
    _wrap(model, kind, impl)
    inner = torch.optim.Adam(model.parameters(), lr=0.05)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)  # torchtitan's
    manager = _manager(model, inner, replica, lighthouse, use_async_quorum=False)
    if method == "diloco":
        semi_sync: Any = DiLoCo(manager, [model], inner, [outer], sync_every=_SYNC_EVERY)
    else:
        semi_sync = LocalSGD(manager, model, inner, sync_every=_SYNC_EVERY)
    losses = []
    try:
        with semi_sync:
            for step in range(2 * _SYNC_EVERY):
                inner.zero_grad()
                inputs, target = _batch(step, 2 * replica + rank)
                loss = torch.nn.functional.mse_loss(model(inputs), target)
                loss.backward()
                inner.step()  # every _SYNC_EVERY steps the post-hook syncs
                losses.append(loss.item())
        params = {name: p.full_tensor() for name, p in model.named_parameters()}
        result = {"losses": losses, "params": params, "outer_steps": manager.current_step()}
        _save(out, kind, impl, replica, life, rank, result)
    finally:
        manager.shutdown(wait=False)


def _save(out: str, kind: str, impl: str, replica: int, life: int, rank: int, result: dict[str, Any]) -> None:
    torch.save(result, Path(out) / f"{kind}-{impl}-{replica}-{life}-{rank}.pt")


def _load(out: str, kind: str, impl: str, replica: int, life: int, rank: int) -> dict[str, Any]:
    return torch.load(Path(out) / f"{kind}-{impl}-{replica}-{life}-{rank}.pt", weights_only=True)


def _rank_entry(
    cwd: str, environ: dict[str, str], port: int, rank: int, train: Callable[..., None], args: tuple[Any, ...]
) -> None:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        train(*args)
    finally:
        gc.collect()
        dist.destroy_process_group()


def _start_group(
    train: Callable[..., None], impl: str, replica: int, life: int, lighthouse: str, out: str
) -> list[Any]:
    """A replica group: 2 forked ranks with their own gloo world (and torchft's store on its port)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    port = _free_port()
    processes = [
        context.Process(
            target=_rank_entry,
            args=(os.getcwd(), dict(os.environ), port, rank, train, (impl, replica, life, lighthouse, out)),
        )
        for rank in range(2)
    ]
    for process in processes:
        process.start()
    return processes


def _join(processes: list[Any], deadline: float) -> None:
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():  # a hang: fail rather than wait for the suite's timeout
            process.kill()
            process.join()
    codes = [process.exitcode for process in processes]
    assert codes == [0] * len(processes), f"rank exit codes {codes} (negative: killed after the deadline)"


def _run_scenario(kind: str, impl: str, out: str) -> float:
    from torchft._torchft import LighthouseServer

    start = time.monotonic()
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        address = lighthouse.address()
        train = functools.partial(_train, kind)
        live = _start_group(train, impl, 0, 0, address, out)
        failing = _start_group(train, impl, 1, 0, address, out)
        _join(failing, time.monotonic() + _PROCESS_TIMEOUT_S)
        rejoined = _start_group(train, impl, 1, 1, address, out)
        deadline = time.monotonic() + _PROCESS_TIMEOUT_S
        _join(live, deadline)
        _join(rejoined, deadline)
    finally:
        lighthouse.shutdown()
    return time.monotonic() - start


def _run_semi_sync(method: str, kind: str, impl: str, out: str) -> float:
    from torchft._torchft import LighthouseServer

    start = time.monotonic()
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        groups = [
            _start_group(
                functools.partial(_train_semi_sync, method, kind), impl, replica, 0, lighthouse.address(), out
            )
            for replica in (0, 1)
        ]
        deadline = time.monotonic() + _PROCESS_TIMEOUT_S
        for group in groups:
            _join(group, deadline)
    finally:
        lighthouse.shutdown()
    return time.monotonic() - start


@pytest.fixture(scope="module", params=KINDS)
def runs(request: pytest.FixtureRequest) -> Any:
    kind = request.param
    with tempfile.TemporaryDirectory() as out:
        seconds = {impl: _run_scenario(kind, impl, out) for impl in ("torch", "fsdp2")}
        print(f"{kind} scenario wall time: {seconds}")
        yield {
            (impl, replica, life, rank): _load(out, kind, impl, replica, life, rank)
            for impl in ("torch", "fsdp2")
            for replica, life in ((0, 0), (1, 0), (1, 1))
            for rank in range(2)
        }


def _commits(result: dict[str, Any]) -> list[tuple[int, float, int]]:
    """Each committed step's (step, loss, quorum size)."""
    return [(s["step"], s["loss"], s["participants"]) for s in result["steps"] if s["committed"]]


def _retries(result: dict[str, Any]) -> list[tuple[int, float]]:
    """Each uncommitted try's (step, loss): how many there are depends on process start-up timing."""
    return [(s["step"], s["loss"]) for s in result["steps"] if not s["committed"]]


def test_both_groups_commit_every_step_with_torchs_losses(runs: dict[Any, Any]) -> None:
    for (impl, replica, life, rank), result in runs.items():
        if impl == "fsdp2":
            reference = runs["torch", replica, life, rank]
            assert (
                result["hooked"] == reference["hooked"] == dict.fromkeys(result["hooked"], 3)
            )  # root, layers
            assert _commits(result) == _commits(reference)  # every committed loss and quorum size: exact
            assert set(_retries(result)) <= set(_retries(reference)) | {
                (step, loss) for step, loss, _ in _commits(reference)
            }
    for rank in range(2):
        live, first_life = runs["fsdp2", 0, 0, rank], runs["fsdp2", 1, 0, rank]
        assert [step for step, _, _ in _commits(live)] == list(range(_STEPS))
        assert [(s["step"], s["committed"], s["participants"]) for s in first_life["steps"]] == [
            (0, True, 2),
            (1, True, 2),
        ]
        assert [s["loss"] for s in first_life["steps"]] != [s["loss"] for s in live["steps"][:_FAIL_AT]]


def test_failed_group_rejoins_from_the_live_group(runs: dict[Any, Any]) -> None:
    for rank in range(2):
        live, first_life, rejoined = (
            runs["fsdp2", 0, 0, rank],
            runs["fsdp2", 1, 0, rank],
            runs["fsdp2", 1, 1, rank],
        )
        # Step 2, first try: the peer dies mid-backward, the live group's all-reduce fails (torchft
        # swallows the error and votes no), fsdp2 finishes the backward and the optimizer step is
        # skipped. Until the new group has loaded the live group's state (at its first commit vote,
        # which commits nowhere: one group alone is under min_replica_size=2), step 2 is tried again
        # on unchanged parameters, so every retry gives step 2's loss. Then both commit steps 2 to 4.
        commits = _commits(live)
        assert [(step, size) for step, _, size in commits] == [(step, 2) for step in range(_STEPS)]
        step_2_loss = commits[_FAIL_AT][1]
        assert _retries(live)
        assert set(_retries(live)) == {(_FAIL_AT, step_2_loss)}
        assert [s["step"] for s in live["steps"]].count(_FAIL_AT) == len(_retries(live)) + 1
        assert [(step, size) for step, _, size in _commits(rejoined)] == [(2, 2), (3, 2), (4, 2)]
        assert [step for step, _ in _retries(rejoined)] == [0]  # its fresh model's try at step 0
        assert rejoined["steps"][0]["loss"] == first_life["steps"][0]["loss"]  # a fresh model at step 0
        torch.testing.assert_close(rejoined["params"], live["params"], rtol=0, atol=0)
        torch.testing.assert_close(live["params"], runs["torch", 0, 0, rank]["params"], rtol=0, atol=0)


# replicate's semi-sync path is torchft's own outer loop over the same all-reduce hook: DiLoCo covers it
@pytest.mark.parametrize(
    ("method", "kind"), [("diloco", "fully_shard"), ("local_sgd", "fully_shard"), ("diloco", "replicate")]
)
def test_semi_sync_training_matches_torchs(method: str, kind: str) -> None:
    with tempfile.TemporaryDirectory() as out:
        seconds = {impl: _run_semi_sync(method, kind, impl, out) for impl in ("torch", "fsdp2")}
        print(f"{method} {kind} wall time: {seconds}")
        results = {
            (impl, replica, rank): _load(out, kind, impl, replica, 0, rank)
            for impl in ("torch", "fsdp2")
            for replica in (0, 1)
            for rank in range(2)
        }
    for (impl, replica, rank), result in results.items():
        assert result["outer_steps"] == 2
        if impl == "fsdp2":
            reference = results["torch", replica, rank]
            assert result["losses"] == reference["losses"]
            torch.testing.assert_close(result["params"], reference["params"], rtol=0, atol=0)
            torch.testing.assert_close(result["params"], results["fsdp2", 0, rank]["params"], rtol=0, atol=0)
