"""Floor 4: the traced (torch.compile) path.

The traced path: the hooks a top-level module takes when dynamo traces it (collectives in the
graph), what it cannot trace (named), and fsdp2's fixes of torch 2.13's compiler. Imports ``base``,
``param`` and ``group`` (what it reads of a group).

The face: ``__all__`` is what the rooms above may use, and they import nothing else of this room
(``tests/house/test_layering.py`` checks). fsdp2's public names are in ``fsdp2``.
"""

from ._compiled import TRACING, recover, traced_post_forward, traced_pre_forward, untraceable

__all__ = ["TRACING", "recover", "traced_post_forward", "traced_pre_forward", "untraceable"]
