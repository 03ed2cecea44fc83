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


# ---------------------------------------------------------------- F4: zero-length sequences


@pytest.mark.parametrize("matching", ["hard", "softmax", "logsumexp", "sinkhorn"])
@pytest.mark.parametrize("side", ["candidates", "references"])
def test_zero_length_side_scores_zero_in_every_matching(matching, side):
    from bsloss.functional import bert_score

    cand, ref = torch.randn(2, 5, 8), torch.randn(2, 4, 8)
    if side == "candidates":
        cand = cand[:, :0].requires_grad_()
    else:
        ref = ref[:, :0].requires_grad_()
    prf = bert_score(cand, ref, matching=matching)
    for value in prf:
        assert value.shape == (2,)
        assert value.tolist() == [0.0, 0.0]


def test_hard_match_over_zero_length_keeps_the_other_side_shape():
    from bsloss.functional import hard_match

    sim = torch.randn(3, 0, 4)
    cand_scores, ref_scores = hard_match(
        sim, torch.ones(3, 0, dtype=torch.bool), torch.ones(3, 4, dtype=torch.bool)
    )
    assert cand_scores.shape == (3, 0)
    assert ref_scores.shape == (3, 4) and not ref_scores.any()


def test_loss_hard_matching_with_zero_length_embeddings_scores_zero(encoder):
    loss = bsloss.BERTScoreLoss(encoder, matching="hard", reduction="none")
    out = loss(bsloss.Embeddings(torch.randn(2, 0, encoder.hidden_size)), ["a cat", "a dog"])
    assert out.tolist() == [1.0, 1.0]


def test_reference_ids_without_columns_is_refused_by_name(encoder, vocab):
    loss = bsloss.BERTScoreLoss(encoder, reduction="none")
    ids = torch.zeros(2, 0, dtype=torch.long)
    with pytest.raises(ValueError, match=r"reference_ids has no columns \(\[2, 0\]\)"):
        loss(torch.randn(2, 4, vocab), reference_ids=ids)
    with pytest.raises(ValueError, match=r"reference_ids has no columns"):
        loss.encode_reference_ids(ids, None)
