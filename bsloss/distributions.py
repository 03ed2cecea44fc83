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
- ``gumbel_temperature``: Gumbel-softmax samples (Jang et al., 2017) instead of the probabilities,
  with the position-addressed noise of :mod:`bsloss.functional.gumbel_noise`.

Probabilities are computed in float32 whatever the caller's autocast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
from einops import einsum
from torch import Tensor

from bsloss.candidate_transforms import CandidateOptions, candidate_weights
from bsloss.functional.gumbel_noise import check_seed, draw_seed, gumbel_scores
from bsloss.inputs import position_of_first

__all__ = [
    "TokenDistribution",
    "token_distribution",
    "expected_embeddings",
    "expected_inputs",
    "augment_table",
    "all_true",
    "check_finite_tensor",
    "most_probable_tokens",
    "select_positions",
]


@dataclass
class TokenDistribution:
    """Weights over token ids: dense ``[B, L, V]`` (``indices is None``) or sparse ``[B, L, k]``
    with ``indices [B, L, k]``. The plain dense softmax of logits is kept implicit
    (``weights is None``, ``logits`` set) so that it is fused with the table product and never
    stored for the backward pass."""

    weights: Tensor | None
    indices: Tensor | None = None
    logits: Tensor | None = None


# A read of the device, so a graph break in a compiled loss wherever it is: outside Dynamo, the
# break comes without Dynamo's advice to capture scalar outputs, which would not remove the read.
@torch.compiler.disable
def check_finite_tensor(tensor: Tensor, name: str) -> None:
    """ValueError naming ``name`` and the first position of a NaN or Inf in ``tensor``."""
    # One reduction decides the common case; the elementwise scan only runs to name the culprit
    # (or when a huge finite tensor overflows the sum).
    if math.isfinite(tensor.sum().item()):  # one kernel and the read (isfinite: four more)
        return
    bad = ~torch.isfinite(tensor)
    if bad.any():
        hint = ""
        if name == "logits" and bool((tensor == -math.inf).any()):
            # -inf is how logits processors and generate(output_scores=True) mask tokens
            hint = (
                "; logits masked with -inf (a logits processor's, generate's scores) can be "
                "passed as bsloss.Probabilities(logits.softmax(-1))"
            )
        raise ValueError(
            f"{name} contains NaN or Inf (first at {name}{position_of_first(bad)}){hint}"
        )


@torch.compiler.disable
def check_probabilities(probs: Tensor, mask: Tensor | None = None, name: str = "probs") -> None:
    """ValueError naming the first position ``[b, t]`` of ``probs`` ``[B, L, V]`` with a negative
    entry, or, among the scored positions (``mask`` ``[B, L]``), whose total is below float32's
    smallest normal number or past its largest: such a row cannot be renormalised (a zero row
    would score as a zero embedding of weight 0, and a total that overflows to inf divides
    every entry to 0: an empty candidate, silently). One read of the device."""
    negative = (probs < 0).any(dim=-1)
    bad = negative
    if mask is not None:
        total = probs.sum(dim=-1)
        massless = (total < torch.finfo(torch.float32).tiny) & mask
        overflowing = torch.isinf(total) & mask
        bad = negative | massless | overflowing
    if not bad.any():
        return
    if negative.any():
        raise ValueError(
            f"{name} must be non-negative: a negative entry at {name}{position_of_first(negative)}"
        )
    if overflowing.any():
        raise ValueError(
            f"{name}{position_of_first(overflowing)} sums past the largest float "
            f"({torch.finfo(probs.dtype).max:.3g} in {probs.dtype}), so it cannot be "
            "renormalised: scale the row down (only its proportions count)"
        )
    raise ValueError(
        f"{name}{position_of_first(massless)} sums to 0 at a scored position (candidate_mask "
        "true), so it cannot be renormalised: give it probability mass, or mask it out"
    )


@torch.compiler.disable
def all_true(flags: Tensor) -> bool:
    """``bool(flags.all())``, a read of the device outside any compiled graph (as
    :func:`check_finite_tensor`)."""
    return bool(flags.all())


def _math(tensor: Tensor) -> Tensor:
    return tensor if tensor.dtype == torch.float64 else tensor.float()


def token_distribution(
    logits: Tensor | None = None,
    probs: Tensor | None = None,
    *,
    top_k: int | None = None,
    straight_through: bool = False,
    gumbel_temperature: float | None = None,
    gumbel_seed: int | Tensor | None = None,
    mask: Tensor | None = None,
) -> TokenDistribution:
    """Normalised token weights from ``logits`` or ``probs`` ``[B, L, V]``; ``mask`` ``[B, L]``:
    the scored positions, where ``probs`` must have mass (:func:`check_probabilities`).

    With ``top_k`` the top k are taken on the logits (softmax is monotone) and renormalised by a
    softmax over those k alone, which equals renormalising the top-k probabilities without ever
    computing the V-wide softmax. With ``gumbel_temperature`` the logits get the Gumbel noise of
    :func:`~bsloss.functional.gumbel_noise.gumbel_noise` for ``gumbel_seed`` (drawn from torch's
    generator when ``None``) at position ``b * L + t``: the noise the chunked LM-head pass draws
    for the same seed.
    """
    if (logits is None) == (probs is None):
        raise ValueError("pass exactly one of logits or probs")
    source, name = (logits, "logits") if logits is not None else (probs, "probs")
    if source.dim() != 3:
        raise ValueError(f"{name} must be [B, L, V], got shape {list(source.shape)}")
    options = CandidateOptions(top_k, straight_through, gumbel_temperature)
    options.check(source.shape[-1], from_logits=logits is not None)
    check_finite_tensor(source, name)
    perturb = None
    if gumbel_temperature is not None:
        seed = draw_seed() if gumbel_seed is None else check_seed(gumbel_seed)
        perturb = partial(_perturbed, temperature=gumbel_temperature, seed=seed)
    with torch.autocast(device_type=source.device.type, enabled=False):
        values = _math(source)
        if logits is not None and not options.forms_weights:
            # the plain softmax stays implicit: fused with the table product downstream
            return TokenDistribution(None, logits=values if perturb is None else perturb(values))
        if probs is not None:
            check_probabilities(values, mask, name)
        p, indices = candidate_weights(
            values, options, perturb=perturb, probabilities=probs is not None
        )
    return TokenDistribution(p, indices)


def _perturbed(scores: Tensor, temperature: float, seed: int | Tensor) -> Tensor:
    """Gumbel-softmax scores of ``scores`` ``[B, L, V]`` at flat positions ``b * L + t``, a
    block of positions at a time (the counters are int64: one ``[B, L, V]`` of them would
    double the logits' memory)."""
    batch, length, vocab = scores.shape
    perturbed = torch.empty(batch * length, vocab, dtype=scores.dtype, device=scores.device)
    tokens = torch.arange(vocab, device=scores.device)[None]
    block = max(1, (1 << 22) // max(vocab, 1))
    for start in range(0, batch * length, block):
        rows = torch.arange(start, min(start + block, batch * length), device=scores.device)
        block_scores = scores.reshape(-1, vocab)[start : start + len(rows)]
        perturbed[start : start + len(rows)] = gumbel_scores(
            block_scores, temperature, seed, rows[:, None], tokens
        )
    return perturbed.reshape(batch, length, vocab)


class _SoftmaxExpectation(torch.autograd.Function):
    """``softmax(logits) @ table`` saving only the logits: the ``[B, L, V]`` probabilities are
    recomputed in the backward pass, whose gradient is
    ``p * (g E^T - <g, e>)`` (the inner product ``<p, g E^T>`` equals ``<g, e>``)."""

    @staticmethod
    def forward(ctx, logits: Tensor, table: Tensor) -> Tensor:
        out = torch.softmax(logits, dim=-1).to(table.dtype) @ table
        ctx.save_for_backward(logits, table, out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        logits, table, out = ctx.saved_tensors
        grad_logits = grad @ table.T  # [B, L, V]
        grad_logits -= (grad * out).sum(dim=-1, keepdim=True)
        grad_logits *= torch.softmax(logits, dim=-1)
        return grad_logits.to(logits.dtype), None


def _expectation(distribution: TokenDistribution, table: Tensor) -> Tensor:
    """``sum_v p(v) table[v]`` ``[B, L, c]`` for a ``[V, c]`` table (not differentiated)."""
    table = table.detach()
    with torch.autocast(device_type=table.device.type, enabled=False):
        if distribution.weights is None:
            return _SoftmaxExpectation.apply(
                distribution.logits, table.to(distribution.logits.dtype)
            )
        weights = distribution.weights.to(table.dtype)
        if distribution.indices is None:
            return einsum(weights, table, "b l v, v c -> b l c")
        batch, length, k = weights.shape
        # k rows gathered and summed per position, without materialising [B, L, k, c].
        summed = torch.nn.functional.embedding_bag(
            distribution.indices.reshape(-1, k),
            table,
            per_sample_weights=weights.reshape(-1, k),
            mode="sum",
        )
        return summed.reshape(batch, length, -1)


def expected_embeddings(distribution: TokenDistribution, table: Tensor) -> Tensor:
    """``sum_v p(v) E[v]``: ``[B, L, d]`` from token weights and an embedding table ``[V, d]``."""
    return _expectation(distribution, table)


def augment_table(table: Tensor, token_weights: Tensor) -> Tensor:
    """``[V, d + 1]`` table ``[E | w]``: one product gives embeddings and importance weights."""
    return torch.cat([table.detach(), token_weights.detach().to(table.dtype)[:, None]], dim=1)


def expected_inputs(distribution: TokenDistribution, augmented: Tensor) -> tuple[Tensor, Tensor]:
    """Expected input embeddings ``[B, L, d]`` and expected importance weights
    ``sum_v p(v) w[v]`` ``[B, L]`` from an :func:`augment_table` ``[E | w]``.

    The weights are differentiable too, so the gradient is that of the score as computed
    (probability moved onto a special token, which weighs 0, lowers that position's weight)."""
    out = _expectation(distribution, augmented)
    return out[..., :-1], out[..., -1]


def select_positions(distribution: TokenDistribution, rows: Tensor) -> TokenDistribution:
    """The distribution at the flat positions ``rows`` of its ``[B, L]``, as a ``[1, N, ...]``
    one (differentiable: the gradient reaches the selected positions)."""

    def pick(field: Tensor | None) -> Tensor | None:
        return None if field is None else field.flatten(0, 1).index_select(0, rows)[None]

    return TokenDistribution(
        pick(distribution.weights), pick(distribution.indices), pick(distribution.logits)
    )


def most_probable_tokens(distribution: TokenDistribution) -> Tensor:
    """``[B, L]`` token ids of the largest weight at each position: the argmax tokens, the
    one-hot tokens under ``straight_through``, the sampled tokens under ``gumbel_temperature``
    (whose perturbed scores the distribution holds)."""
    if distribution.weights is None:
        return distribution.logits.argmax(dim=-1)
    # the first of tied weights: the top-k indices are in token order (candidate_weights), so
    # ties go to the smallest id, as argmax over the whole vocabulary breaks them
    best = distribution.weights.detach().argmax(dim=-1, keepdim=True)
    if distribution.indices is None:
        return best.squeeze(-1)
    return distribution.indices.gather(-1, best).squeeze(-1)
