"""Floor 8: weights in and out of a sharded model.

Owns: full-state files (``save_full_state_dict`` / ``load_full_state_dict``: the plain model's names,
gathered or scattered one group at a time), Hugging Face checkpoints (``save_pretrained`` /
``load_pretrained``: sharded safetensors files, each written or read in parts by every rank, in the
names and layout ``transformers`` saves, per-expert tensors of expert stacks included), weight
sync to an inference engine (``WeightSync``: each call only what changed, gathered in buckets; or each
rank's shards with their places, ``LocalShard``), ``copy.deepcopy`` of ``fully_shard`` modules, and
DCP-format sharded checkpoints planned from the layout alone (``ShardedCheckpointer`` /
``save_sharded``: no gather of plans; in the background within a host staging budget; ``load`` /
``load_sharded``: each rank reads only the saved chunks its shards need, by the same arithmetic).
Reads the engine through its queries (``runtime``, ``group``); imports the floors below (``debug``:
every rank agrees to enter an export or import in debug mode).

The face: ``__all__`` is what the rooms above may use, and they import nothing else of this room
(``tests/house/test_layering.py`` checks). fsdp2's public names are in ``fsdp2``.
"""

from ._copy import deepcopy_fsdp
from ._flat_save import PendingSave, ShardedCheckpointer, load_sharded, save_sharded
from ._full_state import load_full_state_dict, save_full_state_dict
from ._local_shards import LocalShard
from ._pretrained import load_pretrained, save_pretrained
from ._weight_sync import WeightSync

__all__ = [
    "LocalShard",
    "PendingSave",
    "ShardedCheckpointer",
    "WeightSync",
    "deepcopy_fsdp",
    "load_full_state_dict",
    "load_pretrained",
    "load_sharded",
    "save_full_state_dict",
    "save_pretrained",
    "save_sharded",
]
