r"""Cosine similarity between the tokens of two sentences.

BERTScore (Zhang et al., 2020, Eq. 1-3) compares pre-normalised token vectors, so the inner product
is the cosine similarity

.. math::  s_{ij} = \frac{x_i^\top \hat x_j}{\lVert x_i\rVert\,\lVert \hat x_j\rVert}.

Everything here runs in at least float32, whatever autocast says: similarities feed maxima,
softmaxes and sums whose error in bf16 (8 bits of mantissa) is larger than the differences between
candidates.
"""

from __future__ import annotations

import math

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


# the least norm of a nonzero vector after l2_normalize's scaling is far above it: the clamp
# only keeps 0 / 0 from a zero vector
_ZERO_NORM = 1e-30


def l2_normalize(embeddings: Tensor) -> Tensor:
    """Unit-norm token vectors along the last axis, computed in ``math_dtype``.

    A zero vector (a padded slot, a state zeroed by a mask) stays zero instead of becoming NaN,
    and its gradient is the upstream gradient (``normalize``'s ``eps`` clamp made it upstream /
    1e-12). The norm is scale-safe: each vector is first multiplied by the power of two that
    brings its largest entry into ``[0.5, 1)``, so its sum of squares neither overflows
    (entries near 1e20 in float32) nor underflows (entries near 1e-20). A power-of-two scaling
    is exact, so for ordinary vectors the result is bit-identical to normalising them as they
    are; the scale is constant for the gradient, which is that of the unit vector itself.
    """
    embeddings = embeddings.to(math_dtype(embeddings))
    with torch.no_grad():
        _, exponent = torch.frexp(embeddings.abs().amax(dim=-1, keepdim=True))
        # 2**-exponent stays a finite normal number (subnormal vectors scale in one step too)
        limit = math.frexp(torch.finfo(embeddings.dtype).max)[1] - 2
        scale = torch.ldexp(
            torch.ones_like(exponent, dtype=embeddings.dtype), -exponent.clamp(-limit, limit)
        )
    scaled = embeddings * scale
    norm = torch.linalg.vector_norm(scaled, dim=-1, keepdim=True)
    if not scaled.requires_grad:  # the values alone (the metric, references): one launch less
        return scaled / norm.clamp_min(_ZERO_NORM)
    # a zero vector divides by 1: it stays 0 and passes the upstream gradient on. A clamp of
    # the norm at a tiny eps divided it by eps, a gradient of upstream / eps (normalize's
    # 1e-12: inf in float16, NaN behind a mask multiply); every other norm is >= 0.5 here but
    # a subnormal vector's (scaled by at most 2**126), so no clamp is both exact and mild
    return scaled / torch.where(norm == 0, 1.0, norm)


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
