"""BERTScorer (bsloss/metric.py): its numeric arguments and idf weights are checked and named.
(Its scores against bert_score: tests/test_bert_score_compat.py and tests/test_parity.py.)"""

from __future__ import annotations

import collections

import pytest

from bsloss import BERTScorer


def test_rc1_idf_empty_list(encoder):
    with pytest.raises(ValueError, match=r"idf is an empty list"):
        BERTScorer(encoder=encoder, idf=[])


@pytest.mark.parametrize(
    "batch_size, error", [(-1, ValueError), (0, ValueError), (1.5, TypeError), (True, TypeError)]
)
def test_rc2_score_batch_size(scorer, batch_size, error):
    with pytest.raises(error, match="batch_size"):
        scorer.score(["a cat"], ["a dog"], batch_size=batch_size)


@pytest.mark.parametrize("name", ["batch_size", "chunk_size", "reference_cache_size"])
def test_rc2_constructor_numbers(encoder, name):
    with pytest.raises(ValueError, match=name):
        BERTScorer(encoder=encoder, **{name: -1})
    with pytest.raises(TypeError, match=name):
        BERTScorer(encoder=encoder, **{name: 2.0})


@pytest.mark.parametrize(
    "idf, error, match",
    [
        (collections.defaultdict(lambda: float("nan")), ValueError, "default weight is nan"),
        (collections.defaultdict(lambda: -1.0), ValueError, "default weight"),
        ({2000: float("inf")}, ValueError, "token id 2000"),
        ({2000: -0.5}, ValueError, "token id 2000"),
        ({2000: "heavy"}, TypeError, "token id 2000"),
        ({"the": 1.0}, TypeError, "token id 'the'"),
    ],
)
def test_rc3_idf_weights_must_be_finite_and_non_negative(encoder, idf, error, match):
    with pytest.raises(error, match=match):
        BERTScorer(encoder=encoder, idf=idf)
