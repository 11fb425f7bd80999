"""Floor 2: one parameter and its parts.

One parameter and its parts: the shard layout (chunk and padding math), the local shard and
its sharded DTensor, the unsharded parameter and its gradient, tensor-parallel and all-gather-extension
layouts, the row layouts and the routes between them (which rank sends which rows where), the DTensor
helpers, initialisation like the unsharded model, and the check for parameters added late. Imports
``base`` and ``comm``. Offers the installs that make DTensors over packed shards picklable and
deep-copyable (``fsdp2/__init__.py`` runs them).

The face: ``__all__`` is what the rooms above may use, and they import nothing else of this room
(``tests/house/test_layering.py`` checks). fsdp2's public names are in ``fsdp2``.
"""

from ._dtensor import (
    install_deepcopy,
    install_pickling,
    local_in_placements,
    local_of,
    locals_of,
    make_spec,
    spec_of,
    specs_of,
    wrap_local,
)
from ._extension import has_extension, padded_rule_error
from ._init import check_materialized, init_like_unsharded, warn_if_repeated_shards
from ._late_params import LATE, check_late_parameters, watch_registrations
from ._layout import ShardLayout
from ._param import FSDPParam, can_pin, is_managed, padded_shard_numel
from ._replica_slices import (
    accumulate_slice_grad,
    is_slice,
    slice_mesh,
    slice_row_group,
    slice_rows,
    slice_spec,
)
from ._rows import Piece, Routes, RowGroup, RowLayout, local_box, owners_by_load, routes, row_shard
from ._shard import check_subclass_shardable

__all__ = [
    "LATE",
    "FSDPParam",
    "Piece",
    "Routes",
    "RowGroup",
    "RowLayout",
    "ShardLayout",
    "accumulate_slice_grad",
    "can_pin",
    "check_late_parameters",
    "check_materialized",
    "check_subclass_shardable",
    "has_extension",
    "init_like_unsharded",
    "install_deepcopy",
    "install_pickling",
    "is_managed",
    "is_slice",
    "local_box",
    "local_in_placements",
    "local_of",
    "locals_of",
    "make_spec",
    "owners_by_load",
    "padded_rule_error",
    "padded_shard_numel",
    "routes",
    "row_shard",
    "slice_mesh",
    "slice_row_group",
    "slice_rows",
    "slice_spec",
    "spec_of",
    "specs_of",
    "warn_if_repeated_shards",
    "watch_registrations",
    "wrap_local",
]
