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
        # (non-empty: an empty mapping is idf=False, as bert_score's ``if not idf`` takes it)
        (
            collections.defaultdict(lambda: float("nan"), {5: 1.0}),
            ValueError,
            "default weight is nan",
        ),
        (collections.defaultdict(lambda: -1.0, {5: 1.0}), ValueError, "default weight"),
        ({2000: float("inf")}, ValueError, "token id 2000"),
        ({2000: -0.5}, ValueError, "token id 2000"),
        ({2000: "heavy"}, TypeError, "token id 2000"),
        ({"the": 1.0}, TypeError, "token id 'the'"),
    ],
)
def test_rc3_idf_weights_must_be_finite_and_non_negative(encoder, idf, error, match):
    with pytest.raises(error, match=match):
        BERTScorer(encoder=encoder, idf=idf)


def test_the_matching_loop_reads_scores_back_once_whatever_the_batch_count(scorer, monkeypatch):
    """On a GPU each read back to the host waits for every queued kernel: one per batch kept
    the host from preparing the next batch while the card worked (issue 45). The scores come
    back once per call, whether the 12 pairs make 1 batch or 3, and equal."""
    import torch

    cands = ["a cat sat on the mat", "it rained", "he left early", "good food"] * 3
    refs = ["the cat is on a mat", "rain fell", "she stayed", "bad service"] * 3
    reads = collections.Counter()
    original = torch.Tensor.cpu

    def counted(self, *args, **kwargs):
        reads[tuple(self.shape)] += 1
        return original(self, *args, **kwargs)

    results, counts = {}, {}
    for batch_size in (64, 5):
        reads.clear()
        monkeypatch.setattr(torch.Tensor, "cpu", counted)
        results[batch_size] = scorer.score(cands, refs, batch_size=batch_size)
        monkeypatch.undo()
        counts[batch_size] = dict(reads)
    # the [pairs, layers, 4] scores of all 12 pairs (P, R, F and whether a text of the pair
    # weighs nothing), read once; no batch's own
    assert counts[5] == counts[64] == {(12, 1, 4): 1}, counts
    for one, many in zip(results[64], results[5], strict=True):
        torch.testing.assert_close(one, many, rtol=0, atol=1e-6)


def test_idf_sents_beside_idf_weights_is_refused_and_an_empty_dict_is_no_idf():
    """idf_sents beside an idf list or dict was checked, then dropped without a word
    (bert_score uses idf_sents' weights there); idf={} scored as no idf and hashed as
    "_idf" where bert_score's says "_no-idf" (audit h34)."""
    with pytest.raises(ValueError, match="idf_sents goes with idf=True; idf is already a list"):
        BERTScorer(idf=["a cat"], idf_sents=["a dog"])
    with pytest.raises(ValueError, match="already a dict"):
        BERTScorer(idf={2000: 1.0}, idf_sents=["a dog"])
    empty = BERTScorer(idf={})
    assert empty.idf is False and "_no-idf" in empty.hash
