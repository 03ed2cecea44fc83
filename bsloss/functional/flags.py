"""The check of a boolean argument at the public boundary, shared by the loss and the metric."""

from __future__ import annotations

import numbers

import numpy as np

__all__ = ["check_flag"]


def check_flag(value: object, name: str) -> bool:
    """``value`` as a bool: a bool, a numpy bool, or the integer 0 or 1 (what bert_score's
    ``if flag:`` takes as a bool); anything else is refused. A plain truth test would read the
    string ``"false"`` as true.

    Raises:
        TypeError: any other value, a string included (``name`` named).

    >>> check_flag(np.True_, "center"), check_flag(0, "center")
    (True, False)
    >>> check_flag("false", "center")
    Traceback (most recent call last):
    TypeError: center must be a bool (or 0, 1), got 'false'
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be a bool (or 0, 1), got {value!r}")
