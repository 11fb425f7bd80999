"""Floor 2: one parameter and its parts.

One parameter and its parts: the shard layout (chunk and padding math), the local shard and
its sharded DTensor, the unsharded parameter and its gradient, tensor-parallel and all-gather-extension
layouts, the row layouts and the routes between them (which rank sends which rows where), the DTensor
helpers, initialisation like the unsharded model, and the check for parameters added late. Imports
``base`` and ``comm``. Offers the installs that make DTensors over packed shards picklable and
deep-copyable (``fsdp2/__init__.py`` runs them).

Internal: fsdp2's public names are in ``fsdp2``; this face is for reading the architecture.
"""

from ._dtensor import install_deepcopy, install_pickling
from ._init import init_like_unsharded
from ._layout import ShardLayout
from ._param import FSDPParam
from ._rows import Piece, Routes, RowLayout, local_box, owners_by_load, routes, row_shard

__all__ = [
    "FSDPParam",
    "Piece",
    "Routes",
    "RowLayout",
    "ShardLayout",
    "init_like_unsharded",
    "install_deepcopy",
    "install_pickling",
    "local_box",
    "owners_by_load",
    "routes",
    "row_shard",
]
