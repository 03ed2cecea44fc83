r"""From a generator's output distributions to scorer input embeddings.

The expected input embedding of candidate position :math:`t` is

.. math::  e_t = \sum_v p_t(v)\, E[v]

with :math:`E` the scorer's token-embedding table (or the vocabulary bridge's table when the
generator's tokenizer differs). It is differentiable in :math:`p_t`, so the generator receives a
gradient through the frozen scorer. Options:

- ``top_k``: keep the :math:`k` most probable tokens, renormalise, and gather :math:`k` rows of
  :math:`E` instead of a dense :math:`V \times d` product;
- ``straight_through``: the forward pass uses the argmax one-hot (the loss value is exactly the
  BERTScore of the decoded tokens), the backward pass the gradient of the probabilities;
- ``gumbel_temperature``: Gumbel-softmax samples (Jang et al., 2017) instead of the probabilities.

Probabilities are computed in float32 whatever the caller's autocast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import einsum
from torch import Tensor

__all__ = ["TokenDistribution", "token_distribution", "expected_embeddings", "expected_weights"]


@dataclass
class TokenDistribution:
    """Weights over token ids: dense ``[B, L, V]`` (``indices is None``) or sparse ``[B, L, k]``
    with ``indices [B, L, k]``."""

    weights: Tensor
    indices: Tensor | None = None


def _check_finite(tensor: Tensor, name: str) -> None:
    if not torch.isfinite(tensor).all():
        bad = (~torch.isfinite(tensor)).nonzero()[0].tolist()
        raise ValueError(f"{name} contains NaN or Inf (first at position {bad})")


def token_distribution(
    logits: Tensor | None = None,
    probs: Tensor | None = None,
    *,
    top_k: int | None = None,
    straight_through: bool = False,
    gumbel_temperature: float | None = None,
) -> TokenDistribution:
    """Normalised token weights from ``logits`` or ``probs`` ``[B, L, V]``."""
    if (logits is None) == (probs is None):
        raise ValueError("pass exactly one of logits or probs")
    source, name = (logits, "logits") if logits is not None else (probs, "probs")
    if source.dim() != 3:
        raise ValueError(f"{name} must be [B, L, V], got shape {list(source.shape)}")
    _check_finite(source, name)
    with torch.autocast(device_type=source.device.type, enabled=False):
        if logits is not None:
            logits = logits.float() if logits.dtype != torch.float64 else logits
            if gumbel_temperature is not None:
                if not gumbel_temperature > 0:
                    raise ValueError(f"gumbel_temperature must be > 0, got {gumbel_temperature}")
                gumbels = -torch.empty_like(logits).exponential_().log()
                p = torch.softmax((logits + gumbels) / gumbel_temperature, dim=-1)
            else:
                p = torch.softmax(logits, dim=-1)
        else:
            p = probs.float() if probs.dtype != torch.float64 else probs
            if gumbel_temperature is not None:
                raise ValueError("gumbel_temperature needs logits, not probs")
            if (p < 0).any():
                raise ValueError("probs must be non-negative")
            p = p / p.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
        indices = None
        if top_k is not None:
            if not 1 <= top_k <= p.shape[-1]:
                raise ValueError(f"top_k must be in [1, {p.shape[-1]}], got {top_k}")
            p, indices = p.topk(top_k, dim=-1)
            p = p / p.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
        if straight_through:
            hard = torch.zeros_like(p).scatter_(-1, p.argmax(dim=-1, keepdim=True), 1.0)
            p = hard + p - p.detach()
    return TokenDistribution(p, indices)


def expected_embeddings(distribution: TokenDistribution, table: Tensor) -> Tensor:
    """``sum_v p(v) E[v]``: ``[B, L, d]`` from token weights and an embedding table ``[V, d]``."""
    weights = distribution.weights.to(table.dtype)
    if distribution.indices is None:
        return einsum(weights, table, "b l v, v d -> b l d")
    rows = table[distribution.indices]  # [B, L, k, d]: k gathered rows instead of all V
    return einsum(weights, rows, "b l k, b l k d -> b l d")


def expected_weights(distribution: TokenDistribution, token_weights: Tensor) -> Tensor:
    """Expected importance weight ``sum_v p(v) w[v]`` ``[B, L]``.

    Differentiable, so the gradient is that of the score as computed (probability moved onto a
    special token, which weighs 0, lowers that position's weight)."""
    weights = distribution.weights
    token_weights = token_weights.to(weights.dtype)
    if distribution.indices is None:
        return einsum(weights, token_weights, "b l v, v -> b l")
    return (weights * token_weights[distribution.indices]).sum(dim=-1)
