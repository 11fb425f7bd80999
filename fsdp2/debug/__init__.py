"""Floor 7: the checks debug mode runs while training, and the one a user calls.

Owns: the divergence guard (every rank agrees on each FSDP collective before it runs, through a
board of what each rank is about to do), ``check_replicas`` (replicas compared bit for bit) and the
straggler watch (the rank the others waited for, named while training). The settings, the
watchdog and the straggler report over recordings are ``trace``'s (``trace/_debug.py``,
``trace/_straggler.py``).
Reads the engine through its queries (``runtime``, ``group``); imports the floors below.

The face: ``__all__`` is what the rooms above may use, and they import nothing else of this room
(``tests/house/test_layering.py`` checks). fsdp2's public names are in ``fsdp2``.
"""

from ._guard import DivergenceError, check_entry
from ._replicas import check_replicas

__all__ = ["DivergenceError", "check_entry", "check_replicas"]
