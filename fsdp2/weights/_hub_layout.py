"""A checkpoint's tensors against a model's: ``transformers``' own conversion rules, read as blocks.

Owns: ``hub_layout`` (for each of the model's state-dict names, the checkpoint tensors that make it and
the block of it each one fills) and ``hub_names`` (the names and shapes ``transformers``'
``save_pretrained`` writes for a model, as such blocks). Does not own: reading or writing bytes
(``_hub_reader.py``, ``_pretrained.py``), or the rules themselves: they are ``transformers``' (its
``get_model_conversion_mapping`` for loading, ``revert_weight_conversion`` for saving), looked up for
the model's own class and ``model_type``, so every model ``transformers`` maps is mapped here alike.

[Note: Checkpoint tensors as blocks]
``transformers`` 5 holds a mixture of experts' weights as stacks (``experts.gate_up_proj`` ``[E, 2I, D]``)
while checkpoints hold one tensor per expert and projection (``experts.3.gate_proj.weight`` ``[I, D]``).
Its loader renames every checkpoint name (``WeightRenaming``), then lets at most one ``WeightConverter``
collect the tensors of each target and run operations on them: ``MergeModulelist(d)`` stacks each source
pattern's tensors on a new dim ``d`` (in expert order), ``Concatenate(d)`` joins the patterns' results on
``d`` (in pattern order). Both only place tensors side by side, so each checkpoint tensor is one block of
the target: a start and size per dim, the stacked dims of size 1 absent from the checkpoint tensor. A
rank reads of each block only what meets its own shard. A converter with any other operation
(``Transpose``, ``Interleave``, ...) is run as ``transformers`` runs it, on whole tensors
(``Source.convert``).
"""

from __future__ import annotations

import collections
import copy
import functools
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["Block", "HubLayout", "Source", "hub_layout", "hub_names"]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Block:
    """Checkpoint tensor ``name`` as a block of a model tensor: ``model_tensor[index]``.

    ``starts``/``sizes`` per model dim; ``squeezed``: the model dims (size 1) the checkpoint tensor lacks.
    """

    name: str
    starts: Shape
    sizes: Shape
    squeezed: frozenset[int] = frozenset()

    @property
    def shape(self) -> Shape:
        return tuple(n for d, n in enumerate(self.sizes) if d not in self.squeezed)

    @property
    def index(self) -> tuple[int | slice, ...]:
        return tuple(
            s if d in self.squeezed else slice(s, s + n)
            for d, (s, n) in enumerate(zip(self.starts, self.sizes, strict=True))
        )

    def moved(self, dim: int, offset: int) -> Block:
        """The block ``offset`` further along ``dim``."""
        starts = list(self.starts)
        starts[dim] += offset
        return Block(self.name, tuple(starts), self.sizes, self.squeezed)

    def stacked(self, dim: int, at: int) -> Block:
        """The block as entry ``at`` of a new dim ``dim``."""
        squeezed = frozenset(d + (d >= dim) for d in self.squeezed) | {dim}
        return Block(
            self.name,
            (*self.starts[:dim], at, *self.starts[dim:]),
            (*self.sizes[:dim], 1, *self.sizes[dim:]),
            squeezed,
        )


@dataclass(frozen=True)
class Source:
    """How one model tensor of ``shape`` comes from the checkpoint.

    ``blocks`` tiling it, or (``convert`` set) ``transformers``' converter run on the whole tensors ``names``.
    """

    shape: Shape
    blocks: tuple[Block, ...] = ()
    names: tuple[str, ...] = ()
    convert: Callable[[Callable[[str], torch.Tensor]], torch.Tensor] | None = None  # given a reader

    @classmethod
    def whole(cls, name: str, shape: Shape) -> Source:
        return cls(shape, (Block(name, (0,) * len(shape), shape),), (name,))


@dataclass
class HubLayout:
    """The checkpoint's names mapped onto the model: a source per model name, what is unmapped or absent."""

    sources: dict[str, Source] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)  # checkpoint names no model name takes
    missing: dict[str, list[str]] = field(default_factory=dict)  # model name -> checkpoint names absent
    problems: dict[str, str] = field(default_factory=dict)  # name -> why it cannot be made


def hub_layout(model: nn.Module, checkpoint: Mapping[str, Shape], names: Mapping[str, Shape]) -> HubLayout:
    """Map ``checkpoint`` (name -> shape) onto the model's state-dict ``names`` (name -> shape).

    A ``transformers`` model gets its own conversion rules (as ``from_pretrained`` applies them); any other
    model, names as they are. See [Note: Checkpoint tensors as blocks].
    """
    layout = HubLayout()
    transforms = _transforms(model)
    if not transforms:
        for key, shape in checkpoint.items():
            if key in names:
                layout.sources[key] = Source.whole(key, tuple(shape))
            else:
                layout.unexpected.append(key)
        return layout
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None)
    known = dict(names)  # transformers' lookup of the model's names
    collected: dict[str, dict[str, list[str]]] = {}  # target -> pattern -> checkpoint names
    for key in sorted(checkpoint, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, known)
        if target not in names and key in names:
            target, pattern = key, None
        if target not in names:
            layout.unexpected.append(key)
        elif pattern is None:
            layout.sources[target] = Source.whole(key, tuple(checkpoint[key]))
        else:
            collected.setdefault(target, {}).setdefault(pattern, []).append(key)
    for target, found in collected.items():
        converter = by_pattern[next(iter(found))]
        _convert(layout, model, converter, target, found, checkpoint, names)
    return layout


def hub_names(model: nn.Module, names: Mapping[str, Shape]) -> dict[str, tuple[Block, ...]] | None:
    """The blocks ``transformers``' ``save_pretrained`` would write for each model name in ``names``.

    ``None`` when the model has no conversion rules (its names are written as they are). Raises a
    ``ValueError`` naming the model and the problem when the saved layout is not blocks of the model's
    tensors (a converter that fuses several model tensors into one, transposes or interleaves).
    """
    if not _is_transformers_model(model):
        return None
    from transformers.core_model_loading import revert_weight_conversion

    what = f"save_pretrained({type(model).__name__.removeprefix('FSDP')}, layout='hub')"
    meta = {name: torch.empty(shape, device="meta") for name, shape in names.items()}
    try:
        saved = revert_weight_conversion(model, meta)  # type: ignore[arg-type]  # reason: checked above
    except Exception as error:  # an operation that cannot run on shapes alone
        raise ValueError(
            f"{what}: transformers' save layout cannot be worked out from shapes ({type(error).__name__}: "
            f"{error}); pass layout='model' to write the model's own state-dict names."
        ) from error
    if {k: tuple(v.shape) for k, v in saved.items()} == {k: tuple(v) for k, v in names.items()}:
        return None  # no rule renames or regroups anything
    layout = hub_layout(model, {k: tuple(v.shape) for k, v in saved.items()}, names)
    odd = [n for n in names if n not in layout.sources or layout.sources[n].convert is not None]
    if odd or layout.unexpected or layout.missing or layout.problems:
        raise ValueError(
            f"{what}: transformers saves {odd or layout.unexpected} in a layout that is not blocks of the "
            "model's tensors (only renamed, stacked or concatenated tensors are written by parts); pass "
            "layout='model' to write the model's own state-dict names."
        )
    return {name: layout.sources[name].blocks for name in names}


# ---- the rules ---------------------------------------------------------------------------------


def _is_transformers_model(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")  # a transformers model means it is imported already
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def _transforms(model: nn.Module) -> list[Any]:
    """``transformers``' weight transforms for loading ``model`` as ``from_pretrained`` does (or none)."""
    if not _is_transformers_model(model):
        return []
    from transformers.conversion_mapping import get_model_conversion_mapping

    return list(get_model_conversion_mapping(model))  # type: ignore[arg-type]  # reason: checked above


def _convert(
    layout: HubLayout,
    model: nn.Module,
    converter: Any,
    target: str,
    found: dict[str, list[str]],
    checkpoint: Mapping[str, Shape],
    names: Mapping[str, Shape],
) -> None:
    """``target``'s source from the checkpoint names ``found`` per source pattern of ``converter``."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    patterns = list(converter.source_patterns)
    shape = tuple(names[target])
    if not all(isinstance(op, MergeModulelist | Concatenate) for op in ops):
        _by_transformers(layout, model, converter, target, found, checkpoint, names)
        return
    if ops and isinstance(ops[0], MergeModulelist):
        absent = _absent_experts(found, patterns, shape[ops[0].dim], target)
        if absent:
            layout.missing[target] = absent
            return
    values: dict[str, list[Source]] = {
        p: [Source.whole(k, tuple(checkpoint[k])) for k in sorted(found[p], key=lambda k: _expert(p, k) or 0)]
        for p in patterns
        if p in found
    }
    try:
        for op in ops:
            if isinstance(op, MergeModulelist):
                values = {p: [_stack(v, op.dim)] for p, v in values.items()}
            else:
                values = {"": [_cat([s for p in patterns if p in values for s in values[p]], op.dim)]}
    except ValueError as error:
        layout.problems[target] = f"{target}: {error}."
        return
    result = [s for v in values.values() for s in v]
    if len(result) != 1:
        layout.problems[target] = f"{target}: {len(result)} tensors after {ops} (one expected)."
        return
    layout.sources[target] = result[0]


def _by_transformers(
    layout: HubLayout,
    model: nn.Module,
    converter: Any,
    target: str,
    found: dict[str, list[str]],
    checkpoint: Mapping[str, Shape],
    names: Mapping[str, Shape],
) -> None:
    """Sources for what ``converter`` makes of ``found``, run as ``transformers`` runs it on whole tensors.

    Its outputs (one target, or several for a split) and their shapes come from running it once on
    meta tensors of the checkpoint's shapes.
    """
    from transformers.core_model_loading import dot_natural_key

    ordered = {p: sorted(keys, key=dot_natural_key) for p, keys in found.items()}
    every = tuple(k for keys in ordered.values() for k in keys)

    def run(read: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        fresh = copy.deepcopy(converter)
        for pattern, keys in ordered.items():
            for key in keys:
                fresh.add_tensor(target, key, pattern, functools.partial(read, key))
        out = fresh.convert(target, model=model, config=getattr(model, "config", None))
        return {name: value[0] if isinstance(value, list) else value for name, value in out.items()}

    try:
        made = run(lambda key: torch.empty(checkpoint[key], device="meta"))
    except Exception as error:  # an operation that needs values, or a name it cannot place
        layout.problems[target] = (
            f"{target}: transformers' {type(converter).__name__} of {list(every)} cannot be planned from "
            f"shapes ({type(error).__name__}: {error})."
        )
        return
    pending: dict[str, torch.Tensor] = {}  # a split's other outputs, until their turn

    def value_of(name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        if name not in pending:
            pending.update(run(read))
        return pending.pop(name)

    for name, value in made.items():
        if name not in names:
            layout.problems[name] = (
                f"transformers makes {name} of {list(every)}, a name the model does not have."
            )
            continue
        layout.sources[name] = Source(tuple(value.shape), (), every, functools.partial(value_of, name))


def _expert(pattern: str, key: str) -> int | None:
    """The expert number a pattern's ``*`` stands for in ``key`` (``None``: the pattern has no ``*``)."""
    if "*" not in pattern:
        return None
    match = re.search(pattern.replace("*.", r"(\d+)\."), key)
    return int(match.group(1)) if match else None


def _absent_experts(
    found: dict[str, list[str]], patterns: Sequence[str], count: int, target: str
) -> list[str]:
    """The checkpoint names of experts ``0 .. count - 1`` no file holds, for each source pattern.

    Named after a key the checkpoint has (``...experts.5.w3.weight`` beside ``...experts.4.w3.weight``);
    a pattern with no key at all after one of another pattern (``...experts.{0..7}.up_proj.weight``).
    """
    absent = []
    sample_pattern, sample_keys = next(iter(found.items()))
    for pattern in patterns:
        keys = found.get(pattern, [])
        if not keys:
            absent.append(_named_like(sample_keys[0], sample_pattern, pattern, f"{{0..{count - 1}}}", target))
            continue
        have = {_expert(pattern, k) for k in keys}
        if None not in have:
            absent += [
                _named_like(keys[0], pattern, pattern, str(i), target) for i in range(count) if i not in have
            ]
    return absent


def _named_like(key: str, key_pattern: str, pattern: str, number: str, target: str) -> str:
    """``key`` with the part ``key_pattern`` matches written as ``pattern`` for expert ``number``."""
    match = re.search(key_pattern.replace("*.", r"(?:\d+)\."), key)
    text = pattern.removeprefix("^").replace("\\", "").replace("*", number)
    if match is None:  # the pattern matches the renamed key only
        return f"{text} (of {target})"
    return key[: match.start()] + text + key[match.end() :]


def _stack(sources: Sequence[Source], dim: int) -> Source:
    shape = collections.Counter(s.shape for s in sources).most_common(1)[0][0]
    odd = [f"{s.names[0]} {s.shape}" for s in sources if s.shape != shape]
    if odd:
        raise ValueError(f"{', '.join(odd)} cannot be stacked with the other experts, of shape {shape}")
    blocks = tuple(b.stacked(dim, i) for i, s in enumerate(sources) for b in s.blocks)
    return Source(
        (*shape[:dim], len(sources), *shape[dim:]), blocks, tuple(n for s in sources for n in s.names)
    )


def _cat(sources: Sequence[Source], dim: int) -> Source:
    others = {s.shape[:dim] + s.shape[dim + 1 :] for s in sources}
    if len(others) != 1:
        raise ValueError(f"tensors of shapes {[s.shape for s in sources]} cannot be joined on dim {dim}")
    blocks, offset = [], 0
    for s in sources:
        blocks += [b.moved(dim, offset) for b in s.blocks]
        offset += s.shape[dim]
    shape = list(sources[0].shape)
    shape[dim] = offset
    return Source(tuple(shape), tuple(blocks), tuple(n for s in sources for n in s.names))
