"""Warnings that point at the user's code.

Owns: ``warn_user``, which attributes a warning to the first frame outside fsdp2 and torch (the line of
the user's script that called the model), so Python's filters show it once per such line and the
message says where to look. Does not own what is warned about.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

_INTERNAL = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # fsdp2/, from fsdp2/base/
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message)`` attributed to the innermost caller outside fsdp2 and torch."""
    level, frame = 1, sys._getframe(1)  # noqa: SLF001 - the only way to walk the caller's stack
    while frame.f_code.co_filename.startswith(_INTERNAL) and frame.f_back is not None:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
