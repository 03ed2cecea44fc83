r"""BERTScore from token embeddings: similarity, matching, weighted means, F.

.. math::
    P = \frac{\sum_i w_i\, m(s)_{i\cdot}}{\sum_i w_i},\quad
    R = \frac{\sum_j \hat w_j\, m(s)_{\cdot j}}{\sum_j \hat w_j},\quad F = \frac{2PR}{P+R}

with :math:`s` the cosine similarities (Zhang et al., 2020, Eq. 1-5) and :math:`m` a matching
(:class:`~bsloss.functional.Hard`: the original greedy max; ``Softmax``, ``LogSumExp``,
``Sinkhorn``: tempered; or their string shorthands). This is the one implementation of the math:
:class:`bsloss.BERTScorer` (evaluation) and :class:`bsloss.BERTScoreLoss` (training) both call it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from bsloss.functional.masking import check_mask
from bsloss.functional.matching import Matching, resolve_matching
from bsloss.functional.reduction import f_measure, mean_or_zero
from bsloss.functional.similarity import cosine_similarity, math_dtype
from bsloss.inputs import check_tensor

__all__ = ["PRF", "bert_score", "token_scores"]


class PRF(NamedTuple):
    """Per-sentence precision, recall and F1, each ``[B]``."""

    precision: Tensor
    recall: Tensor
    f1: Tensor


def token_scores(
    candidates: Tensor,
    references: Tensor,
    candidate_mask: Tensor,
    reference_mask: Tensor,
    *,
    matching: str | Matching = "hard",
    temperature: float | None = None,
    sinkhorn_iterations: int | None = None,
    normalized: bool = False,
) -> tuple[Tensor, Tensor]:
    """Per-token scores ``(candidate [B, Lc], reference [B, Lr])`` of the chosen matching
    (``matching``, ``temperature``, ``sinkhorn_iterations`` as in :func:`bert_score`); the
    embeddings and masks are checked as :func:`bert_score` checks them (a ``[B, 1]`` mask
    broadcast silently, a float one was read as true where not 0, audit h28)."""
    match = resolve_matching(matching, temperature, sinkhorn_iterations)
    _check_embeddings(candidates, references)
    candidate_mask = check_mask(candidate_mask, candidates, "candidate_mask", "candidates")
    reference_mask = check_mask(reference_mask, references, "reference_mask", "references")
    return _token_scores(candidates, references, candidate_mask, reference_mask, match, normalized)


def _token_scores(
    candidates: Tensor,
    references: Tensor,
    candidate_mask: Tensor,
    reference_mask: Tensor,
    match: Matching,
    normalized: bool,
) -> tuple[Tensor, Tensor]:
    """:func:`token_scores` of inputs already checked."""
    sim = cosine_similarity(candidates, references, normalized=normalized)
    with torch.autocast(device_type=sim.device.type, enabled=False):
        scores = match(sim, candidate_mask, reference_mask)
    _check_scores(match, scores, sim.shape)
    return scores


def _check_embeddings(candidates: Tensor, references: Tensor) -> None:
    """``[B, L, d]`` float embeddings of one B and one d; type and shape checks only, no value
    checks: those would read the device (see :func:`bert_score`'s Returns)."""
    check_tensor(candidates, "candidates", "float")
    check_tensor(references, "references", "float")
    if candidates.dim() != 3 or references.dim() != 3:
        raise ValueError(
            "candidates and references must be [B, L, d] embeddings, got shapes "
            f"{list(candidates.shape)} and {list(references.shape)}"
        )
    if candidates.shape[0] != references.shape[0] or candidates.shape[2] != references.shape[2]:
        raise ValueError(
            f"candidates {list(candidates.shape)} and references {list(references.shape)} must "
            "agree on the batch size B and the embedding size d"
        )


def _check_scores(match: Matching, scores: object, shape: torch.Size) -> None:
    """A matching (a user's subclass among them) must return one score per token of each side:
    a scalar or a wrong shape would broadcast into a wrong P/R, or fail deep in the means."""
    batch, cand_len, ref_len = shape
    wanted = ((batch, cand_len), (batch, ref_len))
    if (
        isinstance(scores, tuple)
        and len(scores) == 2
        and all(isinstance(t, Tensor) for t in scores)
        and tuple(tuple(t.shape) for t in scores) == wanted
    ):
        return
    if isinstance(scores, tuple) and all(isinstance(t, Tensor) for t in scores):
        got = "(" + ", ".join(str(list(t.shape)) for t in scores) + ")"
    else:
        got = type(scores).__name__
    raise ValueError(
        f"the matching {match!r} returned {got}; a Matching returns a tuple (candidate scores "
        f"[B, Lc], reference scores [B, Lr]), here ({list(wanted[0])}, {list(wanted[1])}) for "
        f"similarities [B, Lc, Lr] = {list(shape)}"
    )


def _prf(
    candidates,
    references,
    candidate_mask,
    reference_mask,
    candidate_weights,
    reference_weights,
    matching: Matching,
    normalized: bool,
    bounded_f: bool = False,
) -> PRF:
    cand_scores, ref_scores = _token_scores(
        candidates, references, candidate_mask, reference_mask, matching, normalized
    )
    # weighted means (reduction.weighted_mean) whose totals also say which pairs are empty
    cand_weights = candidate_weights.to(cand_scores.dtype)
    ref_weights = reference_weights.to(ref_scores.dtype)
    cand_total, ref_total = cand_weights.sum(dim=-1), ref_weights.sum(dim=-1)
    # As bert_score: a pair with an empty side (no weight: only special tokens) scores 0.
    empty = (cand_total == 0) | (ref_total == 0)
    precision = mean_or_zero((cand_scores * cand_weights).sum(dim=-1), cand_total, empty)
    recall = mean_or_zero((ref_scores * ref_weights).sum(dim=-1), ref_total, empty)
    return PRF(precision, recall, f_measure(precision, recall, bounded=bounded_f))


def _self_normalized(pair: PRF, cand_self: PRF, ref_self: PRF) -> PRF:
    """Chen et al. (2020) Eq. 6: ``C(x, y) / sqrt(C(x, x) C(y, y))`` for each of P, R, F."""

    def divide(value: Tensor, a: Tensor, b: Tensor) -> Tensor:
        scale = torch.sqrt((a * b).clamp_min(torch.finfo(value.dtype).tiny))
        return value / scale

    return PRF(*(divide(v, a, b) for v, a, b in zip(pair, cand_self, ref_self, strict=True)))


def bert_score(
    candidates: Tensor,
    references: Tensor,
    candidate_mask: Tensor | None = None,
    reference_mask: Tensor | None = None,
    candidate_weights: Tensor | None = None,
    reference_weights: Tensor | None = None,
    *,
    matching: str | Matching = "hard",
    temperature: float | None = None,
    sinkhorn_iterations: int | None = None,
    self_normalize: bool | None = None,
    normalized: bool = False,
    bounded_f: bool = False,
) -> PRF:
    """Per-pair BERTScore from token embeddings.

    Args:
        candidates: ``[B, Lc, d]`` candidate token embeddings (any float dtype).
        references: ``[B, Lr, d]`` reference token embeddings.
        candidate_mask, reference_mask: ``[B, L]``, true on real tokens (default: all real).
            Real tokens are matchable; padded ones never enter a max, softmax or logsumexp.
        candidate_weights, reference_weights: ``[B, L]`` importance weights (idf; 0 on
            CLS/SEP). Default: uniform over the real tokens.
        matching: a :class:`~bsloss.functional.Matching` object (``Hard()``,
            ``Softmax(temperature=0.05)``, ``LogSumExp(...)``, ``Sinkhorn(temperature=0.1,
            iterations=1)`` or your own subclass) or a string shorthand ``"hard"``,
            ``"softmax"``, ``"logsumexp"`` or ``"sinkhorn"``.
        temperature: with a shorthand, ``T > 0`` of the tempered matchings (default 0.05).
            With an object: leave it out (or repeat the object's value).
        sinkhorn_iterations: with a shorthand, Sinkhorn steps (default 1, as in Chen et al.).
            With an object: as ``temperature``.
        self_normalize: divide by the self-similarities (Chen et al. Eq. 6); default: the
            matching's ``self_normalizes`` (on for Sinkhorn only).
        normalized: the embeddings are already unit-norm.
        bounded_f: F is :func:`~bsloss.functional.f_measure`'s bounded form: bert_score's
            harmonic mean where P and R are both positive, else ``min(P, R)`` (no pole at
            ``P = -R``, which the soft matchings can reach; the loss's F).

    Returns:
        :class:`PRF` of ``[B]`` tensors in float32 (float64 for float64 inputs). A pair in which
        either sentence has no weight (empty: only special tokens, or a side of length 0)
        scores 0 with zero gradient.

        No value is checked (that would read the device on every call): NaN or Inf in the
        embeddings gives NaN out, and the weights are taken to be finite and ``>= 0``
        (:class:`~bsloss.BERTScoreLoss` and :class:`~bsloss.BERTScorer` check theirs).

    Raises:
        ValueError, TypeError: inputs of the wrong shape or type (named): embeddings that are
            not floating-point tensors, masks that are not bool or integer tensors, weights
            that are not tensors; an unknown shorthand, a matching parameter out of range, or
            one that conflicts with a matching object.

    >>> import torch
    >>> from bsloss.functional import Sinkhorn, bert_score
    >>> cand, ref = torch.randn(2, 5, 8), torch.randn(2, 4, 8)
    >>> bert_score(cand, ref, matching=Sinkhorn(temperature=0.1, iterations=2)).f1.shape
    torch.Size([2])
    """
    match = resolve_matching(matching, temperature, sinkhorn_iterations)
    _check_embeddings(candidates, references)
    dtype = math_dtype(candidates, references)
    if candidate_mask is None:
        candidate_mask = torch.ones(
            candidates.shape[:2], dtype=torch.bool, device=candidates.device
        )
    if reference_mask is None:
        reference_mask = torch.ones(
            references.shape[:2], dtype=torch.bool, device=references.device
        )
    candidate_mask = check_mask(candidate_mask, candidates, "candidate_mask", "candidates")
    reference_mask = check_mask(reference_mask, references, "reference_mask", "references")
    candidate_weights = _weights(candidate_weights, candidate_mask, "candidate_weights", dtype)
    reference_weights = _weights(reference_weights, reference_mask, "reference_weights", dtype)

    options = dict(matching=match, normalized=normalized, bounded_f=bounded_f)
    pair = _prf(
        candidates,
        references,
        candidate_mask,
        reference_mask,
        candidate_weights,
        reference_weights,
        **options,
    )
    if self_normalize is None:
        self_normalize = match.self_normalizes
    if not self_normalize:
        return pair
    cand_self = _prf(
        candidates,
        candidates,
        candidate_mask,
        candidate_mask,
        candidate_weights,
        candidate_weights,
        **options,
    )
    ref_self = _prf(
        references,
        references,
        reference_mask,
        reference_mask,
        reference_weights,
        reference_weights,
        **options,
    )
    return _self_normalized(pair, cand_self, ref_self)


def _weights(weights: Tensor | None, mask: Tensor, name: str, dtype: torch.dtype) -> Tensor:
    if weights is None:
        return mask.to(dtype)
    if not isinstance(weights, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(weights).__name__}")
    if weights.dtype == torch.bool or weights.is_complex():
        raise TypeError(f"{name} must have a floating or integer dtype, got {weights.dtype}")
    if tuple(weights.shape) != tuple(mask.shape):
        raise ValueError(f"{name} must have shape {list(mask.shape)}, got {list(weights.shape)}")
    return torch.where(mask.bool(), weights.to(dtype), 0.0)
