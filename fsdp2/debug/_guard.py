"""Debug mode's divergence guard: before each FSDP collective, its ranks agree that they issue the same one.

Owns: ``DivergenceError``; the agreement (``Agreement``: each rank writes a short description of the
collective it is about to issue into the job's c10d store under the process group's next sequence
number, reads every other rank's, and every rank raises the same error if they differ, or if a rank
has not arrived after the debug timeout); the comm wrappers that run it, installed through
``runtime``'s ``wrap_comms`` at a root's lazy init while debug mode is on; and the check at the entry of the
full-weight export and import; and the count of optimizer steps over each guarded root's parameters
(a participant in the optimizer post-step hook, ``runtime._optimizer_hooks``), which every
description carries, so the collectives of two different steps never pair up; each agreement's wait
is handed to the root's ``StragglerWatch`` (``_straggler_watch.py``). Does not own: the
collectives (the groups' comms), the debug switch and its settings (``_debug``), or what the root's
first forward compares once (``check_same_model``).
Invariants: every rank of a process group numbers the FSDP collectives it issues there in the same
order, so a sequence number pairs the collectives that c10d would pair; a rank keeps at most two of
its own keys per process group in the store (it deletes the one of two collectives ago, which every
rank has read before writing the one after it); a rank that gives up overwrites its key with the
reason, so a rank arriving later raises at once instead of waiting too.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]
from torch.distributed.tensor import DTensor

from ..comm import ForwardingComm
from ..param import local_of
from ..runtime import GroupFacts, data_parallel_groups, groups_under, sharded_params, take_part, wrap_comms
from ..trace import debug_enabled, guard_timeout, replica_check_every
from ._board import Board, Outcome, board_key, digest, open_board
from ._replicas import check_replicas
from ._straggler_watch import StragglerWatch


class DivergenceError(RuntimeError):
    """Ranks were about to issue different FSDP collectives (raised in debug mode, on every rank)."""


_PHASES = {"idle": "outside forward and backward", "forward": "forward", "backward": "backward"}


@dataclass(frozen=True)
class Point:
    """What a rank is about to do: one FSDP collective, or the entry of an export or import.

    ``trainable`` has one character per parameter of the group ("1": ``requires_grad``). ``steps``:
    optimizer steps taken so far over the root's parameters; ``since``: forwards of the root begun
    since the last of them (since the start before the first).
    """

    kind: str
    module: str
    iteration: int
    phase: str
    grad_enabled: bool
    gradient_sync: bool
    numel: int
    dtype: str
    trainable: str
    steps: int = 0
    since: int = 0

    def encode(self) -> str:
        """JSON of the fields the ranks must agree on, then ``#`` and the counts shown, not compared.

        Shown only: the iteration and ``since`` count the root's forwards, including forwards that
        issue no collective (all parameters already unsharded), which a rank may run alone without
        harm. ``steps`` is compared: collectives of different optimizer steps must never pair up.
        """
        fields = [  # every field but the two shown, in order (``decode`` reads them back so)
            self.kind,
            self.module,
            self.phase,
            self.grad_enabled,
            self.gradient_sync,
            self.numel,
            self.dtype,
            self.trainable,
            self.steps,
        ]
        return f"{json.dumps(fields)}#{self.iteration},{self.since}"

    @classmethod
    def decode(cls, text: str) -> Point:
        fields, _, shown = text.rpartition("#")
        iteration, since = (int(n) for n in shown.split(","))
        kind, module, phase, grad_enabled, gradient_sync, numel, dtype, trainable, steps = json.loads(fields)
        return cls(
            kind, module, iteration, phase, grad_enabled, gradient_sync, numel, dtype, trainable, steps, since
        )

    @property
    def is_entry(self) -> bool:
        """The entry of an export or import rather than a collective of a group."""
        return self.numel < 0

    def __str__(self) -> str:
        if self.is_entry:
            return f"the entry of fsdp2.{self.kind}()"
        grad = "" if self.grad_enabled else ", gradients off"
        sync = "on" if self.gradient_sync else "off"
        step = f", {self.forwards()}" if self.steps else ""
        return (
            f"the {self.collective} of module {self.module or '<root>'!r} ({self.numel:,} "
            f"{self.dtype} elements) in iteration {self.iteration} ({_PHASES.get(self.phase, self.phase)}"
            f"{grad}), gradient sync {sync}{step}"
        )

    @property
    def collective(self) -> str:
        """The kind as written: ``all-gather``, ``reduce-scatter``, ``all-reduce``, ``all-to-all``."""
        return self.kind.replace("_", "-")

    def forwards(self) -> str:
        """Where the rank is between optimizer steps: ``3rd forward since optimizer step 2``."""
        if self.since == 0:
            return f"just after optimizer step {self.steps}" if self.steps else "before any forward"
        after = f"since optimizer step {self.steps}" if self.steps else "before any optimizer step"
        return f"{_ordinal(self.since)} forward {after}"

    def position(self) -> str:
        """The same after "ranks [0] are": ``at their 3rd forward since optimizer step 2``."""
        return f"at their {self.forwards()}" if self.since else self.forwards()


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


_ABORT = "abort:"
_lock = threading.Lock()
_clients: dict[tuple[str, int, float], Any] = {}


def _store(timeout: float) -> tuple[Any, bool]:
    """A store whose blocking reads give up after ``timeout``; ``True`` if it waits by itself.

    A TCP store (torchrun, ``env://``) gets a client of its own with that timeout, so one read waits
    and fetches; another store (the in-process one of thread ranks) is asked to wait first.
    """
    default = dist.distributed_c10d._get_default_store()  # noqa: SLF001 - the job's store has no public accessor
    base = default
    while isinstance(base, PrefixStore):
        base = base.underlying_store
    if not isinstance(base, TCPStore):
        return default, False
    key = (base.host, base.port, timeout)
    with _lock:
        client = _clients.get(key)
        if client is None:
            wait = timedelta(seconds=timeout)
            client = TCPStore(base.host, base.port, None, False, timeout=wait, wait_for_workers=False)
            _clients[key] = client
    return client, True


class _Channel:
    """One rank's side of the agreement in one process group: its ranks, keys, store and next number.

    ``board``: the ranks' shared-memory board when they share a host (``_board.py``), set up at the
    first agreement; ``None`` before, ``False`` where the store carries every agreement. ``last``: the
    point of the last agreement passed (every rank passed it too).
    """

    __slots__ = ("board", "last", "me", "prefix", "ranks", "seq", "store", "timeout", "waits")

    def __init__(self, group: dist.ProcessGroup, timeout: float) -> None:
        self.ranks = dist.get_process_group_ranks(group)
        self.me = dist.get_rank()
        self.prefix = f"fsdp2_guard/{group.group_name}/"
        self.timeout = timeout
        self.store, self.waits = _store(timeout)
        self.seq = 0
        self.board: Board | bool | None = None
        self.last: Point | None = None


# Per process group (each rank's own object, also when ranks are threads of one process).
_channels: weakref.WeakKeyDictionary[dist.ProcessGroup, _Channel] = weakref.WeakKeyDictionary()


def _channel(group: dist.ProcessGroup) -> _Channel:
    timeout = guard_timeout()
    channel = _channels.get(group)
    if channel is None:
        channel = _Channel(group, timeout)
        with _lock:
            channel = _channels.setdefault(group, channel)
    elif channel.timeout != timeout:  # set_debug(timeout=...) changed it: same numbers, new reads
        channel.store, channel.waits = _store(timeout)
        channel.timeout = timeout
    return channel


def agree(point: Point, group: dist.ProcessGroup) -> float:
    """Raise ``DivergenceError`` on every rank of ``group`` unless all are about to do ``point``.

    Ranks on one host meet on a shared-memory board (a digest of the point each), and go to the store
    only to explain a difference; ranks on several hosts exchange the points through the store.
    Returns the seconds this rank waited there for the others (on its own clock).
    """
    c = _channel(group)
    if len(c.ranks) < 2:
        return 0.0
    start = time.perf_counter()
    seq = c.seq
    c.seq = seq + 1
    if c.board is None:
        c.board = _open_board(c, point)
    mine = point.encode().encode()
    if isinstance(c.board, Board):
        _agree_on_board(c, c.board, seq, point, mine)
    else:
        _agree_by_store(c, seq, point, mine)
    c.last = point
    return time.perf_counter() - start


def _open_board(c: _Channel, point: Point) -> Board | bool:
    """The ranks' board if every one could map it, else ``False``; raises if a rank never comes."""
    try:
        return open_board(c.store, c.prefix, c.ranks, c.me, c.timeout, c.waits) or False
    except (dist.DistStoreError, RuntimeError) as exc:  # a rank did not come to its first agreement
        missing = [r for r in c.ranks if not c.store.check([board_key(c.prefix, r)])]
        message = _missing(point, c.me, c.timeout, missing, None)
        raise DivergenceError(message) from exc


def _agree_on_board(c: _Channel, board: Board, seq: int, point: Point, mine: bytes) -> None:
    outcome = board.meet(seq, digest(mine.rpartition(b"#")[0]), c.timeout)
    if outcome is Outcome.SAME:
        return
    if outcome is Outcome.ABORTED:
        raise DivergenceError(c.store.get(f"{c.prefix}abort").decode())
    if outcome is Outcome.LATE:
        message = _missing(point, c.me, c.timeout, board.missing(seq), c.last)
        c.store.set(f"{c.prefix}abort", message.encode())
        board.abort()
        raise DivergenceError(message)
    # The digests differ: every rank is here, so the points come through the store at once (it raises).
    _agree_by_store(c, seq, point, mine)


def _agree_by_store(c: _Channel, seq: int, point: Point, mine: bytes) -> None:
    prefix, store = c.prefix, c.store
    keys = [f"{prefix}{seq}/{rank}" for rank in c.ranks]
    store.set(f"{prefix}{seq}/{c.me}", mine)
    try:
        if not c.waits:
            store.wait(keys, timedelta(seconds=c.timeout))
        values = store.multi_get(keys)
    except (dist.DistStoreError, RuntimeError) as exc:
        message = _late(point, c.ranks, c.me, seq, prefix, store, c.timeout)
        store.set(f"{prefix}{seq}/{c.me}", _ABORT + message)
        raise DivergenceError(message) from exc
    if seq >= 2:
        store.delete_key(f"{prefix}{seq - 2}/{c.me}")
    core = mine.rpartition(b"#")[0]
    if all(v.rpartition(b"#")[0] == core for v in values):
        return
    texts = [v.decode() for v in values]
    aborted = [t for t in texts if t.startswith(_ABORT)]
    if aborted:
        raise DivergenceError(aborted[0][len(_ABORT) :])
    raise DivergenceError(_differ(c.ranks, [Point.decode(t) for t in texts], point))


def _late(point: Point, ranks: list[int], me: int, seq: int, prefix: str, store: Any, timeout: float) -> str:
    """The error of a rank whose peers did not all arrive (store path): who is missing, their last point."""
    missing = [r for r in ranks if not store.check([f"{prefix}{seq}/{r}"])]
    last: dict[int, str | None] = {}
    for rank in missing:
        previous = f"{prefix}{seq - 1}/{rank}"
        if seq == 0 or not store.check([previous]):
            last[rank] = None
        else:
            text = store.get(previous).decode()
            last[rank] = text[len(_ABORT) :] if text.startswith(_ABORT) else str(Point.decode(text))
    return _missing_text(point, me, timeout, missing, last)


def _missing(point: Point, me: int, timeout: float, missing: list[int], last: Point | None) -> str:
    """The same for the board, where every rank passed the same last point (``None``: none yet)."""
    done = None if last is None else str(last)
    return _missing_text(point, me, timeout, missing, dict.fromkeys(missing, done))


def _missing_text(
    point: Point, me: int, timeout: float, missing: list[int], last: dict[int, str | None]
) -> str:
    lines = [
        f"fsdp2 debug: rank {me} waited {timeout:g} s for ranks {missing} at {point}; they did not reach "
        "it (nor any other FSDP collective)."
    ]
    for rank in missing:
        if last[rank] is None:
            lines.append(f"  rank {rank} has not issued an FSDP collective in this process group yet.")
        else:
            lines.append(f"  rank {rank}'s last FSDP collective was {last[rank]}.")
    lines.append(
        "The ranks that did not arrive skipped FSDP work the others do: an evaluation or export run on "
        "some ranks only, a different number of micro-batches, or an exception on that rank. If a rank "
        f"is only slower than {timeout:g} s between two collectives (data loading, logging, checkpoint "
        "writing), raise the limit: fsdp2.set_debug(True, timeout=...) or FSDP2_DEBUG_TIMEOUT."
    )
    return "\n".join(lines)


def _differ(ranks: list[int], points: Sequence[Point], mine: Point) -> str:
    """The same error on every rank: what each rank is about to do, the first difference and its fix."""
    by_point: dict[Point, list[int]] = {}
    for rank, p in zip(ranks, points, strict=True):
        by_point.setdefault(p, []).append(rank)
    first, second = list(by_point)[:2]
    lines = [
        f"fsdp2 debug: ranks diverged: they are about to issue different FSDP collectives "
        f"(process group of ranks {ranks})."
    ]
    lines += [f"  ranks {group_ranks}: {p}" for p, group_ranks in by_point.items()]
    lines.append(_cause(first, by_point[first], second, by_point[second], mine))
    return "\n".join(lines)


def _cause(a: Point, ranks_a: list[int], b: Point, ranks_b: list[int], mine: Point) -> str:
    if a.is_entry or b.is_entry:
        entry, entry_ranks, others = (a, ranks_a, ranks_b) if a.is_entry else (b, ranks_b, ranks_a)
        return (
            f"Ranks {entry_ranks} called fsdp2.{entry.kind}() and ranks {others} did not: it gathers (or "
            "broadcasts) every tensor collectively, so call it on every rank (only rank 0 touches the file)."
        )
    if a.steps != b.steps:
        return (
            f"The ranks are in different optimizer steps: ranks {ranks_a} are {a.position()}, ranks "
            f"{ranks_b} {b.position()}. They ran different numbers of micro-batches "
            "before optimizer.step() (or stepped on some ranks only): run the same number of "
            "micro-batches on every rank (drop or pad the last batch), and step on every rank."
        )
    if a.phase != b.phase and "idle" in (a.phase, b.phase):
        return _outside(*((a, ranks_a, b, ranks_b) if a.phase == "idle" else (b, ranks_b, a, ranks_a)))
    if a.trainable != b.trainable and a.kind == b.kind and a.module == b.module:
        names = _NAMES.get((mine.module, len(mine.trainable)), [])
        index = next(i for i, (x, y) in enumerate(zip(a.trainable, b.trainable, strict=True)) if x != y)
        name = names[index] if index < len(names) else f"#{index}"
        return (
            f"Parameter {name!r} has requires_grad={a.trainable[index] == '1'} on ranks {ranks_a} and "
            f"{b.trainable[index] == '1'} on ranks {ranks_b}: freeze or unfreeze parameters on every rank."
        )
    if a.gradient_sync != b.gradient_sync:
        return (
            "Gradient sync differs between ranks (set_requires_gradient_sync, or no_sync-style accumulation "
            "with a different number of micro-batches per rank): set it to the same value on every rank."
        )
    if a.iteration != b.iteration or a.phase != b.phase:
        return (
            "The ranks are at different points of training: a forward or backward ran on some ranks only "
            "(an extra micro-batch, an evaluation, a forward run twice before its backward)."
        )
    if a.grad_enabled != b.grad_enabled:
        return (
            "Some ranks run this forward without gradients (an evaluation under torch.no_grad() on some "
            "ranks only?): run FSDP modules on every rank, or evaluate an unsharded copy."
        )
    if a.kind == b.kind and a.module == b.module:
        return (
            "The same collective has different buffers on different ranks (a parameter resized or cast on "
            "some ranks only): every rank must hold the same parameters."
        )
    return (
        "The ranks run different FSDP modules here (a module skipped or repeated on some ranks, an explicit "
        "unshard() on some ranks only): every rank must run the same fully_shard modules in the same order."
    )


def _doing(p: Point) -> str:
    """What the collective does, in words: ``gather module '2'``, ``reduce the gradients of ...``."""
    module = repr(p.module or "<root>")
    if p.kind == "all_gather":
        return f"gather module {module}"
    return f"reduce the gradients of module {module} (a {p.collective})"


def _outside(idle: Point, idle_ranks: list[int], busy: Point, busy_ranks: list[int]) -> str:
    """The cause when some ranks issue a collective outside forward and backward and the others inside."""
    where = f"while ranks {busy_ranks} {_doing(busy)} in the {busy.phase} of iteration {busy.iteration}"
    if idle.kind == "all_gather":
        return (
            f"Ranks {idle_ranks} {_doing(idle)} outside forward and backward (an explicit unshard() on some "
            f"ranks only?) {where}: call it on every rank, or not at all."
        )
    # Outside backward only the exit of fsdp2.accumulate() reduces (the gradients it kept).
    return (
        f"Ranks {idle_ranks} {_doing(idle)} outside forward and backward, as the exit of fsdp2.accumulate() "
        f"does to the gradients it kept, {where}: the ranks ran different numbers of micro-batches inside "
        "fsdp2.accumulate(). Run the same number on every rank (drop or pad the last batch)."
    )


# Parameter names by (module, count), to name the one whose requires_grad differs; written at install.
_NAMES: dict[tuple[str, int], list[str]] = {}


class Guarded(ForwardingComm):
    """A group's collective, issued only after its process group's ranks agree on it."""

    def __init__(self, wrapped: Any, kind: str, facts: GroupFacts, steps: _Steps) -> None:
        super().__init__(wrapped)
        self._kind, self._facts, self._steps = kind, facts, steps

    def seen(self, first: torch.Tensor, *args: Any) -> None:
        if not debug_enabled():
            return
        if self._kind == "all_reduce":  # (tensor, group, op)
            tensor, group = first, args[0]
        else:  # (output, input, group, ...)
            tensor, group = args[0], args[1]
        facts, steps = self._facts, self._steps
        trainable = facts.trainable()
        iteration = facts.iteration()
        point = Point(
            self._kind,
            facts(),
            iteration,
            facts.phase(),
            torch.is_grad_enabled(),
            facts.gradient_sync(),
            tensor.numel(),
            str(tensor.dtype).removeprefix("torch."),
            "".join("1" if flag else "0" for _, flag in trainable),
            steps.count,
            iteration - steps.mark,
        )
        steps.watch.waited(group, self._kind, point.module, agree(point, group))


class _Steps:
    """The optimizer steps over one guarded root's parameters: how many, and the root's iteration at the last.

    Counted by ``_count_step`` (a global optimizer step post-hook) for every optimizer that holds a
    sharded parameter of one of the root's groups (read from the root module, held weakly: no list of
    groups here); held by the root's ``Guarded`` comms (it lives as long as they do) and listed weakly
    in ``_all_steps``.
    """

    __slots__ = ("__weakref__", "_root", "count", "facts", "mark", "watch")

    def __init__(self, root: nn.Module) -> None:
        self._root = weakref.ref(root)
        self.watch = StragglerWatch()  # the waits at this root's agreements: a straggler is named
        self.facts: GroupFacts | None = None  # one group's, to read the root's iteration
        self.count = 0
        self.mark = 0

    def tensor_ids(self) -> set[int]:
        """Ids of the sharded parameters and of their local tensors (what ``local_step`` swaps in)."""
        root = self._root()
        groups = groups_under(root) if root is not None else []
        params = [p for group in groups for p in sharded_params(group)]
        return {id(p) for p in params} | {id(local_of(p)) for p in params if isinstance(p, DTensor)}

    def guards(self, root: nn.Module) -> bool:
        """Whether these are the steps of ``root``."""
        return self._root() is root

    def stepped(self) -> None:
        self.count += 1
        self.mark = self.facts.iteration() if self.facts is not None else 0
        self.watch.stepped()
        every = replica_check_every()
        root = self._root()
        if every and self.count % every == 0 and root is not None:
            check_replicas(root)  # every rank steps: a collective every rank reaches


_all_steps: weakref.WeakSet[_Steps] = weakref.WeakSet()
_generation = 0  # bumped when a root's steps are added: cached optimizer maps are rebuilt
# optimizer -> ((generation, parameter count), the steps of the roots it steps)
_by_optimizer: weakref.WeakKeyDictionary[Any, tuple[tuple[int, int], list[Any]]] = weakref.WeakKeyDictionary()
_step_hook: list[Any] = []


def _watch_steps(steps: _Steps) -> None:
    global _generation
    with _lock:
        _all_steps.add(steps)
        _generation += 1
        if not _step_hook:
            _step_hook.append(take_part(after=_count_step))


def _params_of(optimizer: torch.optim.Optimizer) -> Iterable[Any]:
    return (p for param_group in optimizer.param_groups for p in param_group["params"])


def _count_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Count a step for each guarded root whose sharded parameters ``optimizer`` holds.

    The roots of an optimizer are looked up at its first step after a root was guarded and kept while
    its parameter count stays; from its second step on ``local_step`` may hold local tensors in
    ``param_groups`` during the step, which the lookup matches too.
    """
    if not _all_steps:  # no guarded root is alive: leave the optimizer hooks until the next one
        with _lock:
            if not _all_steps and _step_hook:
                _step_hook.pop()()
        return
    key = (_generation, sum(len(param_group["params"]) for param_group in optimizer.param_groups))
    cached = _by_optimizer.get(optimizer)
    if cached is None or cached[0] != key:
        with _lock:
            candidates = list(_all_steps)
        ids = {id(p) for p in _params_of(optimizer)}
        found = [weakref.ref(s) for s in candidates if not ids.isdisjoint(s.tensor_ids())]
        cached = (key, found)
        _by_optimizer[optimizer] = cached
    for ref in cached[1]:
        steps = ref()
        if steps is not None:
            steps.stepped()


_guarded_roots: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def install_guard(root: nn.Module, states: list[Any]) -> None:
    """Guard every collective of ``root``'s groups (called at the root's lazy init in debug mode)."""
    if root in _guarded_roots:
        return
    _guarded_roots.add(root)
    steps = _Steps(root)

    def wrap(kind: str, comm: Any, facts: GroupFacts) -> Any:
        trainable = facts.trainable()
        _NAMES[(facts(), len(trainable))] = [name for name, _ in trainable]
        if steps.facts is None:
            steps.facts = facts
        return comm if isinstance(comm, Guarded) else Guarded(comm, kind, facts, steps)

    wrap_comms(states, wrap)
    _watch_steps(steps)


def check_entry(model: nn.Module, what: str) -> None:
    """Debug mode: every rank of ``model``'s data-parallel group enters ``what`` (an export, an import)."""
    if not debug_enabled() or not dist.is_initialized():
        return
    point = Point(what, "", 0, "idle", torch.is_grad_enabled(), True, -1, "", "")
    for group in data_parallel_groups(model):
        agree(point, group)
