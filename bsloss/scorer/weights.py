"""Token importance weights for a scorer: uniform, idf from sentences, or a user's dict."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import Tensor

from bsloss.functional.idf import idf_table, table_from_mapping, uniform_table
from bsloss.inputs import check_texts
from bsloss.scorer.encoder import ScorerEncoder

__all__ = ["IdfSpec", "weight_table"]

IdfSpec = bool | Mapping[int, float] | Sequence[str]


def weight_table(encoder: ScorerEncoder, idf: IdfSpec, vocab_size: int) -> Tensor | None:
    """``[V]`` weights (special tokens 0) for ``idf`` = False, a ``{token_id: weight}`` dict or
    a list of sentences; ``None`` for ``idf=True`` (weights from each call's references)."""
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
        return idf_table(encoder.tokenization(sentences, name="idf"), vocab_size, specials)
    raise TypeError(f"idf must be a bool, a dict or a list of sentences, got {type(idf)}")
