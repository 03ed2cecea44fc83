"""Masks over token pairs, and the padded-cell convention used by every matching.

Padded cells must never take part in a max, softmax or logsumexp: they are excluded, not
multiplied by zero (bert_score's ``sim * mask`` clamps a token's maximum at 0 whenever its partner
is shorter than the longest sentence of the batch).
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["pair_mask", "check_mask"]


def pair_mask(candidate_mask: Tensor, reference_mask: Tensor) -> Tensor:
    """``[B, Lc]`` and ``[B, Lr]`` boolean masks -> ``[B, Lc, Lr]``: both tokens are real."""
    return candidate_mask.bool()[:, :, None] & reference_mask.bool()[:, None, :]


def check_mask(mask: Tensor, like: Tensor, name: str, embeddings_name: str) -> Tensor:
    """Validate that ``mask`` is ``[B, L]`` for embeddings ``like`` of shape ``[B, L, d]``."""
    if mask.dim() != 2 or tuple(mask.shape) != tuple(like.shape[:2]):
        raise ValueError(
            f"{name} must have shape [B, L] = {list(like.shape[:2])} to match {embeddings_name}, "
            f"got {list(mask.shape)}"
        )
    return mask.bool()
