"""Candidate input embeddings between the scorer's own special tokens.

A candidate reaches the scorer as input embeddings (expected embeddings of a generator's
distributions, :mod:`bsloss.distributions`, or the bridge's pieces, :mod:`bsloss.bridge`), not
as text, so the tokenizer does not wrap it: this module does. Row ``b`` becomes

    ``[prefix specials] e_1 … e_n [suffix specials] [padding]``

with the real tokens (``mask``: any pattern) packed left in their order, the special tokens'
rows taken from the scorer's embedding table, and padding beyond the longest row dropped when
the padded width would exceed the scorer's maximum (a long padded batch of short rows fits).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["SplicedTokens", "splice_special_tokens"]


class SplicedTokens(NamedTuple):
    """The scorer's inputs for a batch of candidates (``T``: the spliced width)."""

    inputs: Tensor  # [B, T, d] input embeddings, special tokens included
    attention: Tensor  # [B, T] bool, true up to and including the suffix specials
    weights: Tensor  # [B, T] the real tokens' weights in their slots, 0 on specials and padding


def splice_special_tokens(
    token_embeddings: Tensor,
    mask: Tensor,
    table: Tensor,
    prefix_ids: Sequence[int],
    suffix_ids: Sequence[int],
    max_length: int,
    token_weights: Tensor | None = None,
) -> SplicedTokens:
    """Wrap each row's real token embeddings in the scorer's special tokens.

    Args:
        token_embeddings: ``[B, L, d]`` input embeddings of the candidate tokens.
        mask: ``[B, L]``, true on real tokens (any pattern; they are packed left).
        table: the scorer's ``[V, d]`` input-embedding table (the special tokens' rows).
        prefix_ids, suffix_ids: the special ids before and after a sentence ([CLS] / [SEP]).
        max_length: the scorer's maximum length, special tokens included.
        token_weights: ``[B, L]`` importance weights of the candidate tokens, moved with them
            (default: 1 on real tokens).

    Returns:
        :class:`SplicedTokens` ``[B, P + L' + S, ...]`` (``P``/``S``: the numbers of
        prefix/suffix special tokens; ``L'`` is ``L``, or the largest number of real tokens in
        a row when ``P + L + S`` exceeds ``max_length``). Every tensor is built by scatters and
        comparisons whose sizes the host knows: no boolean indexing, so no wait for a GPU.

    >>> embeddings = torch.arange(6.0).reshape(1, 3, 2)
    >>> table = torch.full((4, 2), -1.0)
    >>> spliced = splice_special_tokens(
    ...     embeddings, torch.tensor([[True, False, True]]), table, [2], [3], max_length=512)
    >>> spliced.inputs[0, :, 0].tolist()
    [-1.0, 0.0, 4.0, -1.0, 0.0]
    >>> spliced.attention.tolist(), spliced.weights.tolist()
    ([[True, True, True, True, False]], [[0.0, 1.0, 1.0, 0.0, 0.0]])
    """
    batch = token_embeddings.shape[0]
    mask = mask.bool()
    device = token_embeddings.device
    n_prefix, n_suffix = len(prefix_ids), len(suffix_ids)
    lengths = mask.sum(dim=1)
    length = token_embeddings.shape[1]
    if n_prefix + length + n_suffix > max_length:
        # padding past the scorer's maximum: keep only the columns some row uses (a sync, paid
        # only by such batches)
        length = int(lengths.max()) if batch else 0
    total = n_prefix + length + n_suffix
    # Slot of each real token: right after the prefix, packed left in their original order.
    slot = n_prefix + torch.cumsum(mask.long(), dim=1) - 1
    slot = torch.where(mask, slot, total)  # padded -> the dropped slot `total`
    inputs = token_embeddings.new_zeros(batch, total + 1, token_embeddings.shape[-1])
    inputs = inputs.scatter(1, slot[..., None].expand_as(token_embeddings), token_embeddings)
    inputs = inputs[:, :total]
    if token_weights is None:
        token_weights = mask.to(token_embeddings.dtype)
    # a padded token's weight lands in the dropped slot too; specials' slots stay 0
    weights = token_weights.new_zeros(batch, total + 1).scatter(1, slot, token_weights)
    positions = torch.arange(total, device=device)[None, :]
    for k, token_id in enumerate(prefix_ids):
        inputs[:, k] = table[token_id].to(inputs.dtype)
    suffix_start = n_prefix + lengths  # [B]
    for k, token_id in enumerate(suffix_ids):
        at = positions == (suffix_start + k)[:, None]
        inputs = torch.where(at[..., None], table[token_id].to(inputs.dtype), inputs)
    attention = positions < (suffix_start + n_suffix)[:, None]
    return SplicedTokens(inputs, attention, weights[:, :total])
