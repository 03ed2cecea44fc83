"""The pure tensor core of bsloss: no models, no text.

Similarities, matchings, weighted reductions, idf, centering and baseline rescaling, shared by
the evaluation path (:class:`bsloss.BERTScorer`) and the training path
(:class:`bsloss.BERTScoreLoss`).
"""

from bsloss.functional.bertscore import PRF, bert_score, token_scores
from bsloss.functional.centering import batch_center, batch_mean
from bsloss.functional.idf import idf_table, table_from_mapping, uniform_table
from bsloss.functional.matching import (
    Hard,
    LogSumExp,
    Matching,
    Sinkhorn,
    Softmax,
    hard_match,
    logsumexp_match,
    resolve_matching,
    sinkhorn_match,
    softmax_match,
)
from bsloss.functional.reduction import best_over_references, f_measure, weighted_mean
from bsloss.functional.rescale import rescale_with_baseline
from bsloss.functional.similarity import cosine_similarity, l2_normalize

__all__ = [
    "best_over_references",
    "PRF",
    "bert_score",
    "token_scores",
    "batch_center",
    "batch_mean",
    "idf_table",
    "table_from_mapping",
    "uniform_table",
    "Matching",
    "Hard",
    "Softmax",
    "LogSumExp",
    "Sinkhorn",
    "resolve_matching",
    "hard_match",
    "logsumexp_match",
    "sinkhorn_match",
    "softmax_match",
    "f_measure",
    "weighted_mean",
    "rescale_with_baseline",
    "cosine_similarity",
    "l2_normalize",
]
