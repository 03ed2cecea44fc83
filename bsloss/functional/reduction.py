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

__all__ = ["weighted_mean", "mean_or_zero", "f_measure", "best_over_references"]


def weighted_mean(token_scores: Tensor, weights: Tensor) -> Tensor:
    """``sum_i w_i x_i / sum_i w_i`` over the last axis; 0 where the weights sum to 0.

    ``weights`` must be 0 on padded slots (and on any token that should not count), one per
    score: ``[B, 1]`` weights broadcast into a sum, not a mean (audit h28).
    """
    if tuple(weights.shape) != tuple(token_scores.shape):
        raise ValueError(
            f"weights must have the shape of token_scores, {list(token_scores.shape)}, got "
            f"{list(weights.shape)}"
        )
    weights = weights.to(token_scores.dtype)
    total = weights.sum(dim=-1)
    return mean_or_zero((token_scores * weights).sum(dim=-1), total, total == 0)


def mean_or_zero(weighted_sum: Tensor, total: Tensor, zero: Tensor) -> Tensor:
    """``weighted_sum / total``, and 0 with a zero gradient where ``zero`` is set (there
    ``total`` may be 0).

    >>> import torch
    >>> total = torch.tensor([2.0, 0.0])
    >>> mean_or_zero(torch.tensor([1.0, 2.0]), total, total == 0)
    tensor([0.5000, 0.0000])
    """
    # The double where keeps the gradient finite: 0/0 is never evaluated on the differentiated
    # path. Python scalars, not zeros_like/ones_like: no tensor (no kernel launch) for them.
    return torch.where(zero, 0.0, weighted_sum / torch.where(zero, 1.0, total))


def f_measure(precision: Tensor, recall: Tensor, bounded: bool = False) -> Tensor:
    """Harmonic mean ``2PR / (P + R)``; 0 where ``P + R == 0`` (as bert_score sets NaN to 0).

    ``bounded``: the harmonic mean where ``P > 0`` and ``R > 0``, else ``min(P, R)``. The
    harmonic mean has a pole at ``P = -R`` (``P = -0.0071, R = 0.0071``: F = 11,609), which the
    soft matchings reach (near-uniform candidates give them negative P or R); the bounded F is
    continuous (the harmonic mean tends to 0 as P or R does), stays in ``[min, max]`` of P and
    R, and keeps a gradient there. bert_score's F where both are positive: the loss uses it.

    >>> import torch
    >>> p, r = torch.tensor([0.2, -0.0071]), torch.tensor([0.6, 0.0071])
    >>> f_measure(p, r, bounded=True)
    tensor([ 0.3000, -0.0071])
    """
    if not bounded:
        denominator = precision + recall
        return mean_or_zero(2 * precision * recall, denominator, denominator == 0)
    # min(P, R) by a where: torch.minimum's backward costs four operations more (each a kernel
    # launch on a card; forward and backward here 23, the unbounded form's 16)
    smaller = torch.where(precision < recall, precision, recall)
    positive = smaller > 0
    # the denominator is 1 where the harmonic mean is not taken: P + R may be 0 there, and
    # 0/0 on the masked branch would still make its gradient NaN
    harmonic = 2 * precision * recall / torch.where(positive, precision + recall, 1.0)
    return torch.where(positive, harmonic, smaller)


def _check_owners(
    scores: Tensor, owner: Tensor, num_candidates: int, ignore: Tensor | None
) -> None:
    """:func:`best_over_references`' inputs, named, before a scatter fails inside torch (on a
    GPU: a device-side assert, which ends the process's CUDA context)."""
    for value, name in ((scores, "scores"), (owner, "owner"), (ignore, "ignore")):
        if value is not None and not isinstance(value, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if isinstance(num_candidates, bool) or not isinstance(num_candidates, int):
        raise TypeError(f"num_candidates must be an int, got {type(num_candidates).__name__}")
    if scores.dim() not in (1, 2):
        raise ValueError(f"scores must be [N] or [N, K], got shape {tuple(scores.shape)}")
    pairs = scores.shape[0]
    if owner.dtype.is_floating_point or owner.dtype.is_complex or owner.dtype == torch.bool:
        raise TypeError(f"owner must hold integer candidate indices, got {owner.dtype}")
    if owner.shape != (pairs,):
        raise ValueError(
            f"owner must be [N] = [{pairs}] (one candidate per row of scores), got shape "
            f"{tuple(owner.shape)}"
        )
    if ignore is not None and (ignore.dtype != torch.bool or ignore.shape != (pairs,)):
        raise ValueError(
            f"ignore must be a bool [N] = [{pairs}] tensor, got {ignore.dtype} of shape "
            f"{tuple(ignore.shape)}"
        )
    if owner.device.type == "cpu" and pairs:
        low, high = int(owner.min()), int(owner.max())
        if low < 0 or high >= num_candidates:
            bad = low if low < 0 else high
            raise ValueError(
                f"owner holds candidate {bad}, outside [0, num_candidates) = [0, {num_candidates})"
            )


def best_over_references(
    scores: Tensor, owner: Tensor, num_candidates: int, ignore: Tensor | None = None
) -> Tensor:
    """The best score of each candidate over its references, column by column (bert_score's
    rule for several references: the max of P, of R and of F, each on its own).

    Args:
        scores: ``[N]`` or ``[N, K]``, one row per (candidate, reference) pair.
        owner: ``[N]`` int64, the candidate of each pair.
        num_candidates: ``n``, the number of candidates.
        ignore: ``[N]`` bool, pairs that do not compete (an empty candidate or reference).

    Returns:
        ``[n]`` or ``[n, K]``: the values of the first best pair (the gradient flows to it
        alone); 0 for a candidate with no competing pair; NaN for one with a NaN among its
        competing pairs' scores (as a max propagates it; an ignored pair's NaN does not count).

    Raises:
        TypeError: ``scores``, ``owner`` or ``ignore`` is not a tensor, or of the wrong kind
            (named); ``num_candidates`` is not an integer.
        ValueError: their shapes disagree, or (for an ``owner`` on the CPU, where reading it
            costs no wait for a device) an owner outside ``[0, num_candidates)``.

    >>> import torch
    >>> best_over_references(torch.tensor([0.2, 0.7, 0.5]), torch.tensor([0, 0, 1]), 2)
    tensor([0.7000, 0.5000])
    """
    _check_owners(scores, owner, num_candidates, ignore)
    return best_of_owned(scores, owner, num_candidates, ignore)


def best_of_owned(
    scores: Tensor, owner: Tensor, num_candidates: int, ignore: Tensor | None = None
) -> Tensor:
    """:func:`best_over_references` without its checks, for the loss and the metric, which
    build ``owner`` themselves: the owners' range check reads them, and on a GPU a read waits
    for the card."""
    values = scores[:, None] if scores.dim() == 1 else scores
    pairs, width = values.shape
    competing = values.detach()
    if ignore is not None:
        competing = competing.masked_fill(ignore[:, None], float("-inf"))
    index = owner.to(values.device)[:, None].expand(-1, width)
    best = torch.full((num_candidates, width), float("-inf"), device=values.device)
    best = best.to(values.dtype).scatter_reduce(0, index, competing, "amax")
    is_best = (competing == best.gather(0, index)) & torch.isfinite(competing)
    position = torch.arange(pairs, device=values.device)[:, None].expand(-1, width)
    first = torch.full((num_candidates, width), pairs, device=values.device)
    first = first.scatter_reduce(0, index, torch.where(is_best, position, pairs), "amin")
    # row ``pairs`` of the padded scores is 0: a candidate with no competing pair
    chosen = torch.cat([values, values.new_zeros(1, width)]).gather(0, first)
    # a NaN never equals the best, so it would fall through to the 0 of "no pair": flag it
    # on the device (no read) and give it back, as a max over the scores would
    poisoned = torch.zeros(num_candidates, width, device=values.device)
    poisoned = poisoned.scatter_reduce(0, index, torch.isnan(competing).float(), "amax")
    chosen = torch.where(poisoned > 0, float("nan"), chosen)
    return chosen[:, 0] if scores.dim() == 1 else chosen
