"""Two fixes of torch 2.13 that whole-model compile of a sharded model needs, installed by ``_compiled``.

Owns: ``install_rng_order_fix()``, a wrapper around
``torch._functorch.partitioners.functionalize_rng_ops`` (see [Note: Why fsdp2 fixes this]), and
``install_cache_key_fix()``, DTensor's compile-cache hash with the local tensor's shape in it (see
[Note: A cache key per local shape]).
Does not own: anything else of the partitioner or the caches; graphs that torch 2.13 already orders
right are returned as they were, and even shards hash as before plus their (equal) local shape.

[Note: Why fsdp2 fixes this]
AOTAutograd passes what the forward graph saves for backward as one list in a fixed order: tensors,
then opaque objects, then symbolic ints, and slices it by those counts at run time. An activation
checkpoint whose region draws randomness (dropout, and ``scaled_dot_product_attention``, which is
tagged random) makes the partitioner save each random op's RNG state, a tensor, which torch 2.13
inserts just before the symbolic ints: after the opaque objects. A DTensor parameter's gradient
brings one opaque object into every such graph (2.13 flattens a DTensor into its local tensor and its
``DeviceMesh``), so the slices shift, and the first forward fails with "expected all
tensors_saved_with_vc_check to be Tensors". Whole-model compile of a ``fully_shard`` model with
activation checkpointing hits it on any transformer. The fix moves the RNG states in front of the
opaque objects, in the forward graph's outputs and in the backward graph's inputs alike, which is
where the run-time slices expect them; a graph with no opaque object before its RNG states is left
alone.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

import torch
from torch import fx

__all__ = ["install_cache_key_fix", "install_rng_order_fix"]

_RNG_INPUT_PREFIX = "rng_state_output_"  # the backward inputs torch 2.13 adds for the saved states
_PARTITIONERS = "torch._functorch.partitioners"
_WRAPPERS: list[Any] = []  # what install_rng_order_fix put in place (installing twice is a no-op)


def _is_opaque(node: Any) -> bool:
    if not isinstance(node, fx.Node):
        return False
    value = node.meta.get("val")
    return value is not None and not isinstance(
        value, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)
    )


def _reorder(fw_module: fx.GraphModule, bw_module: fx.GraphModule, num_sym_nodes: int) -> None:
    rng_inputs = [
        n for n in bw_module.graph.find_nodes(op="placeholder") if n.name.startswith(_RNG_INPUT_PREFIX)
    ]
    if not rng_inputs:
        return
    output = next(iter(fw_module.graph.find_nodes(op="output")))
    outputs = list(output.args[0])
    end = len(outputs) - num_sym_nodes  # the RNG states were put just before the symbolic ints
    start = end - len(rng_inputs)
    opaque_start = start
    while opaque_start > 0 and _is_opaque(outputs[opaque_start - 1]):
        opaque_start -= 1
    # the backward's inputs: the RNG states go in front of the first opaque saved object
    placeholders = list(bw_module.graph.find_nodes(op="placeholder"))
    first_opaque = next((p for p in placeholders if _is_opaque(p)), None)
    if opaque_start == start or first_opaque is None:
        return  # already in order (or not the layout this fix knows: left as torch made it)
    outputs[opaque_start:end] = outputs[start:end] + outputs[opaque_start:start]
    output.args = (tuple(outputs),)
    for node in rng_inputs:
        first_opaque.prepend(node)
    fw_module.recompile()
    bw_module.recompile()


def install_rng_order_fix() -> None:
    """Wrap torch's ``functionalize_rng_ops`` once (see [Note: Why fsdp2 fixes this]).

    At once where torch's partitioner is already imported; otherwise just after its import (the
    first compile), see [Note: The partitioner imported when torch imports it].
    """
    module = sys.modules.get(_PARTITIONERS)
    if module is not None:
        _wrap_rng_ops(module)
    elif not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(_PARTITIONERS, _wrap_rng_ops))


def _wrap_rng_ops(partitioners: ModuleType) -> None:
    original = getattr(partitioners, "functionalize_rng_ops", None)
    if original is None or original in _WRAPPERS:
        return

    def functionalize_rng_ops(
        joint_module: fx.GraphModule, fw_module: fx.GraphModule, bw_module: fx.GraphModule, num_sym_nodes: int
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        fw_module, bw_module = original(joint_module, fw_module, bw_module, num_sym_nodes)
        _reorder(fw_module, bw_module, num_sym_nodes)
        return fw_module, bw_module

    _WRAPPERS.append(functionalize_rng_ops)
    partitioners.functionalize_rng_ops = functionalize_rng_ops  # type: ignore[attr-defined]  # reason: the wrapped function


# [Note: The partitioner imported when torch imports it]
# ``torch._functorch.partitioners`` brings in inductor's code cache, torch.export, sympy's and
# networkx's graphs: about 29,000 objects the garbage collector tracks (10% of a process that imported
# torch and built a small model) and 0.5-1 s of import. Imported by ``import fsdp2``, every full
# collection of an eager job walked them, and they moved the collector's schedule: in a fresh process
# the first ``torch.distributed.checkpoint.save`` of a 50-block model paid a full collection (0.1 s on
# an idle machine, 0.3 s on a busy one) that torch's ``fully_shard`` paid saves later. So the fix
# waits for the module: a finder first on ``sys.meta_path`` sees its import (the first compile),
# lets the usual finders load it, and wraps the function before anyone calls it; it then leaves the
# path.


class _AfterImport(importlib.abc.MetaPathFinder):
    """Run ``then(module)`` just after the module ``name`` is executed, the first time it is imported."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self._name = name
        self._then = then

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != self._name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec  # (not a module this can follow: left unwrapped, as torch has it)
        run = loader.exec_module
        then = self._then

        def exec_module(module: ModuleType) -> None:
            run(module)
            then(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]  # reason: this one spec's loader
        return spec


# [Note: A cache key per local shape]
# Inductor and AOTAutograd cache compiled graphs on disk, keyed partly by each input's metadata;
# torch 2.13 keys a DTensor by its spec (mesh, placements, global shape) only. A parameter whose
# rows do not divide evenly has a longer local shard on some ranks than on others, and ranks on one
# host share the cache: the second run of a job loads, on a rank with 18 rows, the graph compiled
# for 19 (first step: "expected size 18==19"). The key below adds the local tensor's shape and
# stride, which the compiled graph is specialised on anyway.

_SPEC_HASHES: list[Any] = []  # torch's hash, kept once install_cache_key_fix replaced it


def install_cache_key_fix() -> None:
    """Key DTensors in torch's compile caches by their local shape too (idempotent)."""
    from torch.distributed.tensor import DTensor

    original = getattr(DTensor, "_stable_hash_for_caching", None)
    if original is None or _SPEC_HASHES:
        return
    _SPEC_HASHES.append(original)

    def stable_hash_for_caching(self: DTensor) -> str:
        local = self._local_tensor
        return f"{original(self)}:{tuple(local.shape)}:{tuple(local.stride())}"

    DTensor._stable_hash_for_caching = stable_hash_for_caching  # type: ignore[method-assign]  # noqa: SLF001 - torch's cache hook
