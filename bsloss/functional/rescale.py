r"""Baseline rescaling (Zhang et al., 2020, Sec. 3, "Baseline Rescaling").

.. math::  \hat x = \frac{x - b}{1 - b}

with :math:`b` the mean score of random, unrelated sentence pairs for the same model and layer.
Monotone, so it changes no ranking and no correlation; it spreads the scores of models whose
cosines are compressed near 1.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["rescale_with_baseline"]


def rescale_with_baseline(score: Tensor, baseline: float | Tensor) -> Tensor:
    """``(score - b) / (1 - b)``; ``b`` must be below 1."""
    return (score - baseline) / (1 - baseline)
