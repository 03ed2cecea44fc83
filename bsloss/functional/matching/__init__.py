"""Token matchings: each turns similarities ``[B, Lc, Lr]`` into per-token scores in both
directions, ``(candidate [B, Lc], reference [B, Lr])``. One file per matching."""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import Tensor

from bsloss.functional.matching.hard import hard_match
from bsloss.functional.matching.logsumexp import logsumexp_match
from bsloss.functional.matching.sinkhorn import sinkhorn_match
from bsloss.functional.matching.softmax import softmax_match

__all__ = [
    "MATCHINGS",
    "get_matching",
    "check_temperature",
    "hard_match",
    "softmax_match",
    "logsumexp_match",
    "sinkhorn_match",
]

Matching = Callable[..., tuple[Tensor, Tensor]]

MATCHINGS: dict[str, Matching] = {
    "hard": hard_match,
    "softmax": softmax_match,
    "logsumexp": logsumexp_match,
    "sinkhorn": sinkhorn_match,
}


def get_matching(name: str) -> Matching:
    try:
        return MATCHINGS[name]
    except KeyError:
        raise ValueError(f"matching must be one of {sorted(MATCHINGS)}, got {name!r}") from None


def check_temperature(temperature: float, name: str = "temperature") -> float:
    """A temperature must be a finite number > 0."""
    try:
        value = float(temperature)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {temperature!r}") from None
    if isinstance(temperature, bool):
        raise TypeError(f"{name} must be a number, got {temperature!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {temperature!r}")
    return value
