"""Peak memory of one rank, by phase and by kind of tensor: simulated before a job or measured in one.

Owns: ``MemoryTracker`` (a dispatch mode that keeps the live tensor storages of one thread, with their
sizes, and the peak of each training phase), the phase markers (model forward hooks, optimizer step
hooks), the attribution of live bytes to parameters / gradients / optimizer states / unsharded
parameters / activations, ``MemoryReport``, and ``estimate_memory`` (a fake process group of
``world_size`` ranks and fake tensors: the user's code runs as on one rank of the job, nothing is
allocated). Does not own: the model or the step (user code), sharding (``fully_shard``), running
real ranks (``fsdp2.testing``).

Bytes are storage bytes: what ``torch.cuda.memory_allocated`` counts, without the caching
allocator's block rounding. A storage shared by views counts once; a storage fsdp2 frees by
resizing to zero stops counting then.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..param import local_of
from ..runtime import states_under, take_part, unsharded_tensors
from ._own_world import SIM_BACKEND, own_world, register_simulated_backend

CATEGORIES = ("parameters", "gradients", "optimizer_states", "unsharded_parameters", "activations")
PHASES = ("init", "forward", "backward", "optimizer")
_REAL_INT_LIMIT = 1 << 22  # integer tensors made from nothing up to this many elements are real
_RECLASSIFY = 1.005  # refresh the category sets when a phase peak grows by more than 0.5%
_thread = threading.local()
_READ_VALUE = torch.ops.aten._local_scalar_dense.default  # noqa: SLF001 - the op every value read ends in
_NOT_COLLECTIVES = {"wait_tensor", "wrap_tensor_autograd"}  # functional collectives' bookkeeping ops
_C10D_KINDS = {
    "allgather_base": "all_gather",
    "allgather": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_base": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    # functional collectives (DTensor redistributions, tensor parallelism)
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}


class SimulatedValueError(RuntimeError):
    """The step read a tensor's value (``.item()``, ``.tolist()``, a branch on a tensor) while simulated."""


@dataclasses.dataclass(frozen=True)
class PhaseMemory:
    """The peak of one phase and what was live at that moment, in bytes per category."""

    peak_bytes: int
    breakdown: dict[str, int]


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Peak memory of one rank of a ``world_size``-rank job.

    ``peak_bytes`` is the highest live total of any phase; ``phases`` maps ``"init"`` (building and
    sharding the model), ``"forward"`` (the model's forward), ``"backward"`` (from the forward's
    return to the optimizer step: loss, backward, gradient reduction) and ``"optimizer"`` (the
    optimizer step) to that phase's peak and its breakdown over ``CATEGORIES``. ``collectives``
    counts the collectives the rank issued per training step, by kind.
    """

    world_size: int
    rank: int
    peak_bytes: int
    phases: dict[str, PhaseMemory]
    collectives: dict[str, float]
    simulated: bool

    @property
    def step_peak_bytes(self) -> int:
        """The peak of the training steps alone, ``init`` left out (build on the meta device)."""
        return max((p.peak_bytes for name, p in self.phases.items() if name != "init"), default=0)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda name: self.phases[name].peak_bytes)

    @property
    def breakdown(self) -> dict[str, int]:
        """The categories at the overall peak."""
        return self.phases[self.peak_phase].breakdown

    def __str__(self) -> str:
        kind = "estimated" if self.simulated else "measured"
        lines = [
            f"peak memory of rank {self.rank} of {self.world_size} ({kind}): {_mib(self.peak_bytes)} MiB "
            f"in {self.peak_phase}",
            f"{'phase':<10}{'peak':>10}" + "".join(f"{c.replace('_', ' '):>22}" for c in CATEGORIES),
        ]
        for name, phase in self.phases.items():
            cells = "".join(f"{_mib(phase.breakdown.get(c, 0)):>22}" for c in CATEGORIES)
            lines.append(f"{name:<10}{_mib(phase.peak_bytes):>10}{cells}")
        lines.append("(MiB; categories are what was live at each phase's peak)")
        return "\n".join(lines)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f}"


@dataclasses.dataclass
class _Snapshot:
    total: int
    live: dict[int, int]
    sets: dict[str, set[int]]


class MemoryTracker(TorchDispatchMode):
    """Counts the live storages created by ops on this thread and keeps each phase's peak.

    With ``simulate``, ops run on fake tensors (a ``FakeTensorMode`` must be entered before this
    mode): integer tensors made from nothing (rank maps, token ids) and ops on real tensors only run
    for real, so mesh set-up and indexing work, and reading a fake tensor's value raises
    :class:`SimulatedValueError`.
    """

    def __init__(self, *, simulate: bool = False) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # reason: torch's mode base is untyped
        self.simulate = simulate
        self.live: dict[int, int] = {}
        self.total = 0
        self.phase = "init"
        self.snapshots: dict[str, _Snapshot] = {}
        self.modules: list[nn.Module] = []
        self.optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.collectives: Counter[str] = Counter()
        self.steps = 0
        self.paused = False  # e.g. inside a threaded collective, which works for every rank at once
        self._outside: dict[int, Any] = {}  # storages made under ``outside_the_model``, kept alive
        self._making_outside = False
        self._params: list[torch.Tensor] = []
        self._sets: dict[str, set[int]] = {}
        self._sets_total = -1
        self._finalizers: list[weakref.finalize[Any, Any]] = []
        self._lock = threading.Lock()

    # -- ops --------------------------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(t is not torch.Tensor and not issubclass(t, (FakeTensor, nn.Parameter)) for t in types):
            return NotImplemented  # tensor subclasses (DTensor) decompose into ops on their locals
        if self.paused or getattr(_thread, "propagating", False):
            return func(*args, **kwargs)
        if self.simulate and func.namespace in ("c10d", "_c10d_functional"):  # real runs: the backend counts
            name = func.__name__.split(".")[0].strip("_")
            if name not in _NOT_COLLECTIVES:
                self.collectives[_C10D_KINDS.get(name, name)] += 1
        out = self._run(func, args, kwargs) if self.simulate else func(*args, **kwargs)
        for leaf in tree_leaves(out):
            if not isinstance(leaf, torch.Tensor):
                continue
            if self._making_outside:
                storage = leaf.untyped_storage()
                self._outside[storage._cdata] = storage  # noqa: SLF001 - see track
            else:
                self.track(leaf)
        return out

    @contextlib.contextmanager
    def outside_the_model(self) -> Iterator[None]:
        """Ops run as ever (real or simulated), but what they create is never counted, nor its views.

        For what a job holds before and apart from the model, such as its device mesh.
        """
        self._making_outside = True
        try:
            yield
        finally:
            self._making_outside = False

    def _run(self, func: Any, args: Any, kwargs: Any) -> Any:
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if any(isinstance(t, FakeTensor) for t in tensors):
            if func is _READ_VALUE:
                raise SimulatedValueError(
                    "estimate_memory runs the step on tensors that hold no values, but the step reads one "
                    "(e.g. loss.item(), tensor.tolist(), `if tensor:`); move that read out of train_step "
                    "or skip it when fsdp2.is_simulated() is True."
                )
            return func(*args, **kwargs)
        if tensors:  # every input is real: a real op (e.g. on a mesh's rank map)
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        out = func(*args, **kwargs)
        fake = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        small_ints = all(not t.is_floating_point() and not t.is_complex() for t in fake) and (
            sum(t.numel() for t in fake) <= _REAL_INT_LIMIT
        )
        if fake and small_ints:
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return out

    # -- storages ---------------------------------------------------------------------------------

    def track(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta" or (not self.simulate and isinstance(tensor, FakeTensor)):
            return  # no memory: DTensor's shape inference (a fake tensor reports its fake device)
        storage = tensor.untyped_storage()
        key = storage._cdata  # noqa: SLF001 - the storage's identity while it is alive
        if key in self._outside:
            return
        nbytes = storage.nbytes()
        with self._lock:
            old = self.live.get(key)
            if old == nbytes:
                return
            if old is None:
                self._finalizers.append(weakref.finalize(storage, self._freed, key))
            self.live[key] = nbytes
            self.total += nbytes - (old or 0)
        self._check_peak()

    def resized(self, storage: Any) -> None:
        key = storage._cdata  # noqa: SLF001 - see track
        if key in self._outside:
            return
        nbytes = storage.nbytes()
        with self._lock:
            old = self.live.get(key)
            if old is None:
                if nbytes == 0:
                    return
                self._finalizers.append(weakref.finalize(storage, self._freed, key))
            self.live[key] = nbytes
            self.total += nbytes - (old or 0)
        self._check_peak()

    def _freed(self, key: int) -> None:
        with self._lock:
            nbytes = self.live.pop(key, None)
            if nbytes is not None:
                self.total -= nbytes

    def _check_peak(self) -> None:
        snap = self.snapshots.get(self.phase)
        if snap is not None and self.total <= snap.total:
            return
        if self.total > self._sets_total * _RECLASSIFY or self._sets_total < 0:
            self._sets = self._category_sets()
            self._sets_total = self.total
        self.snapshots[self.phase] = _Snapshot(self.total, dict(self.live), self._sets)

    def close(self) -> None:
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers.clear()
        self._outside.clear()

    # -- phases and categories --------------------------------------------------------------------

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self._sets_total = -1
        self._check_peak()

    def before_forward(self, modules: list[nn.Module]) -> None:
        # Runs before fsdp2's own pre-forward: the module still holds its sharded parameters.
        self._params = [p for m in modules for p in m.parameters()]
        self._params += [b for m in modules for b in m.buffers()]
        self.set_phase("forward")

    def _category_sets(self) -> dict[str, set[int]]:
        sets: dict[str, set[int]] = {c: set() for c in CATEGORIES}
        params = self._params or [p for m in self.modules for p in (*m.parameters(), *m.buffers())]
        for param in params:
            _add(sets["parameters"], param)
            _add(sets["gradients"], param.grad)
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                for value in state.values():
                    _add(sets["optimizer_states"], value)
        for module in self.modules:
            for state in states_under(module):
                for tensor in unsharded_tensors(state):
                    _add(sets["unsharded_parameters"], tensor)
        return sets

    def report(self, world_size: int, rank: int) -> MemoryReport:
        phases: dict[str, PhaseMemory] = {}
        for name in (*PHASES, *sorted(set(self.snapshots) - set(PHASES))):
            snap = self.snapshots.get(name)
            if snap is not None:
                phases[name] = PhaseMemory(
                    snap.total, _breakdown(snap, "parameters" if name == "init" else "activations")
                )
        steps = max(self.steps, 1)
        return MemoryReport(
            world_size=world_size,
            rank=rank,
            peak_bytes=max((p.peak_bytes for p in phases.values()), default=0),
            phases=phases,
            collectives={k: v / steps for k, v in sorted(self.collectives.items())},
            simulated=self.simulate,
        )


def _add(keys: set[int], tensor: Any) -> None:
    if tensor is None or not isinstance(tensor, torch.Tensor):
        return
    if isinstance(tensor, DTensor):
        tensor = local_of(tensor)
    storage = tensor.untyped_storage()
    if storage.nbytes():
        keys.add(storage._cdata)  # noqa: SLF001 - see MemoryTracker.track


def _breakdown(snap: _Snapshot, other: str) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    order = ("unsharded_parameters", "parameters", "gradients", "optimizer_states")
    for key, nbytes in snap.live.items():
        category = next((c for c in order if key in snap.sets.get(c, ())), other)
        out[category] += nbytes
    return out


# -- phase markers and storage resizes -------------------------------------------------------------


def current_tracker() -> MemoryTracker | None:
    tracker: MemoryTracker | None = getattr(_thread, "tracker", None)
    return tracker


_resize_lock = threading.Lock()
_resize_users = 0
_original_resize: Any = None


def _resize_and_report(storage: Any, nbytes: int) -> Any:
    out = _original_resize(storage, nbytes)
    tracker = current_tracker()
    if tracker is not None:
        tracker.resized(storage)
    return out


def _optimizer_pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
    tracker = current_tracker()
    if tracker is not None:
        tracker.optimizers.add(optimizer)
        tracker.set_phase("optimizer")


def _optimizer_post_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
    tracker = current_tracker()
    if tracker is not None:
        tracker.steps += 1
        tracker.set_phase("after_step")


@contextlib.contextmanager
def process_hooks() -> Iterator[None]:
    """Process-wide patches the trackers need (reference counted, shared by nested and concurrent uses).

    Storage resizes and optimizer steps reach the tracker of the thread that made them.
    """
    global _resize_users, _original_resize
    with _resize_lock:
        if _resize_users == 0:
            _original_resize = torch.UntypedStorage.resize_
            torch.UntypedStorage.resize_ = _resize_and_report  # type: ignore[method-assign,assignment]  # reason: a wrapper
            _thread_hooks.append(take_part(before=_optimizer_pre_hook, after=_optimizer_post_hook))
        _resize_users += 1
    try:
        yield
    finally:
        with _resize_lock:
            _resize_users -= 1
            if _resize_users == 0:
                torch.UntypedStorage.resize_ = _original_resize  # type: ignore[method-assign]
                for leave in _thread_hooks:
                    leave()
                _thread_hooks.clear()


_thread_hooks: list[Any] = []


@contextlib.contextmanager
def tracking(tracker: MemoryTracker) -> Iterator[MemoryTracker]:
    """Make ``tracker`` this thread's tracker and enter it (inside ``process_hooks``)."""
    previous = current_tracker()
    _thread.tracker = tracker
    try:
        with tracker:
            yield tracker
    finally:
        _thread.tracker = previous
        tracker.close()


def watch_modules(tracker: MemoryTracker, built: Any) -> list[Any]:
    """Mark forward phases on the modules ``build_model`` returned; returns the hook handles."""
    modules = _modules_in(built)
    tracker.modules = modules
    tracker.optimizers.update(o for o in _leaves(built) if isinstance(o, torch.optim.Optimizer))
    handles = []
    for module in modules:
        handles.append(
            module.register_forward_pre_hook(lambda *_: tracker.before_forward(modules), prepend=True)
        )
        handles.append(
            module.register_forward_hook(lambda *_: tracker.set_phase("backward"), always_call=True)
        )
    return handles


def _check_materialized(modules: list[nn.Module], handles: list[Any]) -> None:
    """Meta tensors hold no memory and compute nothing: an estimate over them would read zero."""
    meta = [
        name
        for module in modules
        for name, tensor in (*module.named_parameters(), *module.named_buffers())
        if (local_of(tensor) if isinstance(tensor, DTensor) else tensor).is_meta
    ]
    if meta:
        for handle in handles:
            handle.remove()
        raise ValueError(
            f"build_model returned a model with tensors on the meta device ({', '.join(meta[:3])}"
            f"{', ...' if len(meta) > 3 else ''}); materialize them as the job does, e.g. "
            "model.to_empty(device='cpu') and reset_parameters() under fsdp2.init_like_unsharded(), "
            "inside build_model."
        )


def _leaves(built: Any) -> list[Any]:
    if isinstance(built, (tuple, list)):
        return [x for item in built for x in _leaves(item)]
    if isinstance(built, dict):
        return [x for item in built.values() for x in _leaves(item)]
    return [built]


def _modules_in(built: Any) -> list[nn.Module]:
    modules = [m for m in _leaves(built) if isinstance(m, nn.Module)]
    if not modules:
        raise TypeError(
            f"build_model must return the model (an nn.Module), or a tuple, list or dict holding it "
            f"(e.g. (model, optimizer)); got {type(built).__name__}."
        )
    return modules


def run_tracked(
    tracker: MemoryTracker, build_model: Callable[[], Any], train_step: Callable[[Any], Any], steps: int
) -> None:
    """Build the model and run ``steps`` training steps with ``tracker`` counting (this thread)."""
    with tracking(tracker):
        tracker.set_phase("init")
        built = build_model()
        handles = watch_modules(tracker, built)
        _check_materialized(tracker.modules, handles)
        try:
            for _ in range(steps):
                before = tracker.steps
                train_step(built)
                tracker.steps = max(tracker.steps, before + 1)
                tracker.set_phase("after_step")
        finally:
            for handle in handles:
                handle.remove()


# -- the simulated world ---------------------------------------------------------------------------


def is_simulated() -> bool:
    """True while ``estimate_memory`` runs the user's code on this thread (tensors hold no values)."""
    tracker = current_tracker()
    return tracker is not None and tracker.simulate


def estimate_memory(
    build_model: Callable[[], Any],
    train_step: Callable[[Any], Any],
    *,
    world_size: int,
    rank: int = 0,
    steps: int = 2,
) -> MemoryReport:
    """Estimate the peak memory of one rank of a ``world_size``-rank job, without running the job.

    Sets up a process group of ``world_size`` simulated ranks (collectives do nothing) as the
    default group, then calls ``build_model()`` and ``train_step(built)`` ``steps`` times, where
    ``built`` is what ``build_model`` returned (the model, or a tuple/list/dict holding it and its
    optimizer). Your code runs as on rank ``rank`` of the job: it creates meshes
    (``init_device_mesh("cpu", (world_size,))``), calls ``fully_shard``, builds inputs, runs forward,
    backward and ``optimizer.step()``. Tensors are fake: they have shapes, dtypes and devices but no
    values, and nothing is allocated, so a 70B-parameter model can be estimated on a laptop. The
    step must not read values (``loss.item()``); :func:`is_simulated` tells it when to skip.

    Two steps by default: optimizer states appear in the first step and stay for the second.

    Returns:
        A :class:`MemoryReport`: ``peak_bytes``, and per phase the peak and its breakdown
        (parameters, gradients, optimizer states, unsharded parameters, activations and
        temporaries). ``print(report)`` shows a table.

    It may run inside a job, on any rank: the simulation has a c10d world of its own, and the job's
    process groups are left as they were (no other thread may issue collectives meanwhile).

    Raises:
        SimulatedValueError: the step read a tensor's value.
    """
    _check_int("steps", steps, 1)
    callables: tuple[object, object] = (build_model, train_step)
    if not all(callable(c) for c in callables):
        raise TypeError("estimate_memory(build_model, train_step, ...) needs two callables.")
    tracker = MemoryTracker(simulate=True)
    with simulated_world(world_size, rank):
        run_tracked(tracker, build_model, train_step, steps)
    return tracker.report(world_size, rank)


@contextlib.contextmanager
def simulated_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """This thread as rank ``rank`` of ``world_size``: a no-op default process group, fake tensors."""
    _check_int("world_size", world_size, 1)
    _check_int("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"estimate_memory: rank must be in [0, world_size={world_size}), got {rank}.")
    register_simulated_backend()
    propagator = ShardingPropagator._fake_mode_lock  # noqa: SLF001 - see _ShapeInference
    with own_world():
        ShardingPropagator._fake_mode_lock = _ShapeInference(propagator)  # type: ignore[assignment]  # noqa: SLF001 - idem
        dist.init_process_group(SIM_BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)  # type: ignore[attr-defined]  # reason: HashStore is not re-exported in the stubs
        try:
            with process_hooks(), FakeTensorMode(allow_non_fake_inputs=True):
                yield
        finally:
            ShardingPropagator._fake_mode_lock = propagator  # noqa: SLF001 - restore


class _ShapeInference:
    """Marks DTensor's shape inference, which runs on our fake mode when one is active.

    A real run infers shapes on a private fake mode that no tracker sees; in the simulated world
    DTensor reuses ours, and its scratch tensors are not the job's memory.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __enter__(self) -> None:
        self.inner.__enter__()
        self.previous = getattr(_thread, "propagating", False)
        _thread.propagating = True

    def __exit__(self, *exc: object) -> None:
        _thread.propagating = self.previous
        self.inner.__exit__(*exc)


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"estimate_memory: {name} must be an int >= {minimum}, got {value!r}.")
