r"""Cosine similarity between the tokens of two sentences.

BERTScore (Zhang et al., 2020, Eq. 1-3) compares pre-normalised token vectors, so the inner product
is the cosine similarity

.. math::  s_{ij} = \frac{x_i^\top \hat x_j}{\lVert x_i\rVert\,\lVert \hat x_j\rVert}.

Everything here runs in at least float32, whatever autocast says: similarities feed maxima,
softmaxes and sums whose error in bf16 (8 bits of mantissa) is larger than the differences between
candidates.
"""

from __future__ import annotations

import torch
from einops import einsum
from torch import Tensor

__all__ = ["math_dtype", "l2_normalize", "cosine_similarity"]


def math_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype the matching math runs in: float32, or float64 when an input is float64."""
    dtype = torch.float32
    for tensor in tensors:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def l2_normalize(embeddings: Tensor, eps: float = 1e-12) -> Tensor:
    """Unit-norm token vectors along the last axis, computed in ``math_dtype``.

    A zero vector (a padded slot) stays zero instead of becoming NaN.
    """
    embeddings = embeddings.to(math_dtype(embeddings))
    return torch.nn.functional.normalize(embeddings, p=2.0, dim=-1, eps=eps)


def cosine_similarity(candidates: Tensor, references: Tensor, normalized: bool = False) -> Tensor:
    """Token-pair cosine similarities ``[B, Lc, d] x [B, Lr, d] -> [B, Lc, Lr]``.

    Args:
        candidates: candidate token embeddings ``[B, Lc, d]``.
        references: reference token embeddings ``[B, Lr, d]``.
        normalized: set when both inputs are already unit-norm, to skip the normalisation.
    """
    if not normalized:
        candidates, references = l2_normalize(candidates), l2_normalize(references)
    dtype = math_dtype(candidates, references)
    with torch.autocast(device_type=candidates.device.type, enabled=False):
        return einsum(candidates.to(dtype), references.to(dtype), "b i d, b j d -> b i j")
