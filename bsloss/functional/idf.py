r"""Inverse document frequency weights (Zhang et al., 2020, Eq. 5).

.. math::  \mathrm{idf}(w) = \log \frac{M + 1}{\mathrm{df}(w) + 1}

over a reference corpus of :math:`M` sentences, where :math:`\mathrm{df}(w)` counts each token
once per sentence; a token never seen gets :math:`\log(M + 1)`. Special tokens (CLS/SEP) weigh 0.
Pure: token ids in, a dense weight table out.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["idf_table", "uniform_table", "table_from_mapping"]


def document_frequency(documents: Sequence[Sequence[int]], vocab_size: int) -> Tensor:
    """``[V]`` number of documents each token id occurs in (once per document)."""
    frequency = torch.zeros(vocab_size, dtype=torch.float64)
    for ids in documents:
        frequency[torch.as_tensor(sorted(set(ids)), dtype=torch.long)] += 1
    return frequency


def idf_from_frequency(
    frequency: Tensor, num_docs: int, special_token_ids: Iterable[int] = ()
) -> Tensor:
    """``log((M + 1) / (df + 1))`` per token id; special tokens 0."""
    table = torch.log((num_docs + 1) / (frequency + 1))
    table[list(special_token_ids)] = 0.0
    return table


def idf_table(
    documents: Sequence[Sequence[int]], vocab_size: int, special_token_ids: Iterable[int] = ()
) -> Tensor:
    """``[V]`` idf weights from token-id sentences; unseen ids get ``log(M + 1)``."""
    frequency = document_frequency(documents, vocab_size)
    return idf_from_frequency(frequency, len(documents), special_token_ids)


def uniform_table(vocab_size: int, special_token_ids: Iterable[int] = ()) -> Tensor:
    """``[V]`` of ones, 0 on the special tokens: BERTScore without idf."""
    table = torch.ones(vocab_size, dtype=torch.float64)
    table[list(special_token_ids)] = 0.0
    return table


def _weight(value: object, name: str) -> float:
    if isinstance(value, bool | str | bytes):
        raise TypeError(f"idf: {name} must be a number, got {type(value).__name__}")
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"idf: {name} must be a number, got {type(value).__name__}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"idf: {name} is {value}: weights must be finite and >= 0")
    return value


def table_from_mapping(
    weights: Mapping[int, float], vocab_size: int, special_token_ids: Iterable[int] = ()
) -> Tensor:
    """``[V]`` weights from a user's ``{token_id: weight}``.

    Ids missing from the mapping get its ``default_factory()`` for a ``defaultdict``, else the
    largest weight in it (an unseen token is at least as rare as the rarest one seen); the
    ``special_token_ids`` too for a ``defaultdict``, else 0 where the mapping leaves them out:
    a mapping's weights are used as given, as bert_score uses them (forced to 0 they moved F by
    up to 0.16 from bert_score's for a ``defaultdict(lambda: 1.0)``; audit h34). A table
    whose largest weight is past ``2^100`` (or below ``2^-100``), out of float32's reach once
    summed, is multiplied by a power of two that brings it to ``[0.5, 1)``: exact, and the
    scores, which depend only on the weights' ratios, are unchanged.

    Raises:
        TypeError: a key that is not an integer or a weight that is not a number.
        ValueError: a key outside ``[0, vocab_size)``, or a weight (the default's included)
            that is negative, NaN or infinite.
    """
    default_factory = getattr(weights, "default_factory", None)
    if default_factory is not None:
        fill = _weight(default_factory(), "the defaultdict's default weight")
    else:
        given = (_weight(v, f"weight of token id {k!r}") for k, v in weights.items())
        fill = max(given, default=1.0)
    table = torch.full((vocab_size,), fill, dtype=torch.float64)
    for token_id, value in weights.items():
        if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
            raise TypeError(f"idf: token id {token_id!r} is not an integer")
        if not 0 <= int(token_id) < vocab_size:
            raise ValueError(
                f"idf: token id {token_id} is outside the vocabulary [0, {vocab_size})"
            )
        table[int(token_id)] = _weight(value, f"weight of token id {token_id}")
    if default_factory is None:
        unweighted = [i for i in special_token_ids if i not in weights]
        table[unweighted] = 0.0
    return _in_float32_range(table)


# A text's weights are summed in float32 (the loss's table is float32, the scores are computed
# in it), so a table is kept within 2^-100 .. 2^100 of 1: a text of up to 2^27 tokens then sums
# to a finite, non-zero weight.
_SCALE_BITS = 100


def _in_float32_range(table: Tensor) -> Tensor:
    """``table`` times a power of two that brings its largest weight into ``[0.5, 1)``, where that
    weight is above ``2^100`` or below ``2^-100``; else ``table`` as it is.

    Why: 1e39 (finite in float64, where the weights are checked) is inf in float32, and every
    weighted mean inf / inf = NaN; 1e-50 is 0 there, a text of such tokens weightless. The
    scores depend only on the weights' ratios, and a power of two changes no ratio, no rounding
    (an exact scaling): the same scores as the same weights divided by any constant."""
    largest = float(table.max()) if table.numel() else 0.0
    if largest == 0.0 or 2.0**-_SCALE_BITS <= largest <= 2.0**_SCALE_BITS:
        return table
    _, exponent = math.frexp(largest)  # largest = m * 2^exponent, m in [0.5, 1)
    # in two factors: 2^1073 (for a subnormal largest) is past float64's range, its halves not
    half = -exponent // 2
    return table * math.ldexp(1.0, half) * math.ldexp(1.0, -exponent - half)
