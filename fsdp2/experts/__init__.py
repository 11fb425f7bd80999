"""Floor 7: expert parallelism, declared once: ``shard_experts``.

Experts: which modules hold stacked expert weights and how they are called, the expert mesh
(``efsdp x ep`` over the data-parallel ranks), each rank's experts, the token exchange to the ranks of
the experts a router chose and back (on the exchange floor, with autograd), and the layout of the
local stacks; it calls ``fully_shard`` for the sharding. See docs/experts.md. Imports the floors below.

The face: ``__all__`` is what the rooms above may use, and they import nothing else of this room
(``tests/house/test_layering.py`` checks). fsdp2's public names are in ``fsdp2``.
"""

from ._declare import shard_experts
from ._find import is_experts_module
from ._module import placement_of

__all__ = ["is_experts_module", "placement_of", "shard_experts"]
