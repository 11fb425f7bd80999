"""Hugging Face checkpoints (sharded safetensors) written and read by every rank in parallel.

Owns: ``save_pretrained`` (the plain model's state dict split into ``model-0000k-of-0000n.safetensors``
files plus ``model.safetensors.index.json``, each file written by one rank) and ``load_pretrained``
(each rank reads only the bytes of its own shards, from such a directory or one ``.safetensors`` file).
Does not own: the safetensors header and dtype table and the state-dict checks (``_safetensors.py``,
shared with the rank-0 full-state files of ``_full_state.py``), the placement arithmetic (``param``'s
rows), which checkpoint tensors make which model tensor (``_hub_layout``: ``transformers``' conversion
rules), or the reads (``_hub_reader``, over the ``safetensors`` package, imported lazily).
Invariants: the files, their tensors and their writers follow from names, shapes and dtypes alone,
so every rank knows them without communication; a load checks every name and shape on every rank
and all ranks agree before any parameter is written.

[Note: Who writes what]
The entries (tied weights once) are cut into files in state-dict order, a file closed before it
would pass ``max_shard_size`` (as Hugging Face's ``split_torch_state_dict_into_shards`` does); files
go to ranks largest first, each to the rank with the fewest bytes so far. A rank's tensors, in its
files' order, form its queue. Round ``k`` moves the ``k``-th tensor of every rank's queue at once: one
``all_to_all_single`` in which every rank sends the rows it holds of each of those tensors to that
tensor's writer. A writer so receives the tensors of its own files only, one per round; every other
rank sends its shard and keeps nothing. Rows come from one holder each: a dim-0 shard from the rank
at its mesh coordinate in the writer's replica (or replica 0), a replicated or plain tensor from the
writer itself when it holds one. Other placements (strided tensor-parallel shards) are gathered whole
on their mesh first (``DTensor.full_tensor``) and sent by one holder. The rows' holders, the writers'
choice, the exchange and its buffers and the agreement are the floor's (``param._rows``,
``comm._exchange``, ``comm.raise_everywhere``): the writer knows what each holder sends, so no counts
travel, and the bytes are packed unpadded (one tensor per round and pair). A model tensor that
``transformers`` saves as several (a stack of experts: one tensor per expert and projection) is one
entry: its writer receives it whole and writes its blocks one after another, all in the same file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..comm import Scratch, exchange, raise_everywhere
from ..debug import check_entry
from ..param import RowLayout, owners_by_load, row_shard
from ._buffers import rebuild_buffers
from ._hub_layout import Block, hub_layout, hub_names
from ._hub_reader import INDEX_NAME, SINGLE_NAME, HubReader
from ._safetensors import (
    SAFETENSORS_DTYPES,
    checked_state_dict,
    comm_device,
    full_tensor,
    header_bytes,
    safe_open_or_raise,
)

_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_DEFAULT_LIMIT = 5 * 10**9  # the Hugging Face Hub's advice for a file
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


@dataclass(frozen=True)
class _Entry:
    """One model tensor of the export: its state-dict value, the dtype stored, the file tensors it is.

    ``blocks``: itself under its name, or the tensors transformers saves it as (one per expert of a stack).
    """

    tensor: torch.Tensor
    dtype: torch.dtype
    blocks: tuple[Block, ...]

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.dtype.itemsize


def save_pretrained(
    model: nn.Module,
    directory: str | os.PathLike[str],
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | str | None = None,
    layout: str | None = None,
) -> None:
    """Write ``model``'s full weights as a Hugging Face checkpoint, every rank writing its own files.

    Every rank must call it, with the same arguments, on a directory every rank sees (a shared filesystem).
    The files hold the plain (unsharded) model's ``state_dict()``, under the names and in the layout
    ``transformers``' own ``save_pretrained`` writes (``layout="hub"``: its conversion rules reversed, so a
    mixture of experts' stacks become one tensor per expert and projection, ``experts.3.gate_proj.weight``, as
    Hub checkpoints and vLLM hold them; no rule: the state-dict names) or under the state-dict names
    (``layout="model"``). A weight tied to others (the same parameter under several names, as
    ``lm_head.weight`` and ``model.embed_tokens.weight``) is written once, as ``transformers``'
    ``save_pretrained`` writes it: under its first name that is not a tie target the model declares
    (``all_tied_weights_keys``), so ``from_pretrained`` reties it. The layout is Hugging Face's:
    ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json`` (``metadata.total_size``,
    ``weight_map``), or one ``model.safetensors`` when everything fits one file. A model with a ``config``
    that saves itself (a ``transformers`` model) also gets its ``config.json`` (and
    ``generation_config.json``), so ``from_pretrained(directory)`` works. Rank 0 removes shard files of an
    earlier export that this one does not replace.

    Each rank receives only the tensors of its own files, one tensor per round (see [Note: Who writes
    what]): one ``all_to_all_single`` per round, a barrier at the end, and one small exchange before
    any write (every rank raises, or none). Peak memory per rank: its shards plus two tensors.

    Args:
        model: the fsdp2 (or plain) model; its parameters are left as they were.
        directory: where the files go (created if missing; files of the same names are overwritten).
        dtype: the dtype floating-point tensors are stored in (default: each tensor's own), as a
            ``torch.dtype`` or its name as ``transformers`` takes it (``"bfloat16"``, ``"torch.float16"``);
            integer and bool tensors keep theirs.
        max_shard_size: the largest file, in bytes or as a string (``"5GB"``, ``"500MiB"``); a tensor
            larger than it gets a file of its own. Default: the model's size over the world size (so
            every rank writes), at most 5 GB.
        layout: ``"hub"``: the names and tensors ``transformers.PreTrainedModel.save_pretrained``
            writes; ``"model"``: the model's own state-dict names and tensors (stacked experts as
            stacks); ``None`` (default): ``"hub"`` where transformers' saved layout is blocks of the
            model's tensors (per-expert tensors cut from stacks), else ``"model"`` (several tensors
            fused into one, a transposed stack). Both load with ``from_pretrained`` and
            :func:`load_pretrained`; see docs/checkpointing.md.

    Raises:
        TypeError: a state-dict entry is not a tensor, or its dtype (or ``dtype``) cannot be stored.
        ValueError: ``max_shard_size`` is not a positive size, ``layout`` is neither ``"hub"``,
            ``"model"`` nor ``None``, or ``layout="hub"`` where transformers saves the model in a layout
            that is not blocks of its tensors (pass ``layout="model"`` or leave the default).
        OSError: (on every rank, before anything is written) a rank cannot create its files.

    Example:
        >>> fsdp2.save_pretrained(model, "out/")  # doctest: +SKIP
        >>> transformers.AutoModelForCausalLM.from_pretrained("out/")  # doctest: +SKIP
    """
    check_entry(model, "save_pretrained")  # debug mode: every rank is here (else DivergenceError)
    dtype = _stored_dtype(dtype)
    if layout not in ("hub", "model", None):
        raise ValueError(
            f"save_pretrained: layout must be 'hub' (transformers' save_pretrained names, one tensor per "
            f"expert) or 'model' (the model's state-dict names), got {layout!r}."
        )
    entries = _stored_entries(model, dtype, layout)
    rank, world = _rank_and_world()
    files = _split(entries, _limit(max_shard_size, entries, world))
    owners = _owners(files, world)
    names = _file_names(len(files))
    mine = [i for i, owner in enumerate(owners) if owner == rank]
    streams: dict[int, BinaryIO] = {}
    try:
        problem = _open_files(directory, names, files, mine, streams)
        if rank == 0 and not problem:
            problem = _write_index(model, directory, names, files)
        device = comm_device(e.tensor for e in entries)
        # a flag's all-reduce first: the messages are gathered (one object per rank) only on a problem
        fail = lambda text: OSError(f"save_pretrained: {text} Nothing was written.")  # noqa: E731
        raise_everywhere(problem, None, fail, device=device)
        queues: dict[int, list[tuple[int, _Entry]]] = {}  # the writers' only (see [Note: Who writes what])
        for i, file in enumerate(files):
            queues.setdefault(owners[i], []).extend((i, e) for e in file)
        _stream(queues, streams, rank, device)
    finally:
        for stream in streams.values():
            stream.close()
    if dist.is_initialized():
        dist.barrier()


def load_pretrained(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Fill ``model``'s parameters and persistent buffers from a Hugging Face checkpoint, in place.

    Every rank must call it; each rank opens the files itself (a filesystem every rank sees) and reads only
    the bytes of its own shards (``safe_open(...).get_slice(name)[rows]``): no rank holds a full tensor of a
    sharded parameter. The checkpoint's names are mapped onto the model's by ``transformers``' own conversion
    rules for the model (as ``from_pretrained`` maps them): a mixture of experts' stack
    ``experts.gate_up_proj`` ``[E, 2I, D]`` is made of the checkpoint's ``experts.{e}.gate_proj.weight`` and
    ``up_proj.weight``, and a rank reads only the experts (``Shard(0)``, ``shard_experts``' layouts) or the
    rows of each expert (``Shard(1)``) its shard holds. Plain (non-DTensor) tensors are read whole; a shard
    that is not one block of the tensor (some strided tensor-parallel shards), or a tensor ``transformers``
    converts otherwise than by stacking or joining, is read whole and cut locally. Values are cast to each
    tensor's dtype. The model may have been built on the meta device and ``to_empty``'d: its non-persistent
    buffers (RoPE's ``inv_freq``), which no file holds, are then rebuilt as ``from_pretrained`` rebuilds them
    (a ``transformers`` model's own ``_init_weights``); one that nothing rebuilds is named in a ``ValueError``
    before any parameter changes. A buffer that had values before ``to_empty`` keeps them
    (``FSDPModule.to_empty``). A tied weight needs only one of its names in the file. Issues one small
    exchange (all ranks agree on the check) and no collective on the weights.

    Args:
        model: the fsdp2 (or plain) model, at any world size; names are its ``state_dict()`` keys.
        path: a directory with ``model.safetensors.index.json`` or ``model.safetensors`` (as Hugging
            Face's ``save_pretrained`` or :func:`save_pretrained` writes it), or one ``.safetensors`` file.

    Raises:
        ImportError: the ``safetensors`` package is not installed.
        ValueError: (on every rank, before any parameter changes) a file cannot be read, or names are
            missing from the checkpoint (an absent expert by its checkpoint name), unexpected in it, or
            of another shape, a parameter is still on the meta device, or a non-persistent buffer holds
            uninitialised memory that nothing rebuilds.

    Example:
        >>> with torch.device("meta"):  # doctest: +SKIP
        ...     model = transformers.AutoModelForCausalLM.from_config(config)
        >>> for layer in model.model.layers:  # doctest: +SKIP
        ...     fsdp2.fully_shard(layer)
        >>> fsdp2.fully_shard(model).to_empty(device="cuda")  # doctest: +SKIP
        >>> fsdp2.load_pretrained(model, "Llama-3.2-1B/")  # doctest: +SKIP
    """
    safe_open = safe_open_or_raise("load_pretrained")
    check_entry(model, "load_pretrained")  # debug mode: every rank is here (else DivergenceError)
    groups = _tie_groups(model, checked_state_dict(model))
    reader = HubReader(safe_open)
    try:
        problem = reader.open(path)
        if not problem:
            shapes = {name: tuple(tensor.shape) for names, tensor in groups for name in names}
            layout = hub_layout(model, reader.shapes(), shapes)
            problem = reader.check(groups, layout)
        if not problem:
            problem = rebuild_buffers(model, "load_pretrained")
        what = f"load_pretrained({os.fspath(path)!r})"
        raise_everywhere(problem, None, lambda text: ValueError(f"{what}: {text} Nothing was loaded."))
        with torch.no_grad():
            reader.read(groups, layout)
    finally:
        reader.close()


# ---- export -------------------------------------------------------------------------------------


def _stored_dtype(dtype: object) -> torch.dtype | None:
    """``save_pretrained``'s ``dtype``: ``None``, a ``torch.dtype`` or its name; refused otherwise."""
    accepted = "pass torch.float16, torch.bfloat16, torch.float32 or torch.float64 (or their names)"
    if isinstance(dtype, str):
        named = getattr(torch, dtype.strip().removeprefix("torch."), None)
        if not isinstance(named, torch.dtype):
            raise TypeError(f"save_pretrained: dtype {dtype!r} names no torch dtype: {accepted}.")
        dtype = named
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"save_pretrained: dtype must be a torch.dtype or its name, got {dtype!r}: {accepted}."
        )
    if dtype is not None and not dtype.is_floating_point:
        raise TypeError(f"save_pretrained: dtype must be a floating-point dtype, got {dtype}: {accepted}.")
    if dtype is not None and dtype not in SAFETENSORS_DTYPES:
        raise TypeError(f"save_pretrained: safetensors cannot store {dtype}: {accepted}.")
    return dtype


def _stored_entries(model: nn.Module, dtype: torch.dtype | None, layout: str | None) -> list[_Entry]:
    """The tensors to write, in state-dict order: one per tie group.

    Under its kept name (``layout="model"``), or as the blocks ``transformers`` saves it as (``"hub"``).
    """
    groups = _tie_groups(model, checked_state_dict(model))
    shapes = {names[0]: tuple(t.shape) for names, t in groups}
    blocks = None
    if layout == "hub":
        blocks = hub_names(model, shapes)
    elif layout is None:  # the Hub's layout where it is blocks of the model's tensors, else the model's
        with contextlib.suppress(ValueError):
            blocks = hub_names(model, shapes)
    entries = []
    for names, tensor in groups:
        stored = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        whole = (Block(names[0], (0,) * tensor.dim(), tuple(tensor.shape)),)
        entries.append(_Entry(tensor, stored, blocks[names[0]] if blocks is not None else whole))
    return entries


def _tie_groups(model: nn.Module, state: dict[str, torch.Tensor]) -> list[tuple[list[str], torch.Tensor]]:
    """``(names, tensor)`` per distinct parameter or buffer, the name to write first.

    Names of one parameter (or buffer) object are one group; the name kept is the first, in state-dict
    order, that the model does not declare as a tie target (``transformers``' ``all_tied_weights_keys``).
    """
    owner = {}
    for name, value in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        owner[name] = id(value)
    targets = set(getattr(model, "all_tied_weights_keys", None) or {})
    grouped: dict[Any, list[str]] = {}
    for name in state:
        grouped.setdefault(owner.get(name, name), []).append(name)
    groups = []
    for names in grouped.values():
        ordered = sorted(names, key=lambda n: n in targets)  # stable: kept names first
        groups.append((ordered, state[ordered[0]]))
    return groups


def _rank_and_world() -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def _limit(max_shard_size: int | str | None, entries: Sequence[_Entry], world: int) -> int:
    """``max_shard_size`` in bytes (``None``: the model over the world size, at most 5 GB)."""
    if max_shard_size is None:
        total = sum(e.nbytes for e in entries)
        return max(1, min(_DEFAULT_LIMIT, -(-total // world)))
    size = max_shard_size
    if isinstance(size, str):
        match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", size)
        unit = match.group(2).upper() if match else ""
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"save_pretrained: max_shard_size {size!r} is not a size like '5GB' or '500MiB'."
            )
        size = int(match.group(1)) * _UNITS[unit]
    if isinstance(size, bool) or size <= 0:
        raise ValueError(f"save_pretrained: max_shard_size must be a positive size in bytes, got {size!r}.")
    return size


def _split(entries: Sequence[_Entry], limit: int) -> list[list[_Entry]]:
    """Entries cut into files in order, a file closed before it passes ``limit``; larger elements first."""
    files: list[list[_Entry]] = [[]]
    size = 0
    for entry in entries:
        if files[-1] and size + entry.nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += entry.nbytes
    # Stable: descending element sizes keep each tensor's offset a multiple of its element size.
    return [sorted(file, key=lambda e: -e.dtype.itemsize) for file in files]


def _owners(files: Sequence[Sequence[_Entry]], world: int) -> list[int]:
    """The rank writing each file: largest file first, to the rank with the fewest bytes (then lowest)."""
    return owners_by_load([sum(e.nbytes for e in file) for file in files], world)


def _file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _open_files(
    directory: str | os.PathLike[str],
    names: Sequence[str],
    files: Sequence[Sequence[_Entry]],
    mine: Sequence[int],
    streams: dict[int, BinaryIO],
) -> str:
    """Create this rank's files with their headers (into ``streams``); a problem, or ``""``."""
    try:
        os.makedirs(directory, exist_ok=True)
        for i in mine:
            streams[i] = open(os.path.join(directory, names[i]), "wb")  # noqa: SIM115 - closed by the caller
            streams[i].write(header_bytes((b.name, e.dtype, b.shape) for e in files[i] for b in e.blocks))
    except OSError as error:
        return f"cannot write in {os.fspath(directory)!r}: {error}"
    return ""


def _write_index(
    model: nn.Module,
    directory: str | os.PathLike[str],
    names: Sequence[str],
    files: Sequence[Sequence[_Entry]],
) -> str:
    """Rank 0: the index (several files), the config, and no stale file of an earlier export."""
    try:
        for stale in os.listdir(directory):
            if (_SHARD_NAME.fullmatch(stale) or stale in (SINGLE_NAME, INDEX_NAME)) and stale not in names:
                os.remove(os.path.join(directory, stale))
        if len(files) > 1:
            weight_map = {b.name: names[i] for i, file in enumerate(files) for e in file for b in e.blocks}
            total = sum(e.nbytes for file in files for e in file)
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            with open(os.path.join(directory, INDEX_NAME), "w", encoding="utf-8") as stream:
                stream.write(json.dumps(index, indent=2) + "\n")
        floating = [e.dtype for file in files for e in file if e.dtype.is_floating_point]
        _write_config(model, directory, floating[0] if floating else None)
    except OSError as error:
        return f"rank 0 cannot write in {os.fspath(directory)!r}: {error}"
    return ""


def _write_config(model: nn.Module, directory: str | os.PathLike[str], dtype: torch.dtype | None) -> None:
    """A ``transformers`` model's ``config.json`` (and generation config), naming the plain class."""
    config: Any = getattr(model, "config", None)
    if not callable(getattr(config, "save_pretrained", None)):
        return
    config.architectures = [type(model).__name__.removeprefix("FSDP")]  # fully_shard's class swap
    if dtype is not None:
        config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(directory)
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        generation.save_pretrained(directory)


def _stream(
    queues: dict[int, list[tuple[int, _Entry]]],
    streams: dict[int, BinaryIO],
    rank: int,
    device: torch.device,
) -> None:
    """Every round: each rank's next tensor to its writer (one all-to-all), then each writes its own.

    Only writers have queues; a round looks at each writer's tensor once, so its Python work follows
    the files, never the world size (where the rows of a tensor are is found by arithmetic, ``_Places``).
    """
    scratch = Scratch(device)
    places = _Places()
    writers = sorted(queues)
    mine = queues.get(rank, [])
    for k in range(max(map(len, queues.values()))):
        sends: dict[int, list[torch.Tensor]] = {}
        for writer in writers:  # every rank in the same order: the strided gathers are collectives
            if k < len(queues[writer]):
                held = _held(queues[writer][k][1], writer, rank, places)
                if held is not None:
                    sends[writer] = [held.to(scratch.device)]
        entry = mine[k][1] if k < len(mine) else None
        senders = places.senders(entry, rank) if entry is not None else []
        expect: dict[int, int] = defaultdict(int)
        for sender, nbytes in senders:
            expect[sender] += nbytes
        received = exchange(sends, None, expect=expect, scratch=scratch, align=1, check=False)
        del sends
        if entry is not None:
            _write(streams[mine[k][0]], _in_row_order(received.buffer, senders), entry)


def _write(stream: BinaryIO, full: torch.Tensor, entry: _Entry) -> None:
    """``entry``'s bytes (``full``, in row order) as its file tensors, one after another."""
    if len(entry.blocks) == 1 and entry.blocks[0].shape == tuple(entry.tensor.shape):
        stream.write(full.cpu().numpy().data)
        return
    typed = full.cpu().view(entry.dtype).view(entry.tensor.shape)
    for block in entry.blocks:
        stream.write(typed[block.index].contiguous().view(torch.uint8).numpy().data)


def _held(entry: _Entry, owner: int, rank: int, places: _Places) -> torch.Tensor | None:
    """What this rank sends ``owner`` of ``entry`` (its rows, in the stored dtype), or ``None``."""
    tensor = entry.tensor
    on_mesh = isinstance(tensor, DTensor) and tensor.device_mesh.get_coordinate() is not None
    if on_mesh and row_shard(tensor) is None:  # type: ignore[arg-type]
        tensor = full_tensor(tensor)  # strided shards: gathered on the mesh first
    if not places.sends(entry, owner, rank):
        return None
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.detach().to(entry.dtype)


class _Places:
    """Which ranks send a tensor's rows to its writer, by arithmetic on the mesh (one export's).

    A writer takes each dim-0 shard from the rank at its shard index in the writer's own replica (or
    replica 0, when the writer is not on the tensor's mesh), and a replicated (or gathered) tensor from
    the rank at the writer's coordinate. Each mesh's ranks are indexed once (one tensor operation), so
    a rank's coordinate is a lookup, not a search of the mesh.
    """

    def __init__(self) -> None:
        self._index: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}

    def _table(self, mesh: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``mesh``'s ranks (its ``mesh`` tensor, built once) and each global rank's flat position."""
        known = self._index.get(id(mesh))
        if known is None:
            ranks = mesh.mesh
            flat = ranks.flatten()
            table = torch.full((int(flat.max()) + 1,), -1, dtype=torch.int64)
            table[flat] = torch.arange(flat.numel())
            known = self._index[id(mesh)] = (mesh, ranks, table)  # the mesh kept: its id stays its own
        return known[1], known[2]

    def coordinate(self, mesh: Any, rank: int) -> list[int]:
        """``rank``'s coordinate on ``mesh``, or replica 0's (all zeros) when it is not on it."""
        ranks, table = self._table(mesh)
        at = int(table[rank]) if rank < table.numel() else -1
        if at < 0:
            return [0] * ranks.dim()
        coordinate = []
        for size in reversed(ranks.shape):
            at, index = divmod(at, int(size))
            coordinate.append(index)
        return coordinate[::-1]

    def senders(self, entry: _Entry, owner: int) -> list[tuple[int, int]]:
        """``(rank, bytes)`` of the holders sending ``entry`` to ``owner``, in row order."""
        tensor = entry.tensor
        if not isinstance(tensor, DTensor):
            return [(owner, entry.nbytes)]
        mesh = self._table(tensor.device_mesh)[0]
        coordinate = self.coordinate(tensor.device_mesh, owner)
        dim = row_shard(tensor)
        if dim is None:  # replicated on the mesh, or gathered whole there
            return [(int(mesh[tuple(coordinate)]), entry.nbytes)]
        rows = tensor.shape[0]
        row_bytes = entry.nbytes // rows if rows else 0
        layout = RowLayout.chunked(rows, mesh.size(dim))
        senders = []
        for index in layout.holders(0, rows):  # the shard mesh dim's ranks that hold rows, in row order
            coordinate[dim] = index
            senders.append((int(mesh[tuple(coordinate)]), layout.count(index) * row_bytes))
        return senders

    def sends(self, entry: _Entry, owner: int, rank: int) -> bool:
        """Whether this rank (``rank``) is one of ``senders(entry, owner)``: no list of them built."""
        tensor = entry.tensor
        if not isinstance(tensor, DTensor):
            return owner == rank
        here = tensor.device_mesh.get_coordinate()
        if here is None:
            return False
        coordinate = self.coordinate(tensor.device_mesh, owner)
        dim = row_shard(tensor)
        if dim is None:
            return list(here) == coordinate
        others_agree = all(here[d] == coordinate[d] for d in range(len(here)) if d != dim)
        rows = RowLayout.chunked(tensor.shape[0], tensor.device_mesh.size(dim))
        return others_agree and rows.count(here[dim]) > 0


def _in_row_order(out: torch.Tensor, senders: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The received bytes (in sender-rank order) as the tensor's bytes (in row order)."""
    ranks = [rank for rank, _ in senders]
    if ranks == sorted(ranks):
        return out
    starts, offset = {}, 0
    for rank, nbytes in sorted(senders):
        starts[rank], offset = offset, offset + nbytes
    return torch.cat([out[starts[rank] : starts[rank] + nbytes] for rank, nbytes in senders])
