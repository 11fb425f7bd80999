"""Floor 4: the traced (torch.compile) path.

The traced path: the hooks a top-level module takes when dynamo traces it (collectives in the
graph), what it cannot trace (named), and fsdp2's fixes of torch 2.13's compiler. Imports ``base``,
``param`` and ``group`` (what it reads of a group).

Internal: fsdp2's public names are in ``fsdp2``; this face is for reading the architecture.
"""

from ._compiled import traced_post_forward, traced_pre_forward, untraceable

__all__ = ["traced_post_forward", "traced_pre_forward", "untraceable"]
