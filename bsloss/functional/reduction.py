r"""From per-token scores to sentence scores: weighted means and the F-measure.

BERTScore (Zhang et al., 2020, Eq. 3-4, importance weighting in Eq. 5):

.. math::
    P = \frac{\sum_{i} w_i\, p_i}{\sum_i w_i}, \qquad
    R = \frac{\sum_{j} \hat w_j\, r_j}{\sum_j \hat w_j}, \qquad
    F = \frac{2 P R}{P + R}.

A sentence whose weights sum to zero (an empty sentence: only special tokens, which weigh 0) gets
the score 0 and a zero gradient, never NaN; so does an F whose ``P + R`` is 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["weighted_mean", "f_measure"]


def weighted_mean(token_scores: Tensor, weights: Tensor) -> Tensor:
    """``sum_i w_i x_i / sum_i w_i`` over the last axis; 0 where the weights sum to 0.

    ``weights`` must be 0 on padded slots (and on any token that should not count).
    """
    weights = weights.to(token_scores.dtype)
    total = weights.sum(dim=-1)
    empty = total == 0
    # The double where keeps the gradient finite: 0/0 is never evaluated on the differentiated path.
    safe_total = torch.where(empty, torch.ones_like(total), total)
    mean = (token_scores * weights).sum(dim=-1) / safe_total
    return torch.where(empty, torch.zeros_like(mean), mean)


def f_measure(precision: Tensor, recall: Tensor) -> Tensor:
    """Harmonic mean ``2PR / (P + R)``; 0 where ``P + R == 0`` (as bert_score sets NaN to 0)."""
    denominator = precision + recall
    degenerate = denominator == 0
    safe = torch.where(degenerate, torch.ones_like(denominator), denominator)
    f = 2 * precision * recall / safe
    return torch.where(degenerate, torch.zeros_like(f), f)
