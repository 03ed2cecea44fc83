"""Masks over token pairs, and the padded-cell convention used by every matching.

Padded cells must never take part in a max, softmax or logsumexp: they are excluded, not
multiplied by zero (bert_score's ``sim * mask`` clamps a token's maximum at 0 whenever its partner
is shorter than the longest sentence of the batch).
"""

from __future__ import annotations

import torch
from torch import Tensor

from bsloss.inputs import check_tensor

__all__ = ["pair_mask", "check_mask", "masked_logits", "where_partnered"]


def pair_mask(candidate_mask: Tensor, reference_mask: Tensor) -> Tensor:
    """``[B, Lc]`` and ``[B, Lr]`` boolean masks -> ``[B, Lc, Lr]``: both tokens are real."""
    return candidate_mask.bool()[:, :, None] & reference_mask.bool()[:, None, :]


def check_mask(mask: Tensor, like: Tensor, name: str, embeddings_name: str) -> Tensor:
    """Validate that ``mask`` is a ``[B, L]`` bool or integer tensor for embeddings ``like`` of
    shape ``[B, L, d]`` (a float mask is refused: ``.bool()`` would read 0.5 as true)."""
    check_tensor(mask, name, "mask")
    if mask.dim() != 2 or tuple(mask.shape) != tuple(like.shape[:2]):
        raise ValueError(
            f"{name} must have shape [B, L] = {list(like.shape[:2])} to match {embeddings_name}, "
            f"got {list(mask.shape)}"
        )
    return mask.bool()


def masked_logits(logits: Tensor, valid: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """``logits`` with padded cells at ``-inf`` along ``dim``, and which rows have a real cell.

    A row without any real cell (an empty partner sentence) gets finite dummy logits so that a
    softmax or logsumexp over it stays defined; :func:`where_partnered` then zeroes its score.
    """
    has_partner = valid.any(dim=dim, keepdim=True)
    # where, not masked_fill of the negated masks: two operations fewer (each a kernel launch)
    logits = torch.where(has_partner, torch.where(valid, logits, float("-inf")), 0.0)
    return logits, has_partner


def where_partnered(score: Tensor, has_partner: Tensor, dim: int) -> Tensor:
    """``score`` where the row had a real cell, else 0 (with zero gradient)."""
    return torch.where(has_partner.squeeze(dim), score, 0.0)
