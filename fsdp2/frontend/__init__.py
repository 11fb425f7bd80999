"""Floor 6: what a user calls to shard.

What a user calls to shard: ``fully_shard`` (validation, then the state and groups),
``FSDPModule`` (the methods mixed into the module's class), recognition by torch's composable
registry, and ``patch_torch_fsdp``. Imports the floors below.

Internal: fsdp2's public names are in ``fsdp2``; this face is for reading the architecture.
"""

from ._fully_shard import fully_shard
from ._module import FSDPModule
from ._patch import patch_torch_fsdp

__all__ = ["FSDPModule", "fully_shard", "patch_torch_fsdp"]
