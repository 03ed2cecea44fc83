"""Round 8 (audit h6): input checks at the public boundary and documented values that the code
did not give: empty pairs after baseline rescaling, idf sentences given as a string, zero-length
sequences, checkpointing over a shared encoder, flags and ``bsloss.functional``'s inputs."""

from __future__ import annotations

import pytest
import torch

import bsloss

# ---------------------------------------------------------------- F3: idf_sents / sents


def test_idf_sents_as_a_string_is_refused_by_name(encoder):
    # list("A cat ...") counted idf over the string's characters, silently
    with pytest.raises(TypeError, match=r"idf_sents must be a list of strings, got str"):
        bsloss.BERTScorer(encoder=encoder, idf=True, idf_sents="A cat sat. A dog ran.")


def test_idf_sents_not_a_sequence_is_refused_by_name(encoder):
    with pytest.raises(TypeError, match=r"idf_sents must be a list of strings, got int"):
        bsloss.BERTScorer(encoder=encoder, idf=True, idf_sents=3)


def test_idf_sents_bad_item_is_named_under_idf_sents(encoder):
    with pytest.raises(TypeError, match=r"idf_sents\[1\] must be a string, got NoneType"):
        bsloss.BERTScorer(encoder=encoder, idf=True, idf_sents=["a", None])


def test_compute_idf_bad_item_is_named_under_sents(encoder):
    scorer = bsloss.BERTScorer(encoder=encoder, idf=True)
    with pytest.raises(TypeError, match=r"sents\[1\] must be a string, got NoneType"):
        scorer.compute_idf(["a", None])
    with pytest.raises(TypeError, match=r"sents must be a list of strings, got str"):
        scorer.compute_idf("a cat")


def test_idf_sents_list_still_scores_as_before(encoder):
    sents = ["A cat sat.", "A dog ran."]
    a = bsloss.BERTScorer(encoder=encoder, idf=True, idf_sents=sents)
    b = bsloss.BERTScorer(encoder=encoder, idf=sents)
    fa = a.score(["a cat"], ["the cat"])[2]
    fb = b.score(["a cat"], ["the cat"])[2]
    assert torch.equal(fa, fb)
