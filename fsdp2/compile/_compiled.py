"""Whole-model ``torch.compile``: each FSDP module's all-gathers and reduce-scatters inside the graph.

Owns: the hooks' traced side (``traced_pre_forward``, ``traced_post_forward``, ``recover``): what an
FSDP module's forward hooks do while dynamo traces them as part of a compiled root. See [Note: The
compiled path].
Does not own: the hooks themselves and their eager side (``runtime``'s ``FSDPState``, which calls
here only while dynamo traces), the sharded parameters.

[Note: The compiled path]
Eagerly, an FSDP module's hooks gather its parameters into storages they manage and register them on
the modules; that cannot be traced, so each hook is excluded from tracing and a compiled model breaks
its graph at every FSDP module. When dynamo traces the hooks of a top-level FSDP module (one no other
``fully_shard`` module contains: ``torch.compile(model)`` or ``model.compile()`` on the root), the
hooks of that module and of every FSDP module under it take the traced side instead:
- pre-forward: for each parameter of the module's groups, ``sharded.redistribute(mesh, Replicate)``
  (an all-gather as a functional collective in the graph) ``.to_local(grad_placements=Partial(avg))``,
  registered in the owning modules' ``_parameters`` in place of the sharded parameter for the
  forward (an edit of the instance dict instead, ``del module.__dict__[name]`` after, is one that
  torch 2.11's dynamo cannot trace). Its backward is the reduce-scatter (an all-reduce too over
  HSDP's replicas) of the gradient, averaged over the ranks, onto the sharded parameter's ``.grad``:
  the DTensor gradient the eager engine gives, so optimizers, state dicts and checkpoints are the
  same.
- post-forward: the sharded parameters are registered again, outputs cast per policy.
- ``reshard_after_forward``: a module that reshards wraps its group's gathers in a (non-reentrant)
  activation checkpoint, so the partitioner gathers again in backward what backward reads instead of
  saving it; collectives are recomputed only from such user-marked regions. A top-level module
  keeps its own (see ``_reshards``).
With ``param_dtype`` the shard is cast before the all-gather and the gradient reduced in it; when
``reduce_dtype`` differs, ``_GatherInDtype`` all-gathers in ``param_dtype`` and reduces in
``reduce_dtype``, as eagerly (dim-0 shards; others all-gather in the shard's dtype, cast after).
Grouping the collectives and overlapping them with compute is the compiler's (its bucketing and
reordering passes); the hooks issue one all-gather per parameter.
Compiling a block alone (``torch.compile(block)``, the root eager) keeps the eager hooks: its graph
breaks at the block's FSDP hooks, as torch's ``fully_shard`` does, and the root's eager engine
prefetches across blocks.
A flag on a module-level object says "a top-level FSDP module is being traced": its pre-forward sets
it, its post-forward clears it, and dynamo replays the writes as side effects after each graph runs
(``torch.compile(model)`` traces the top-level module's hooks as frames of their own, so between the
pre-forward's graph and the post-forward's the flag is set; eager hooks never read it).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch._dynamo import graph_break  # (no public spelling; its message is what fullgraph shows)
from torch.distributed import _functional_collectives as funcol
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils.checkpoint import checkpoint

from ..base import CPUOffloadPolicy, ShardedState
from ..group import FSDPParamGroup

__all__ = ["TRACING", "recover", "torch_too_old", "traced_post_forward", "traced_pre_forward", "untraceable"]


class _State(Protocol):
    """What the traced hooks read of a ``fully_shard`` state (``_state.FSDPState``)."""

    nested: bool
    modules: tuple[nn.Module, ...]
    descendants: list[Any]  # the states under this one (for a top-level one)

    @property
    def groups(self) -> Sequence[FSDPParamGroup]: ...
    def cast_inputs(self, args: Any, kwargs: Any) -> tuple[Any, Any]: ...
    def cast_output(self, output: Any) -> Any: ...


# The oldest torch the compiled path is tested on (2.11 and 2.13); older torch keeps the eager hooks.
_OLDEST_TORCH = (2, 11)


def torch_too_old(version: str) -> bool:
    """Whether torch ``version`` (``torch.__version__``: "2.11.0+cu130") predates the compiled path."""
    major, minor = (int(part) for part in version.split(".")[:2])
    return (major, minor) < _OLDEST_TORCH


_NOT_TRACED = (
    "fsdp2: this model's collectives cannot be put in the compiled graph ({problem}), so its FSDP "
    "hooks run eagerly, with a graph break at each FSDP module. Compile without fullgraph=True, "
    "compile each block instead, or change the setting named (see fsdp2's docs/compile.md)."
)


class _Tracing:
    """Whether dynamo is tracing a top-level FSDP module's forward (only ever true inside a trace)."""

    top = False


TRACING = _Tracing()


def traced_pre_forward(state: _State, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
    """The pre-forward hook's traced side, while dynamo traces: ``(args, kwargs)``, or ``None``.

    ``None``: run the eager hook (a block compiled alone, or a model this path cannot trace, which
    ``fullgraph=True`` refuses here, naming the reason). Called by the state's hook only while
    ``torch.compiler.is_dynamo_compiling()``.
    """
    if state.nested:
        return _traced_pre_forward(state, args, kwargs) if TRACING.top else None
    problem = untraceable([state, *state.descendants])
    if problem is None:
        return _traced_pre_forward(state, args, kwargs)
    # fullgraph=True raises this; otherwise it is the graph break the eager hook makes
    graph_break(msg=_NOT_TRACED.format(problem=problem))
    return None


def traced_post_forward(state: _State, output: Any) -> Any:
    """The post-forward hook's traced side (while dynamo traces a top-level module, ``TRACING.top``)."""
    return _traced_post_forward(state, output)


def _traced_pre_forward(state: _State, args: Any, kwargs: Any) -> tuple[Any, Any]:
    if not state.nested:
        TRACING.top = True
    for group in state.groups:
        if _reshards(state, group):
            # The all-gathers (and casts) run again in backward instead of keeping their outputs.
            fulls = checkpoint(
                functools.partial(_gather_group, group),
                *[p.sharded_param for p in group.fsdp_params],
                use_reentrant=False,
            )
        else:
            fulls = _gather_group(group, *[p.sharded_param for p in group.fsdp_params])
        for fsdp_param, full in zip(group.fsdp_params, fulls, strict=True):
            for owner, name in fsdp_param.owners:
                owner._parameters[name] = full  # noqa: SLF001 - registered for the forward only
    return state.cast_inputs(args, kwargs)


def _reshards(state: _State, group: FSDPParamGroup) -> bool:
    """Whether the traced forward gathers ``group`` again in backward instead of keeping it.

    ``reshard_after_forward`` (``True``, or an int: the same numbers, gathered over the full shard
    group). A top-level module keeps its own parameters whatever it asked: its backward comes
    first, and ``torch.compile(model)`` runs its hooks as frames of their own, whose outputs the
    forward graph keeps anyway (see docs/compile.md).
    """
    return state.nested and group.post_forward_mesh_info is not None


def _gather_group(group: FSDPParamGroup, *shards: torch.Tensor) -> list[torch.Tensor]:
    return [_gathered(shard, group) for shard in shards]


def _traced_post_forward(state: _State, output: Any) -> Any:
    _register_sharded(state)
    if not state.nested:
        TRACING.top = False
    return state.cast_output(output)


def _register_sharded(state: _State) -> None:
    for group in state.groups:
        for fsdp_param in group.fsdp_params:
            for owner, name in fsdp_param.owners:
                owner._parameters[name] = fsdp_param.sharded_param  # noqa: SLF001 - the registered one again


def recover(state: _State) -> None:
    """After a compiled forward that raised: the sharded parameters again (``TRACING.top`` is set).

    A top-level module's traced pre-forward runs as a frame of its own, whose edits dynamo applies
    when it returns; if the forward's frame then raises (a compile error, an out-of-memory), the
    post-forward never runs and the gathered tensors would stay registered, so ``state_dict()`` and
    ``parameters()`` would show plain full tensors. The state's ``always_call`` forward hook, which
    ``nn.Module`` calls even when the forward raised, calls this outside tracing while ``TRACING.top``
    is set: the sharded parameters of every module under the top-level one are registered again.
    Only top-level modules keep that hook (``FSDPState.mark_nested`` removes it from the others).
    """
    for each in (state, *state.descendants):
        _register_sharded(each)
    TRACING.top = False


def _gathered(sharded: torch.Tensor, group: FSDPParamGroup) -> torch.Tensor:
    """The unsharded parameter as a traced all-gather whose backward reduce-scatters (averaged)."""
    assert isinstance(sharded, DTensor), "a sharded parameter is a DTensor"
    policy = group.config.mp_policy
    param_dtype, reduce_dtype = policy.param_dtype, policy.reduce_dtype
    two_dtypes = param_dtype is not None and reduce_dtype not in (None, param_dtype)
    if two_dtypes and sharded.placements[-1] == Shard(0):
        return _two_dtype_gather(sharded, group, param_dtype, reduce_dtype)  # type: ignore[arg-type]  # reason: not None when two_dtypes
    # one dtype both ways: cast first; two (a shard on another dim): gather and reduce in the shard's
    cast_first = param_dtype is not None and not two_dtypes
    source: DTensor = sharded.to(param_dtype) if cast_first else sharded  # type: ignore[assignment]  # reason: DTensor.to gives a DTensor
    dims = len(sharded.placements)  # (the mesh itself is not read)
    full = source.redistribute(placements=[Replicate()] * dims).to_local(
        grad_placements=[Partial("avg")] * dims
    )
    return full.to(param_dtype) if two_dtypes else full


def _two_dtype_gather(
    sharded: DTensor, group: FSDPParamGroup, param_dtype: torch.dtype, reduce_dtype: torch.dtype
) -> torch.Tensor:
    """``param_dtype`` all-gather whose backward reduce-scatters in ``reduce_dtype``, as eagerly.

    DTensor's redistribute reduces the gradient in the dtype it gathered, so this pair of
    collectives is a function of its own over the local shard (dim-0 shards, padded to the same
    rows on every rank, as fully_shard lays them out).
    """
    info = group.mesh_info
    rows = sharded.shape[0]
    padded_rows = -(-rows // info.shard_size)
    replicas = (
        info.replicate_group.group_name
        if info.replicate_group is not None and info.replicate_size > 1
        else None
    )
    spec = (
        rows,
        padded_rows,
        info.shard_size,
        param_dtype,
        reduce_dtype,
        info.shard_group.group_name,
        replicas,
    )
    gathered: torch.Tensor = _GatherInDtype.apply(sharded.to_local(), spec)  # type: ignore[no-untyped-call]  # reason: torch leaves apply untyped
    return gathered


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    missing = rows - tensor.shape[0]
    if missing == 0:
        return tensor
    return torch.nn.functional.pad(tensor, [0, 0] * (tensor.dim() - 1) + [0, missing])


class _GatherInDtype(torch.autograd.Function):
    """The two collectives of one parameter in two dtypes.

    Forward: cast the local shard to ``param_dtype``, all-gather it. Backward: cast the gradient to
    ``reduce_dtype``, reduce-scatter it (average), all-reduce it over HSDP's replicas.
    """

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, spec: tuple[Any, ...]) -> torch.Tensor:
        rows, padded_rows, shard_size, param_dtype, _, shard_group, _ = spec
        ctx.spec, ctx.local_rows = spec, local.shape[0]
        if shard_size == 1:  # HSDP with one rank per shard group: nothing to gather
            return local.to(param_dtype)
        padded = _pad_rows(local.to(param_dtype), padded_rows)
        full: torch.Tensor = funcol.wait_tensor(funcol.all_gather_tensor(padded, 0, shard_group))
        return full.narrow(0, 0, rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _, padded_rows, shard_size, _, reduce_dtype, shard_group, replicas = ctx.spec
        local = grad.to(reduce_dtype)
        if shard_size > 1:
            padded = _pad_rows(local, padded_rows * shard_size)
            local = funcol.wait_tensor(funcol.reduce_scatter_tensor(padded, "avg", 0, shard_group))
        if replicas is not None:
            local = funcol.wait_tensor(funcol.all_reduce(local, "avg", replicas))
        return local.narrow(0, 0, ctx.local_rows), None


def untraceable(model: nn.Module | _State | Sequence[nn.Module | _State]) -> str | None:
    """Why the compiled path cannot trace ``model`` and the FSDP modules under it, or ``None``.

    ``model`` is what you would compile: the top-level FSDP module, its ``fully_shard.state(model)``,
    or a list of such modules or states (each is checked with the FSDP modules under it; the first
    one names the modules). Such a model compiles as before: its hooks run eagerly, with a graph
    break at each FSDP module (``fullgraph=True`` then fails, with fsdp2's message naming the reason).

    Raises:
        TypeError: ``model`` (or an item of the list) is neither a module sharded by fsdp2's
            ``fully_shard`` nor such a module's state.
    """
    states = _states_of(model)
    if torch_too_old(torch.__version__):
        oldest = ".".join(map(str, _OLDEST_TORCH))
        return f"torch {torch.__version__} is too old for them: whole-model compile needs torch {oldest}+"
    names = {id(m): name for name, m in states[0].modules[0].named_modules()} if states else {}
    for state in states:
        where = ", ".join(repr(names.get(id(m), type(m).__name__) or "<root>") for m in state.modules)
        if len(state.modules) > 1:
            return f"modules {where}: fully_shard([...]) of several modules"
        for group in state.groups:
            problem = _problem(group)
            if problem is not None:
                return f"module {where}: {problem}"
    return None


def _states_of(model: Any) -> list[_State]:
    """The fsdp2 states of ``untraceable``'s argument, each followed by those under it, once each."""
    items = list(model) if isinstance(model, Sequence) and not isinstance(model, str) else [model]
    states: dict[int, _State] = {}
    for item in items:
        # an FSDP module's class (fsdp2's, and torch's, whose state lacks what is read below) has this
        getter = getattr(item, "_get_fsdp_state", None) if isinstance(item, nn.Module) else None
        state = getter() if callable(getter) else item
        if not all(hasattr(state, name) for name in ("modules", "groups", "descendants")):
            raise TypeError(
                "untraceable() takes the model you compile after fsdp2's fully_shard (its top-level "
                "FSDP module), fully_shard.state(model), or a list of them; got "
                f"{type(item).__name__}, which is neither a module sharded by fsdp2 nor its state."
            )
        for one in (state, *state.descendants):
            states.setdefault(id(one), one)
    return list(states.values())


def _problem(group: FSDPParamGroup) -> str | None:
    if group.sharded_state is not ShardedState.SHARDED:
        return "its parameters are unsharded (call model.reshard() first)"
    if any(p.is_tensor_parallel or p.has_extension for p in group.fsdp_params):
        return "tensor-parallel parameters or all-gather extensions"
    if any(p.local.grad_dtype is not None for p in group.fsdp_params):
        return "a parameter whose grad_dtype differs from its dtype"
    if isinstance(group.config.offload_policy, CPUOffloadPolicy):
        return "CPU offload"
    if group.comms.custom:
        return "custom collectives"
    controls = group.controls
    if not controls.reduce_grads or not controls.all_reduce_grads or controls.all_reduce_hook is not None:
        return "gradient sync or the replicas' all-reduce off, or an all-reduce hook"
    if controls.gradient_divide_factor is not None or controls.force_sum_reduction:
        return "a gradient divide factor or sum reduction"
    if controls.deterministic_reduction:
        return "deterministic reduction (the compiled reduce-scatter keeps no fixed order)"
    if controls.reduce_scatter_unused_params:
        return "reduce-scatter of unused parameters (the graph reduces only what got a gradient)"
    return None
