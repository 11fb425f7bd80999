"""torch's own tests of its FSDP-based ``replicate``, the behaviours that run on CPU, against fsdp2's.

pytorch's ``test/distributed/_composable/test_replicate_training.py`` and
``test_replicate_mixed_precision.py`` check torch's ``replicate`` against an unsharded model. Here
each behaviour they check runs twice on the same rank threads (world 2) and the same inputs: once with
torch's ``replicate`` (and its ``MixedPrecisionPolicy``, ``CPUOffloadPolicy``,
``register_fsdp_forward_method``) and once with fsdp2's, only the names swapped. Every case records
what it sees (losses, gradients, parameters, dtypes, parameter types, collective counts, errors) and
the two records must be equal, tensors bit for bit. The cases: odd layer shapes, a cast to float64
after ``replicate``, forward and backward through a non-root, a module run twice in one forward,
explicit prefetching, activation checkpointing (torch's composable ``checkpoint`` and the wrapper)
with torch's module groupings (embeddings without unshard in backward, a weight-tied group), shared
parameters, gradient accumulation (gradient sync or all-reduce off, for every module, the root only
or some blocks, with and without CPU offload: the same all-reduce counts), a 1F1B-like loop with
explicit unshard, a forward method other than ``forward``, whether parameters are DTensors after
forward and backward, compute and reduce dtypes (bf16 and fp16 compute, fp32 and bf16 reduction,
fp32 accumulation across micro-batches), input casting on submodules, norm modules in low precision
(batch norm 2-D fails alike), a reduce dtype kept after ``model.to(float32)``, dataclass inputs, and
``torch.func.vmap`` / ``jvp`` through a replicated model. Not ported: CUDA streams and events
(post-optimizer event, device moves of inputs, sleeps to force overlap), the 2-D and TP meshes of
the older API (torch 2.13's ``replicate`` takes a 1-D mesh; fsdp2's TP with replicate dims is
``tests/frontend/test_dp_mesh_dims.py``'s).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import register_fsdp_forward_method as torch_register_forward_method
from torch.distributed.tensor import DTensor

import fsdp2
from fsdp2.testing import count_collectives
from tests._harness import run_threaded
from tests._training import fill_deterministic_
from tests.models import ModelArgs, Transformer, TransformerBlock, make_input, make_tokens


@dataclasses.dataclass(frozen=True)
class Api:
    """One implementation's names: the only thing a case changes between torch and fsdp2."""

    replicate: Callable[..., Any]
    mp: type
    cpu_offload: type
    register_forward_method: Callable[..., Any]


FSDP2 = Api(
    fsdp2.replicate, fsdp2.MixedPrecisionPolicy, fsdp2.CPUOffloadPolicy, fsdp2.register_fsdp_forward_method
)
TORCH = Api(torch_replicate, TorchMixedPrecisionPolicy, TorchCPUOffloadPolicy, torch_register_forward_method)


class Record(list):
    """``(label, value)`` pairs a case saw; tensors copied whole (a DTensor's full tensor)."""

    def add(self, label: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            value = value.full_tensor() if isinstance(value, DTensor) else value
            value = value.detach().clone()
        self.append((label, value))

    def grads_and_params(self, model: nn.Module, tag: str) -> None:
        for name, param in model.named_parameters():
            self.add(f"{tag} param {name}", param)
            self.add(f"{tag} grad {name}", param.grad)


def _assert_records_equal(ours: Record, theirs: Record) -> None:
    assert [label for label, _ in ours] == [label for label, _ in theirs]
    for (label, a), (_, b) in zip(ours, theirs, strict=True):
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor), label
            assert a.dtype == b.dtype, (label, a.dtype, b.dtype)
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, n=label: f"{n}: {m}")
        else:
            assert a == b, (label, a, b)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int | None = None) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, hidden or 2 * dim)
        self.out_proj = nn.Linear(hidden or 2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.out_proj(torch.relu(self.in_proj(x))))


def _mlps(n: int = 3, dim: int = 8) -> nn.Sequential:
    return nn.Sequential(*[MLP(dim) for _ in range(n)])


def _train(
    model: nn.Module, rec: Record, inputs: Callable[[int], Any], steps: int = 3, lr: float = 1e-2
) -> torch.optim.Optimizer:
    """``steps`` of Adam on ``model(inputs(step)).sum()``; zero_grad alternates set_to_none as torch's."""
    optim = torch.optim.Adam(model.parameters(), lr=lr)
    for step in range(steps):
        loss = model(inputs(step)).sum()
        loss.backward()
        rec.add(f"loss {step}", loss)
        rec.grads_and_params(model, f"step {step}")
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 0)
    rec.grads_and_params(model, "end")
    return optim


def _build(make: Callable[[], nn.Module]) -> nn.Module:
    """``make()`` with the same parameter values on every rank and in every run (private generator)."""
    return fill_deterministic_(make(), scale=0.5)


def _per_module(api: Api, modules: Any, **kwargs: Any) -> None:
    for module in modules:
        api.replicate(module, **kwargs)


# ---- training (test_replicate_training.py) ---------------------------------------------------------


def _odd_shapes(api: Api, rank: int, rec: Record) -> None:
    """One group over layers of uneven shapes."""
    model = _build(lambda: nn.Sequential(nn.Linear(7, 15), nn.ReLU(), nn.Linear(15, 3)))
    api.replicate(model)
    _train(model, rec, lambda step: make_input((4, 7), rank, step))


def _cast_after_init(api: Api, rank: int, rec: Record) -> None:
    """``model.to(float64)`` after ``replicate``: parameters, local tensors and gradients in float64."""
    model = _build(lambda: MLP(4))
    _per_module(api, (model.in_proj, model.out_proj, model))
    model.to(torch.float64)
    for name, param in model.named_parameters():
        rec.add(f"dtype {name}", (param.dtype, param.to_local().dtype))
    _train(model, rec, lambda step: make_input((2, 4), rank, step).double())
    model(make_input((2, 4), rank).double()).sum().backward()
    for name, param in model.named_parameters():
        rec.add(f"grad dtype {name}", (param.grad.dtype, param.grad.to_local().dtype))


def _non_root_backward(api: Api, rank: int, rec: Record) -> None:
    """A step through the root, then forward and backward through a non-root alone."""
    model = _build(lambda: _mlps(3))
    _per_module(api, (*model, model))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = make_input((4, 8), rank)
    for tag, module in (("root", model), ("non-root", model[0])):
        loss = module(x).sum()
        loss.backward()
        rec.add(f"{tag} loss", loss)
        rec.grads_and_params(model, tag)
        optim.step()
        optim.zero_grad()
    rec.add("after", model(x).sum())


class _TwiceInner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.inner(x) + self.inner(x))


def _multi_forward(api: Api, rank: int, rec: Record) -> None:
    """A replicated module run twice in one forward."""
    model = _build(_TwiceInner)
    _per_module(api, (model.inner, model))
    _train(model, rec, lambda step: make_input((8, 4), rank, step))


def _explicit_prefetch(api: Api, rank: int, rec: Record) -> None:
    """``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` two blocks ahead."""
    args = ModelArgs(n_layers=4)
    model = _build(lambda: Transformer(args))
    _per_module(api, (*model.layers, model))
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 3])
        layer.set_modules_to_backward_prefetch(layers[max(0, i - 2) : i][::-1])
    _train(model, rec, lambda step: make_tokens(args, rank + 10 * step), steps=2)


def _checkpointing(grouping: str, impl: str) -> Callable[[Api, int, Record], None]:
    """torch's activation-checkpointing cases: a checkpoint kind, a module grouping."""

    def case(api: Api, rank: int, rec: Record) -> None:
        args = ModelArgs(n_layers=3, weight_tying=grouping == "weight_tied")
        model = _build(lambda: Transformer(args))
        if impl == "wrapper":
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, TransformerBlock))
        else:
            for block in model.layers:
                composable_checkpoint(block)
        if grouping == "mem_eff":
            api.replicate(model.layers[0])
            api.replicate([model.layers[1], model.layers[2]])
            api.replicate([model.tok_embeddings, model.pos_embeddings])
            model.tok_embeddings.set_unshard_in_backward(False)  # an embedding's backward needs no weight
            api.replicate([model.norm, model.output])
        else:  # weight tied: the embedding and the output in one group
            api.replicate([model.tok_embeddings, model.output])
            _per_module(api, model.layers)
        api.replicate(model)
        tokens = make_tokens(args, rank)
        _train(model, rec, lambda step: tokens, steps=2)

    return case


def _shared_params(api: Api, rank: int, rec: Record) -> None:
    """Weight tying with per-block groups and composable checkpointing."""
    args = ModelArgs(n_layers=2, weight_tying=True)
    model = _build(lambda: Transformer(args))
    for block in model.layers:
        composable_checkpoint(block)
        api.replicate(block)
    api.replicate(model)
    _train(model, rec, lambda step: make_tokens(args, rank + 10 * step), steps=2)


def _accumulation(mode: str, all_reduce_only: bool, offload: bool) -> Callable[[Api, int, Record], None]:
    """Three micro-batches, synced on the last only, for every module / the root / two blocks."""

    def case(api: Api, rank: int, rec: Record) -> None:
        model = _build(lambda: nn.Sequential(nn.Linear(8, 8), *[MLP(8) for _ in range(3)]))
        kwargs = {"offload_policy": api.cpu_offload(pin_memory=False)} if offload else {}
        _per_module(api, (*model[1:], model), **kwargs)
        targets = {
            "all": [(model, True)],
            "root_only": [(model, False)],
            "some_mlps": [(model[1], True), (model[2], True)],
        }
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        for step in range(2):
            counts: dict[str, int] = {}
            for micro in range(3):
                last = micro == 2
                for module, recurse in targets[mode]:
                    if all_reduce_only:
                        module.set_requires_all_reduce(last, recurse=recurse)
                    else:
                        module.set_requires_gradient_sync(last, recurse=recurse)
                    module.set_reshard_after_backward(last, recurse=recurse)
                with count_collectives() as seen:
                    loss = model(make_input((2, 8), rank, 10 * step + micro)).sum()
                    loss.backward()
                for kind, n in seen.items():
                    counts[kind] = counts.get(kind, 0) + n
                rec.add(f"loss {step}.{micro}", loss)
            rec.add(f"counts {step}", counts)
            rec.grads_and_params(model, f"step {step}")
            optim.step()
            optim.zero_grad(set_to_none=step % 2 == 1)

    return case


def _one_f_one_b(api: Api, rank: int, rec: Record) -> None:
    """torch's 1F1B emulation: explicit async unshard, sync and last backward on the last micro-batch."""
    args = ModelArgs(n_layers=2)
    model = _build(lambda: Transformer(args))
    _per_module(api, (*model.layers, model))
    for module in model.modules():
        if isinstance(module, fsdp2.FSDPModule):
            module.unshard(async_op=True)
    for micro in range(3):
        last = micro == 2
        model.set_requires_gradient_sync(last)
        model.set_is_last_backward(last)
        model.set_reshard_after_backward(last)
        loss = model(make_tokens(args, rank + 10 * micro)).sum()
        loss.backward()
        rec.add(f"loss {micro}", loss)
    rec.grads_and_params(model, "end")


class _Vision(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch_proj = nn.Conv2d(3, 16, kernel_size=4, stride=4)

    def forward_features(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.patch_proj(imgs).flatten(2).transpose(1, 2)

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.forward_features(imgs).sum(dim=1)


class _VisionModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vit, self.projector = _Vision(), nn.Linear(16, 8)

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.projector(self.vit.forward_features(imgs))  # not vit.forward


def _forward_method(api: Api, rank: int, rec: Record) -> None:
    """``register_fsdp_forward_method``: a method other than ``forward`` runs the hooks."""
    model = _build(_VisionModel)
    _per_module(api, (model.vit, model.projector, model))
    api.register_forward_method(model.vit, "forward_features")
    _train(model, rec, lambda step: make_input((2, 3, 8, 8), rank, step), steps=2)


def _param_types(api: Api, rank: int, rec: Record) -> None:
    """Whether each parameter is a DTensor after forward, after backward and after ``reshard()``."""
    model = _build(lambda: _mlps(2))
    _per_module(api, (model[0].in_proj, model[0].out_proj, model))

    def types(tag: str) -> None:
        rec.add(tag, [isinstance(p, DTensor) for p in model.parameters()])

    types("init")
    out = model(make_input((2, 8), rank))
    types("after forward")
    out.sum().backward()
    types("after backward")
    for module in model.modules():
        if isinstance(module, fsdp2.FSDPModule):
            module.reshard()
    types("after reshard")
    rec.grads_and_params(model, "end")


# ---- mixed precision (test_replicate_mixed_precision.py) ------------------------------------------


def _dtypes(param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> Callable[..., None]:
    """Training with a compute dtype and a reduce dtype; the gradients' dtype."""

    def case(api: Api, rank: int, rec: Record) -> None:
        model = _build(lambda: _mlps(3))
        _per_module(
            api, (*model, model), mp_policy=api.mp(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        )
        x_dtype = param_dtype or torch.float32
        _train(model, rec, lambda step: make_input((4, 8), rank, step).to(x_dtype))

    return case


def _accumulate_in_reduce_dtype(api: Api, rank: int, rec: Record) -> None:
    """bf16 compute, fp32 reduction: unsynced micro-batches accumulate in fp32."""
    model = _build(lambda: _mlps(3))
    policy = api.mp(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _per_module(api, (*model, model), mp_policy=policy)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(2):
        for micro in range(4):
            last = micro == 3
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
            loss = model(make_input((2, 8), rank, 10 * step + micro).bfloat16()).sum()
            rec.add(f"loss dtype {step}.{micro}", loss.dtype)
            loss.backward()
            rec.add(f"loss {step}.{micro}", loss)
        rec.grads_and_params(model, f"step {step}")
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 0)


class _Saving(nn.Module):
    """A linear layer that records the dtype of its input (and, optionally, casts it to its own)."""

    def __init__(self, seen: dict[str, torch.dtype], name: str, cast: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.seen, self.name, self.cast = seen, name, cast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen[self.name] = x.dtype
        return self.lin(x.to(self.lin.weight.dtype) if self.cast else x)


class _TwoSaving(nn.Module):
    def __init__(self, seen: dict[str, torch.dtype], cast: bool) -> None:
        super().__init__()
        self.c1, self.c2 = _Saving(seen, "c1", cast), _Saving(seen, "c2", cast)
        self.seen = seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen["root"] = x.dtype
        return self.c2(self.c1(x))


def _submodule_casts(api: Api, rank: int, rec: Record) -> None:
    """fp16 on one child: which dtypes the root and the children see (torch's three subtests)."""
    fp16 = torch.float16
    settings = [
        ("c2 fp16", False, "c2", {"param_dtype": fp16}),
        ("c2 fp16, module casts", True, "c2", {"param_dtype": fp16, "cast_forward_inputs": False}),
        ("c1 fp16, fp32 output", False, "c1", {"param_dtype": fp16, "output_dtype": torch.float32}),
    ]
    for tag, cast, child, policy in settings:
        seen: dict[str, torch.dtype] = {}
        model = _build(lambda s=seen, c=cast: _TwoSaving(s, c))
        api.replicate(getattr(model, child), mp_policy=api.mp(**policy))
        api.replicate(model)
        out = model(make_input((2, 16), rank))
        out.sum().backward()
        rec.add(f"{tag} seen", dict(seen))
        rec.add(f"{tag} out", out)
        rec.grads_and_params(model, tag)


class _External(nn.Module):
    def __init__(self, seen: dict[str, torch.dtype]) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 16)
        self.l2 = _TwoInputs(seen)
        self.seen = seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen["model x"] = x.dtype
        return self.l2(self.l1(x), torch.ones(2, 16))  # y: made inside forward, in fp32


class _TwoInputs(nn.Module):
    def __init__(self, seen: dict[str, torch.dtype]) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.seen = seen

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.seen["l2 x"], self.seen["l2 y"] = x.dtype, y.dtype
        return self.lin(x)


def _external_inputs(api: Api, rank: int, rec: Record) -> None:
    """A submodule's input made inside the parent's forward is cast only if the submodule casts."""
    for cast in (False, True):
        seen: dict[str, torch.dtype] = {}
        model = _build(lambda s=seen: _External(s))
        api.replicate(model.l2, mp_policy=api.mp(param_dtype=torch.float16, cast_forward_inputs=cast))
        api.replicate(model, mp_policy=api.mp(param_dtype=torch.float16))
        out = model(make_input((2, 16), rank))
        out.sum().backward()
        rec.add(f"cast={cast} seen", dict(seen))
        rec.grads_and_params(model, f"cast={cast}")


def _norm_modules(api: Api, rank: int, rec: Record) -> None:
    """Layer and batch norms under bf16: batch norm 2-D fails in backward unless its buffers are cast."""
    policy = api.mp(param_dtype=torch.bfloat16)

    def run(tag: str, build: Callable[[], nn.Sequential], shape: tuple[int, ...], fix: str = "") -> None:
        model = _build(build)
        if fix == "bn policy":
            api.replicate(model[1], mp_policy=api.mp(output_dtype=torch.bfloat16))
            _per_module(api, (model[0], model[2], model), mp_policy=policy)
        else:
            _per_module(api, (*model, model), mp_policy=policy)
        if fix == "cast buffers":
            model[1].running_mean = model[1].running_mean.bfloat16()
            model[1].running_var = model[1].running_var.bfloat16()
        try:
            out = model(make_input(shape, rank))
            rec.add(f"{tag} out", out)
            out.sum().backward()
        except RuntimeError as exc:
            rec.add(f"{tag} error", str(exc).split(",")[0])
            return
        rec.grads_and_params(model, tag)

    run("layer norm", lambda: nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)), (4, 8))
    run("batch norm 1d", lambda: nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8)), (4, 8))

    def conv() -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.Conv2d(3, 2, 3))

    for fix in ("", "cast buffers", "bn policy"):
        run(f"batch norm 2d {fix}", conv, (3, 1, 7, 7), fix)


def _reduce_dtype_kept(api: Api, rank: int, rec: Record) -> None:
    """A bf16 model with bf16 reduction, then ``model.to(float32)``: the policy's dtypes stay."""
    model = _build(lambda: nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).bfloat16())
    policy = api.mp(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    _per_module(api, (*model, model), mp_policy=policy)
    model.to(torch.float32)
    _train(model, rec, lambda step: make_input((4, 8), rank, step), steps=2)


@dataclasses.dataclass
class _Input:
    x: torch.Tensor


class _DataclassModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, inp: _Input) -> torch.Tensor:
        return self.layer(inp.x)


def _dataclass_input(api: Api, rank: int, rec: Record) -> None:
    """Forward inputs inside a dataclass are cast to the compute dtype."""
    model = _build(_DataclassModel)
    api.replicate(model, mp_policy=api.mp(torch.bfloat16, torch.bfloat16, torch.bfloat16, True))
    _train(model, rec, lambda step: _Input(make_input((2, 8), rank, step)), steps=2)


class _ThreeInputs(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim + 2, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, z: torch.Tensor, t: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(torch.cat((z, t, r), dim=-1))))


# functorch's transform levels are process-global: rank threads take turns. The forwards of replicated
# modules issue no collective, so a rank inside one never waits for another.
_FUNCTORCH = threading.Lock()


def _vmap_and_jvp(api: Api, rank: int, rec: Record) -> None:
    """``torch.func.vmap`` and ``jvp`` through a bf16 replicated model, then backward through both."""
    model = _build(_ThreeInputs)
    policy = api.mp(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _per_module(api, (model.in_proj, model.out_proj, model), mp_policy=policy)
    z, t = make_input((6, 8), rank), make_input((6, 1), rank, 1).abs()
    r = t * make_input((6, 1), rank, 2).abs()
    with _FUNCTORCH:
        rec.add("vmap", torch.func.vmap(model)(z, t, r))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(2):
        zz, tt, rr = (v.detach().requires_grad_() for v in (z + step, t, r))
        tangents = (torch.ones_like(zz), torch.ones_like(tt), torch.zeros_like(rr))
        with _FUNCTORCH:
            out, tangent = torch.func.jvp(model, (zz, tt, rr), tangents)
        loss = (out - tangent.detach()).square().mean() + tangent.square().mean()
        loss.backward()
        rec.add(f"loss {step}", loss)
        rec.add(f"tangent {step}", tangent)
        rec.grads_and_params(model, f"step {step}")
        optim.step()
        optim.zero_grad()


CASES: dict[str, Callable[[Api, int, Record], None]] = {
    "odd_shapes": _odd_shapes,
    "cast_after_init": _cast_after_init,
    "non_root_backward": _non_root_backward,
    "multi_forward": _multi_forward,
    "explicit_prefetch": _explicit_prefetch,
    "checkpoint_composable_mem_eff": _checkpointing("mem_eff", "composable"),
    "checkpoint_wrapper_weight_tied": _checkpointing("weight_tied", "wrapper"),
    "shared_params": _shared_params,
    "accumulate_all": _accumulation("all", False, False),
    "accumulate_root_only": _accumulation("root_only", False, False),
    "accumulate_some_mlps": _accumulation("some_mlps", False, False),
    "accumulate_no_all_reduce": _accumulation("all", True, False),
    "accumulate_cpu_offload": _accumulation("some_mlps", False, True),
    "one_f_one_b": _one_f_one_b,
    "forward_method": _forward_method,
    "param_types": _param_types,
    "compute_bf16": _dtypes(torch.bfloat16, None),
    "compute_fp16": _dtypes(torch.float16, None),
    "bf16_compute_fp32_reduce": _dtypes(torch.bfloat16, torch.float32),
    "fp32_compute_bf16_reduce": _dtypes(None, torch.bfloat16),
    "accumulate_in_reduce_dtype": _accumulate_in_reduce_dtype,
    "submodule_casts": _submodule_casts,
    "external_inputs": _external_inputs,
    "norm_modules": _norm_modules,
    "reduce_dtype_kept": _reduce_dtype_kept,
    "dataclass_input": _dataclass_input,
    "vmap_and_jvp": _vmap_and_jvp,
}


def _compare(name: str) -> None:
    records = []
    for api in (TORCH, FSDP2):
        rec = Record()
        CASES[name](api, dist.get_rank(), rec)
        records.append(rec)
    theirs, ours = records
    assert ours, name
    _assert_records_equal(ours, theirs)


@pytest.mark.first_case_in_quick_loop
@pytest.mark.parametrize("name", list(CASES))
def test_matches_torch_replicate(name: str) -> None:
    run_threaded(2, _compare, name)


def test_records_see_differences() -> None:
    """The comparison itself: a changed gradient, dtype or label fails."""
    a, b = Record(), Record()
    a.add("x", torch.ones(2))
    b.add("x", torch.ones(2).nextafter(torch.full((2,), 2.0)))
    with pytest.raises(AssertionError):
        _assert_records_equal(a, b)
    b = Record()
    b.add("x", torch.ones(2, dtype=torch.float64))
    with pytest.raises(AssertionError):
        _assert_records_equal(a, b)
    b = Record()
    b.add("y", torch.ones(2))
    with pytest.raises(AssertionError):
        _assert_records_equal(a, b)
    _assert_records_equal(a, copy.deepcopy(a))
