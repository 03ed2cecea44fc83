"""The helpers of ``bert_score.utils`` that scripts import, with bert_score 0.3.13's signatures:
a migrating script changes ``bert_score.utils`` to ``bsloss.utils`` and nothing else.

- ``lang2model``: the model of each language (any other: bert-base-multilingual-cased);
- ``model2layers``: bsloss's default-layer table (:data:`bsloss.scorer.layers.DEFAULT_LAYERS`:
  every entry of bert_score 0.3.13's table, and the sentence-transformers scorers);
- ``sent_encode(tokenizer, sent)``: a sentence's ids, special tokens included, as bert_score
  tokenises;
- ``get_idf_dict(arr, tokenizer, nthreads=4)``: idf weights of token ids;
- ``get_hash(model, num_layers, idf, rescale_with_baseline, use_custom_baseline,
  use_fast_tokenizer)``: the reproducibility signature, as :attr:`bsloss.BERTScorer.hash`;
- ``get_tokenizer(model_type, use_fast=False)`` and ``get_model(model_type, num_layers,
  all_layers=None)``: the scorer's tokenizer and its encoder cut at ``num_layers``.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from bsloss.metric import LANG_TO_MODEL, MULTILINGUAL_MODEL, get_hash
from bsloss.scorer.layers import DEFAULT_LAYERS

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "lang2model",
    "model2layers",
    "sent_encode",
    "get_idf_dict",
    "get_hash",
    "get_tokenizer",
    "get_model",
]

lang2model: defaultdict[str, str] = defaultdict(lambda: MULTILINGUAL_MODEL, LANG_TO_MODEL)
model2layers: dict[str, int] = dict(DEFAULT_LAYERS)


def sent_encode(tokenizer, sent: str) -> list[int]:
    """The ids of ``sent`` (stripped) with the special tokens, truncated to the tokenizer's
    maximum; GPT-2 and RoBERTa tokenizers with a prefix space (bert_score's ``sent_encode``).

    >>> from bsloss.scorer.encoder import ScorerEncoder
    >>> tokenizer = ScorerEncoder.from_pretrained(device="cpu").tokenizer
    >>> sent_encode(tokenizer, " a cat ") == tokenizer("a cat")["input_ids"]
    True
    """
    from transformers import GPT2Tokenizer, RobertaTokenizer

    sent = sent.strip()
    if sent == "":  # only the special tokens (transformers 5 has no build_inputs_with_...)
        return tokenizer("", add_special_tokens=True)["input_ids"]
    options = dict(add_special_tokens=True, max_length=tokenizer.model_max_length, truncation=True)
    if isinstance(tokenizer, GPT2Tokenizer | RobertaTokenizer):
        options["add_prefix_space"] = True
    return tokenizer.encode(sent, **options)


def get_idf_dict(arr: Sequence[str], tokenizer, nthreads: int = 4) -> defaultdict[int, float]:
    """idf of each token id over the sentences ``arr``: ``log((M + 1) / (df + 1))``, and
    ``log(M + 1)`` for an id never seen (the dict's default), as bert_score's ``get_idf_dict``.
    ``nthreads`` is accepted and has no effect (no worker processes).

    >>> from bsloss.scorer.encoder import ScorerEncoder
    >>> tokenizer = ScorerEncoder.from_pretrained(device="cpu").tokenizer
    >>> idf = get_idf_dict(["a cat", "a dog"], tokenizer)
    >>> round(idf[tokenizer.convert_tokens_to_ids("cat")], 4), round(idf[7], 4)
    (0.4055, 1.0986)
    """
    if isinstance(arr, str):
        raise TypeError("arr must be a list of sentences, got a single string")
    counts: Counter[int] = Counter()
    for sent in arr:
        counts.update(set(sent_encode(tokenizer, sent)))
    num_docs = len(arr)
    unseen = math.log((num_docs + 1) / 1)
    idf_dict: defaultdict[int, float] = defaultdict(lambda: unseen)
    idf_dict.update({i: math.log((num_docs + 1) / (c + 1)) for i, c in counts.items()})
    return idf_dict


def get_tokenizer(model_type: str, use_fast: bool = False) -> PreTrainedTokenizerBase:
    """The scorer's tokenizer as bsloss loads it (``use_fast`` is accepted; bsloss uses the
    fast tokenizer, whose ids match)."""
    from bsloss.scorer.loading import load_tokenizer, locate_scorer

    return load_tokenizer(locate_scorer(model_type)[1])


def get_model(
    model_type: str, num_layers: int | None, all_layers: bool | None = None
) -> PreTrainedModel:
    """The scorer's Hugging Face encoder, cut at ``num_layers`` (kept whole with
    ``all_layers``), in eval mode."""
    from bsloss.scorer.loading import load_scorer

    return load_scorer(model_type, num_layers, bool(all_layers))[0].eval()
