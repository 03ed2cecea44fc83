"""Token matchings: each turns similarities ``[B, Lc, Lr]`` into per-token scores in both
directions, ``(candidate [B, Lc], reference [B, Lr])``. One file per matching: its math kernel
(``hard_match``, ...) and its small :class:`Matching` class (``Hard``, ...).

Everything that takes ``matching=`` goes through :func:`resolve_matching`, which accepts a
:class:`Matching` object or a string shorthand (``"hard"``, ``"softmax"``, ``"logsumexp"``,
``"sinkhorn"``). A new matching is one subclass of :class:`Matching`.
"""

from __future__ import annotations

import numpy as np

from bsloss.functional.matching.base import (
    SHORTHANDS,
    SMALLEST_TEMPERATURE,
    Matching,
    check_iterations,
    check_temperature,
)
from bsloss.functional.matching.hard import Hard, hard_match
from bsloss.functional.matching.logsumexp import LogSumExp, logsumexp_match
from bsloss.functional.matching.sinkhorn import Sinkhorn, sinkhorn_match
from bsloss.functional.matching.softmax import Softmax, softmax_match

__all__ = [
    "Matching",
    "Hard",
    "Softmax",
    "LogSumExp",
    "Sinkhorn",
    "resolve_matching",
    "SHORTHANDS",
    "check_temperature",
    "check_iterations",
    "hard_match",
    "softmax_match",
    "logsumexp_match",
    "sinkhorn_match",
]

_MISSING = object()


def _same_setting(own: object, value: float | int) -> bool:
    """Whether a legacy keyword's ``value`` repeats the object's own: equal, or for a
    temperature equal once both are float32 (a config's ``numpy.float32(0.05)`` is the
    object's ``0.05`` to the precision the kernels divide at)."""
    if own == value:
        return True
    if isinstance(own, float) and isinstance(value, float):
        return bool(np.float32(own) == np.float32(value))
    return False


def resolve_matching(
    matching: str | Matching,
    temperature: float | None = None,
    sinkhorn_iterations: int | None = None,
) -> Matching:
    """The :class:`Matching` object that ``matching`` stands for.

    Args:
        matching: a :class:`Matching` object, returned as it is, or a string shorthand (a key
            of :data:`SHORTHANDS`: ``"hard"``, ``"softmax"``, ``"logsumexp"``, ``"sinkhorn"``).
        temperature, sinkhorn_iterations: the legacy keywords. With a shorthand they set the
            object's ``temperature`` and ``iterations`` (``None``: the class default,
            :data:`~bsloss.functional.matching.base.DEFAULT_TEMPERATURE`; a matching with no
            such parameter ignores them, as ``"hard"`` always did). With an object they may be
            left out (``None``) or repeat the object's own value (a temperature equal to it
            in float32, where the similarities are divided: ``numpy.float32(0.05)`` repeats
            ``0.05``); any other value conflicts and is an error.

    Returns:
        A :class:`Matching`.

    Raises:
        ValueError: an unknown shorthand (the known ones are listed), a ``temperature`` or
            ``sinkhorn_iterations`` that conflicts with the object's, or out of range.
        TypeError: ``matching`` that is neither a string nor a :class:`Matching`, or a
            ``temperature`` / ``sinkhorn_iterations`` of the wrong type.

    >>> resolve_matching("sinkhorn", temperature=0.2, sinkhorn_iterations=3)
    Sinkhorn(temperature=0.2, iterations=3)
    >>> resolve_matching(Softmax(temperature=0.05))
    Softmax(temperature=0.05)
    """
    if temperature is not None:
        temperature = check_temperature(temperature, smallest=SMALLEST_TEMPERATURE)
    if sinkhorn_iterations is not None:
        sinkhorn_iterations = check_iterations(sinkhorn_iterations, "sinkhorn_iterations")
    if isinstance(matching, Matching):
        for keyword, value, attribute in (
            ("temperature", temperature, "temperature"),
            ("sinkhorn_iterations", sinkhorn_iterations, "iterations"),
        ):
            own = getattr(matching, attribute, _MISSING)
            if value is not None and not _same_setting(own, value):
                has = f"no {attribute}" if own is _MISSING else f"{attribute}={own!r}"
                raise ValueError(
                    f"{keyword}={value!r} conflicts with matching={matching!r}, which has "
                    f"{has}; set the parameters on the matching object only"
                )
        return matching
    if not isinstance(matching, str):
        raise TypeError(
            "matching must be a string shorthand or a bsloss.functional.Matching, got "
            f"{type(matching).__name__} {matching!r}"
        )
    try:
        cls = SHORTHANDS[matching]
    except KeyError:
        raise ValueError(
            f"matching must be one of {sorted(SHORTHANDS)}, got {matching!r}"
        ) from None
    return cls.from_shorthand(temperature=temperature, iterations=sinkhorn_iterations)
