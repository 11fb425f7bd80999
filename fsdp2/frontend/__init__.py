"""Floor 6: what a user calls to shard.

What a user calls to shard: ``fully_shard`` (validation, then the state and groups), ``replicate``
(the same engine, every parameter whole on each rank), ``FSDPModule`` and ``ReplicateModule`` (the
methods mixed into the module's class), recognition by torch's composable
registry, ``patch_torch_fsdp``, and ``detached`` (a sharded tree as plain modules while deep copy
copies it). Imports the floors below.

The face: ``__all__`` is what the rooms above may use, and they import nothing else of this room
(``tests/house/test_layering.py`` checks). fsdp2's public names are in ``fsdp2``.
"""

from ._detach import detached
from ._fully_shard import fully_shard
from ._module import FSDPModule, ReplicateModule
from ._patch import patch_torch_fsdp
from ._replicate import replicate
from ._setter_checks import describe

__all__ = [
    "FSDPModule",
    "ReplicateModule",
    "describe",
    "detached",
    "fully_shard",
    "patch_torch_fsdp",
    "replicate",
]
