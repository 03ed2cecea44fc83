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

import torch
from torch import Tensor

__all__ = ["splice_special_tokens"]


def splice_special_tokens(
    token_embeddings: Tensor,
    mask: Tensor,
    table: Tensor,
    prefix_ids: Sequence[int],
    suffix_ids: Sequence[int],
    max_length: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Wrap each row's real token embeddings in the scorer's special tokens.

    Args:
        token_embeddings: ``[B, L, d]`` input embeddings of the candidate tokens.
        mask: ``[B, L]``, true on real tokens (any pattern; they are packed left).
        table: the scorer's ``[V, d]`` input-embedding table (the special tokens' rows).
        prefix_ids, suffix_ids: the special ids before and after a sentence ([CLS] / [SEP]).
        max_length: the scorer's maximum length, special tokens included.

    Returns:
        inputs ``[B, P + L' + S, d]``, attention mask and special-position mask ``[B, P + L' +
        S]`` (``P``/``S``: the numbers of prefix/suffix special tokens; ``L'`` is ``L``, or the
        largest number of real tokens in a row when ``P + L + S`` exceeds ``max_length``).

    >>> embeddings = torch.arange(6.0).reshape(1, 3, 2)
    >>> table = torch.full((4, 2), -1.0)
    >>> inputs, attention, special = splice_special_tokens(
    ...     embeddings, torch.tensor([[True, False, True]]), table, [2], [3], max_length=512)
    >>> inputs[0, :, 0].tolist()
    [-1.0, 0.0, 4.0, -1.0, 0.0]
    >>> attention.tolist(), special.tolist()
    ([[True, True, True, True, False]], [[True, False, False, True, False]])
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
    slot = torch.where(mask, slot, torch.full_like(slot, total))  # padded -> a dropped slot
    inputs = token_embeddings.new_zeros(batch, total + 1, token_embeddings.shape[-1])
    inputs = inputs.scatter(1, slot[..., None].expand_as(token_embeddings), token_embeddings)
    inputs = inputs[:, :total]
    positions = torch.arange(total, device=device)[None, :]
    special = torch.zeros(batch, total, dtype=torch.bool, device=device)
    for k, token_id in enumerate(prefix_ids):
        special[:, k] = True
        inputs[:, k] = table[token_id].to(inputs.dtype)
    suffix_start = n_prefix + lengths  # [B]
    for k, token_id in enumerate(suffix_ids):
        at = positions == (suffix_start + k)[:, None]
        special |= at
        inputs = torch.where(at[..., None], table[token_id].to(inputs.dtype), inputs)
    attention = positions < (suffix_start + n_suffix)[:, None]
    return inputs, attention, special
