"""Warnings attributed to the user's line, not to bsloss or torch internals."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

_INTERNAL = (str(Path(__file__).parent), "torch", "contextlib")


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` with the stack level of the first frame outside bsloss and torch."""
    frame, level = sys._getframe(1), 2
    while frame is not None and any(part in frame.f_code.co_filename for part in _INTERNAL):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level - 1 if frame is None else level)
