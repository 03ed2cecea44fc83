"""Token importance weights for a scorer: uniform, idf from sentences, or a user's dict."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence

import numpy as np
from torch import Tensor

from bsloss.functional.idf import idf_table, table_from_mapping, uniform_table
from bsloss.inputs import check_texts
from bsloss.scorer.encoder import ScorerEncoder

__all__ = ["IdfSpec", "as_idf_spec", "weight_table"]

IdfSpec = bool | Mapping[int, float] | Sequence[str]


def as_idf_spec(idf: object) -> object:
    """``idf`` with the values bert_score takes as bools (it asks ``if idf:``) made bools:
    ``None``, 0 and 1, numpy's bools; anything else as it is, for :func:`weight_table` to check.

    >>> as_idf_spec(None), as_idf_spec(np.True_), as_idf_spec(1), as_idf_spec({})
    (False, True, True, False)
    """
    if idf is None:
        return False
    if isinstance(idf, Mapping) and not idf:  # bert_score's ``if not idf``: hash "no-idf"
        return False
    if isinstance(idf, np.bool_) or (
        isinstance(idf, numbers.Integral) and not isinstance(idf, bool) and idf in (0, 1)
    ):
        return bool(idf)
    return idf


def weight_table(
    encoder: ScorerEncoder, idf: IdfSpec, vocab_size: int, truncate: bool = True
) -> Tensor | None:
    """``[V]`` weights (special tokens 0 unless a dict weighs them) for ``idf`` = False, a
    ``{token_id: weight}`` dict or
    a list of sentences; ``None`` for ``idf=True`` (weights from each call's references).

    ``truncate``: a sentence longer than the scorer's maximum is counted up to it, with a
    warning naming it (``idf[i]``), as ``long_inputs="truncate"`` scores it; ``False``: counted
    whole, as ``long_inputs="window"`` scores it (and as ``idf=True`` counts the references
    then), without a warning."""
    specials = encoder.tokenization.special_token_ids
    if idf is False:
        return uniform_table(vocab_size, specials)
    if idf is True:
        return None
    if isinstance(idf, Mapping):
        return table_from_mapping(idf, vocab_size, specials)
    if isinstance(idf, Sequence) and not isinstance(idf, str):
        sentences = check_texts(idf, "idf")
        if not sentences:
            # log((0 + 1) / (0 + 1)) = 0 for every token: every score would be 0
            raise ValueError("idf is an empty list: pass the reference sentences to count")
        if truncate:
            ids = encoder.tokenization(sentences, name="idf")  # warns, naming idf[i]
        else:
            ids, _ = encoder.tokenization.encode(sentences, truncate=False)
        return idf_table(ids, vocab_size, specials)
    raise TypeError(
        f"idf must be a bool (or None, 0, 1), a dict or a list of sentences, got {idf!r}"
    )
