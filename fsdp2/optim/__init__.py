"""Floor 7: what steps the optimizer over sharded parameters.

Owns: optimizer steps on local shards (``local_step``, and the automatic one for torch's elementwise
optimizers, enabled at the first ``fully_shard``: ``fsdp2/__init__.py`` registers it), whole-tensor
steps on owner ranks for optimizers that need each whole parameter (``whole_tensor_step``: Muon,
Adafactor, declared classes; ``declare_optimizer``), Muon over stacks of matrices (``StackedMuon``),
gradient clipping over shards (``clip_grad_norm_``) and gradient accumulation within a memory budget
(``accumulate``), and optimizer state sharded across HSDP's replicas
(``shard_optimizer_across_replicas``: ZeRO-1/2 across replicas, HSDP within). Does not
own: the one pre- and post-step hook and the step guard (``runtime``). Reads the engine through
``runtime``'s and ``group``'s queries; imports the floors below.

The face: ``__all__`` is what the rooms above may use, and they import nothing else of this room
(``tests/house/test_layering.py`` checks). fsdp2's public names are in ``fsdp2``.
"""

from ._accumulate import Accumulation, accumulate
from ._clip import clip_grad_norm_
from ._cross_replica import shard_optimizer_across_replicas
from ._local_optim import enable_automatic_local_steps, local_step
from ._stacked_muon import StackedMuon
from ._whole_tensor import declare_optimizer, enable_whole_tensor_steps, whole_tensor_step

__all__ = [
    "Accumulation",
    "StackedMuon",
    "accumulate",
    "clip_grad_norm_",
    "declare_optimizer",
    "enable_automatic_local_steps",
    "enable_whole_tensor_steps",
    "local_step",
    "shard_optimizer_across_replicas",
    "whole_tensor_step",
]
