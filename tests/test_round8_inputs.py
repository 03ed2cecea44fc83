"""Round 8 (audit h6): input checks at the public boundary and documented values that the code
did not give: empty pairs after baseline rescaling, idf sentences given as a string, zero-length
sequences, checkpointing over a shared encoder, flags and ``bsloss.functional``'s inputs."""

from __future__ import annotations

import pytest
import torch
from _helpers import layer_runs

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


# ---------------------------------------------------------------- F6: flags and strings


def test_check_flag_takes_bools_numpy_bools_and_0_1():
    import numpy as np

    from bsloss.inputs import check_flag

    assert [check_flag(v, "f") for v in (True, False, np.True_, np.False_, 1, 0)] == [
        True,
        False,
        True,
        False,
        True,
        False,
    ]
    for bad in ("false", "", None, 2, 0.0, [True]):
        with pytest.raises(TypeError, match=r"f must be a bool \(or 0, 1\), got"):
            check_flag(bad, "f")


def test_loss_center_as_a_string_is_refused(encoder):
    # "false" is truthy: it centred the batch (loss 0.9192 instead of center=False's 0.9878)
    with pytest.raises(TypeError, match=r"center must be a bool \(or 0, 1\), got 'false'"):
        bsloss.BERTScoreLoss(encoder, center="false")


def test_loss_center_takes_numpy_bool_and_int(encoder):
    import numpy as np

    assert bsloss.BERTScoreLoss(encoder, center=np.True_).center is True
    assert bsloss.BERTScoreLoss(encoder, center=0).center is False


def test_loss_rescale_with_baseline_flag_is_checked_and_path_still_taken(encoder, tmp_path):
    with pytest.raises(
        TypeError, match=r"rescale_with_baseline must be a bool \(or 0, 1\), a path"
    ):
        bsloss.BERTScoreLoss(encoder, rescale_with_baseline=2)
    missing = tmp_path / "nothing.tsv"
    with pytest.raises(FileNotFoundError):
        bsloss.BERTScoreLoss(encoder, rescale_with_baseline=str(missing))
    assert bsloss.BERTScoreLoss(encoder, rescale_with_baseline=1).baseline is not None


@pytest.mark.parametrize("flag", ["all_layers", "rescale_with_baseline"])
def test_metric_flags_as_strings_are_refused(encoder, flag):
    with pytest.raises(TypeError, match=rf"{flag} must be a bool \(or 0, 1\), got 'false'"):
        bsloss.BERTScorer(encoder=encoder, **{flag: "false"})


def test_metric_flags_take_numpy_bools(encoder):
    import numpy as np

    scorer = bsloss.BERTScorer(encoder=encoder, rescale_with_baseline=np.True_)
    assert scorer.rescale_with_baseline is True
    assert scorer.hash.endswith("-rescaled")


def test_return_hash_as_a_string_is_refused(scorer):
    with pytest.raises(TypeError, match=r"return_hash must be a bool \(or 0, 1\), got 'false'"):
        scorer.score(["a cat"], ["a dog"], return_hash="false")
    out = scorer.score(["a cat"], ["a dog"], return_hash=0)
    assert len(out) == 3 and out[0].shape == (1,)


@pytest.mark.parametrize("given", ["top_k", "", b"top_k"])
def test_candidate_transforms_as_a_string_is_refused_by_name(given):
    from bsloss.candidate_transforms import resolve_candidate_transforms

    with pytest.raises(
        TypeError, match=r"candidate_transforms must be a CandidateTransform .* got (str|bytes)"
    ):
        resolve_candidate_transforms(given)


# ---------------------------------------------------------------- F7: bsloss.functional inputs


def test_bert_score_refuses_a_list_by_name():
    from bsloss.functional import bert_score

    cand, ref = torch.randn(2, 5, 8), torch.randn(2, 4, 8)
    with pytest.raises(TypeError, match=r"candidates must be a torch.Tensor, got list"):
        bert_score(cand.tolist(), ref)
    with pytest.raises(TypeError, match=r"references must be a torch.Tensor, got list"):
        bert_score(cand, ref.tolist())
    with pytest.raises(TypeError, match=r"reference_weights must be a torch.Tensor, got list"):
        bert_score(cand, ref, reference_weights=[[1.0] * 4] * 2)
    with pytest.raises(TypeError, match=r"candidate_mask must be a torch.Tensor, got list"):
        bert_score(cand, ref, candidate_mask=[[True] * 5] * 2)


def test_bert_score_refuses_a_float_mask_by_name():
    from bsloss.functional import bert_score

    cand, ref = torch.randn(2, 5, 8), torch.randn(2, 4, 8)
    # 0.5 was read as True: the same value as no mask
    with pytest.raises(
        TypeError, match=r"candidate_mask must have a bool or integer dtype, got torch.float32"
    ):
        bert_score(cand, ref, candidate_mask=torch.full((2, 5), 0.5))
    ints = bert_score(cand, ref, reference_mask=torch.tensor([[1, 1, 0, 0]] * 2)).f1
    bools = bert_score(cand, ref, reference_mask=torch.tensor([[True, True, False, False]] * 2)).f1
    assert torch.equal(ints, bools)


def test_bert_score_refuses_integer_embeddings_by_name():
    from bsloss.functional import bert_score

    with pytest.raises(TypeError, match=r"candidates must have a floating dtype, got torch.int64"):
        bert_score(torch.ones(2, 5, 8, dtype=torch.long), torch.randn(2, 4, 8))


def test_best_over_references_propagates_nan():
    from bsloss.functional import best_over_references

    # a NaN score was replaced by 0 (the candidate looked as if it had no pair)
    best = best_over_references(torch.tensor([float("nan"), 0.7]), torch.tensor([0, 1]), 2)
    assert torch.isnan(best[0]) and best[1].item() == pytest.approx(0.7)
    best = best_over_references(torch.tensor([0.2, float("nan"), 0.5]), torch.tensor([0, 0, 1]), 2)
    assert torch.isnan(best[0]) and best[1].item() == pytest.approx(0.5)
    # an ignored pair does not compete, NaN or not
    ignore = torch.tensor([False, True, False])
    best = best_over_references(
        torch.tensor([0.2, float("nan"), 0.5]), torch.tensor([0, 0, 1]), 2, ignore=ignore
    )
    assert best.tolist() == pytest.approx([0.2, 0.5])


def test_best_over_references_refuses_a_list_owner():
    from bsloss.functional import best_over_references

    with pytest.raises(TypeError, match=r"owner must be a torch.Tensor, got list"):
        best_over_references(torch.tensor([0.2, 0.7, 0.5]), [0, 0, 1], 2)


# ---------------------------------------------------------------- F1: empty pairs, rescaled


def _ids(encoder, texts):
    batch = encoder.tokenizer(texts, return_tensors="pt", padding=True)
    return batch["input_ids"], batch["attention_mask"].bool()


F1_CANDIDATES = ["the cat sat on the mat", "a dog ran in the park", "it rained all day long"]


def test_rescaled_loss_scores_empty_references_0_as_the_metric(encoder):
    # the loss gave (0 - b) / (1 - b) = -0.184 (loss 1.184) where its warning said 0
    refs = [["A cat was sitting on the mat."], [""], ["   "]]
    ids, mask = _ids(encoder, F1_CANDIDATES)
    metric = bsloss.BERTScorer(encoder=encoder, rescale_with_baseline=True)
    loss = bsloss.BERTScoreLoss(
        encoder, matching="hard", rescale_with_baseline=True, reduction="none"
    )
    with pytest.warns(UserWarning, match="score 0: candidate index 1, 2"):
        P, R, F = metric.score(F1_CANDIDATES, refs)
    with pytest.warns(UserWarning, match=r"\(references\[1\], references\[2\]\): their pairs"):
        prf = loss.score(bsloss.TokenIds(ids), refs, candidate_mask=mask)
    assert prf.f1.tolist()[1:] == [0.0, 0.0]
    for got, want in zip(prf, (P, R, F), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    mean = bsloss.BERTScoreLoss(encoder, matching="hard", rescale_with_baseline=True)
    value = mean(bsloss.TokenIds(ids), refs, candidate_mask=mask)
    assert value.item() == pytest.approx((1 - F[0].item() + 2.0) / 3, abs=1e-6)


def test_rescaled_loss_scores_an_empty_candidate_0(encoder):
    ids, mask = _ids(encoder, F1_CANDIDATES)
    mask[0] = False  # no content position
    loss = bsloss.BERTScoreLoss(
        encoder, matching="hard", rescale_with_baseline=True, reduction="none"
    )
    logits = torch.randn(3, ids.shape[1], encoder.input_embeddings.num_embeddings)
    refs = ["a cat", "a dog", "rain"]
    for candidates in (bsloss.TokenIds(ids), bsloss.Logits(logits.requires_grad_())):
        prf = loss.score(candidates, refs, candidate_mask=mask)
        assert [v[0].item() for v in prf] == [0.0, 0.0, 0.0]
        assert prf.f1[1].item() != 0.0
    prf.f1.sum().backward()
    assert (logits.grad[0] == 0).all() and (logits.grad[1] != 0).any()
    hidden, ref_mask, weights = loss.encode_references(refs)
    ref_mask[0] = False
    prf = loss.score(bsloss.Embeddings(hidden, weights), refs, candidate_mask=ref_mask)
    assert prf.f1[0].item() == 0.0 and prf.f1[1].item() != 0.0


def test_rescaled_loss_ignores_an_empty_reference_among_others_as_the_metric(encoder):
    # the metric takes the best of the other references; the empty pair does not compete
    # unrelated references rescale below 0: an empty pair's -0.184 would win the max
    refs = [["", "A cat was sitting on the mat."], [" ", "quantum"], ["snow", "it rained"]]
    ids, mask = _ids(encoder, F1_CANDIDATES)
    metric = bsloss.BERTScorer(encoder=encoder, rescale_with_baseline=True)
    loss = bsloss.BERTScoreLoss(
        encoder, matching="hard", rescale_with_baseline=True, reduction="none"
    )
    with pytest.warns(UserWarning):
        P, R, F = metric.score(F1_CANDIDATES, refs)
    prf = loss.score(bsloss.TokenIds(ids), refs, candidate_mask=mask)
    torch.testing.assert_close(prf.precision, P, rtol=0, atol=1e-6)
    torch.testing.assert_close(prf.recall, R, rtol=0, atol=1e-6)
    # the loss's F is bert_score's where the raw P and R are positive; "quantum" against "a dog
    # ran in the park" has a raw P below 0 (-0.0043), where the loss's F is min(P, R), bounded
    # (round 9): compared before rescaling there
    unscaled = bsloss.BERTScoreLoss(encoder, matching="hard", reduction="none")
    raw = unscaled.score(bsloss.TokenIds(ids), [r[1:] for r in refs], candidate_mask=mask)
    metric_raw = bsloss.BERTScorer(encoder=encoder).score(F1_CANDIDATES, [r[1:] for r in refs])
    positive = (metric_raw[0] > 0) & (metric_raw[1] > 0)
    assert positive.tolist() == [True, False, True]
    torch.testing.assert_close(prf.f1[positive], F[positive], rtol=0, atol=1e-6)
    bounded = torch.minimum(metric_raw[0], metric_raw[1])
    torch.testing.assert_close(raw.f1[~positive], bounded[~positive], rtol=0, atol=1e-6)


def test_rescaled_loss_with_empty_reference_ids_scores_0(encoder):
    refs = ["a cat sat", ""]
    ids, mask = _ids(encoder, F1_CANDIDATES[:2])
    ref_ids, ref_mask = _ids(encoder, refs)
    loss = bsloss.BERTScoreLoss(
        encoder, matching="hard", rescale_with_baseline=True, reduction="none"
    )
    with pytest.warns(UserWarning, match=r"only empty .*\(reference_ids\[1\]\)"):
        by_ids = loss.score(
            bsloss.TokenIds(ids), candidate_mask=mask, reference_ids=ref_ids,
            reference_mask=ref_mask,
        )  # fmt: skip
    by_text = loss.score(bsloss.TokenIds(ids), refs, candidate_mask=mask)
    assert by_ids.f1[1].item() == 0.0
    torch.testing.assert_close(by_ids.f1, by_text.f1, rtol=0, atol=1e-6)


IDF_CORPUS = ["the cat sat", "the dog sat", "the sat cat"]  # "the", "sat": idf 0


def test_rescaled_weightless_reference_gives_the_metrics_value_and_says_it(encoder):
    # weightless through idf: bert_score (and the metric) rescale the pair's 0 to (0 - b)/(1 - b)
    loss = bsloss.BERTScoreLoss(
        encoder, matching="hard", idf=IDF_CORPUS, rescale_with_baseline=True, reduction="none"
    )
    metric = bsloss.BERTScorer(encoder=encoder, idf=IDF_CORPUS, rescale_with_baseline=True)
    ids, mask = _ids(encoder, ["a cat", "a dog ran"])
    refs = ["the sat", "the dog ran"]
    with pytest.warns(UserWarning, match=r"score \(0 - b\) / \(1 - b\) \(P -0\.\d+, R -0\.\d+"):
        prf = loss.score(bsloss.TokenIds(ids), refs, candidate_mask=mask)
    with pytest.warns(UserWarning):
        P, R, F = metric.score(["a cat", "a dog ran"], refs)
    b = loss.baseline.tolist()
    assert prf.f1[0].item() == pytest.approx(-b[2] / (1 - b[2]), abs=1e-6)
    torch.testing.assert_close(prf.f1, F, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- F5: checkpointing per loss


@pytest.fixture
def own_encoder(encoder):
    import copy

    return copy.deepcopy(encoder)


def test_a_second_loss_over_the_same_encoder_keeps_the_first_ones_checkpointing(own_encoder):
    # the last loss built set the mode for every loss on the encoder: A (True) ran without
    # checkpointing (0 of the 6 recomputed layer calls) after B (False) or C ("auto")
    vocab = own_encoder.input_embeddings.num_embeddings
    logits = torch.randn(2, 4, vocab, requires_grad=True)
    refs = ["a cat sat", "the dog ran"]
    first = bsloss.BERTScoreLoss(own_encoder, gradient_checkpointing=True)
    second = bsloss.BERTScoreLoss(own_encoder, gradient_checkpointing=False)
    third = bsloss.BERTScoreLoss(own_encoder)  # "auto": a few MiniLM tokens do not checkpoint
    assert layer_runs(first, lambda: first(logits, refs)) == 2
    assert layer_runs(second, lambda: second(logits, refs)) == 1
    assert layer_runs(third, lambda: third(logits, refs)) == 1
    assert layer_runs(first, lambda: first(logits, refs)) == 2
    # encode_candidates (the gradient's encoding, public) follows its loss's mode too
    encode = lambda loss: loss.encode_candidates(bsloss.Logits(logits))[0].sum()  # noqa: E731
    assert layer_runs(first, lambda: encode(first)) == 2
    assert layer_runs(second, lambda: encode(second)) == 1


def test_a_failed_construction_leaves_the_encoders_checkpointing(own_encoder):
    vocab = own_encoder.input_embeddings.num_embeddings
    logits = torch.randn(2, 4, vocab, requires_grad=True)
    refs = ["a cat sat", "the dog ran"]
    first = bsloss.BERTScoreLoss(own_encoder, gradient_checkpointing=True)
    with pytest.raises(ValueError, match="idf=True"):
        bsloss.BERTScoreLoss(own_encoder, gradient_checkpointing=False, idf=True)
    assert layer_runs(first, lambda: first(logits, refs)) == 2


def test_checkpointing_mode_restores_the_layers_and_the_metric_does_not_checkpoint(own_encoder):
    from bsloss.scorer.checkpointing import CheckpointedLayer, checkpointing_mode
    from bsloss.scorer.layers import _find_layer_stack

    bsloss.BERTScoreLoss(own_encoder, gradient_checkpointing=True)
    owner, leaf = _find_layer_stack(own_encoder.model)
    layers = list(getattr(owner, leaf))
    assert all(isinstance(layer, CheckpointedLayer) for layer in layers)
    before = [layer.enabled for layer in layers]
    with checkpointing_mode(own_encoder.model, True):
        assert all(layer.enabled is True for layer in layers)
        with checkpointing_mode(own_encoder.model, "auto"):
            assert all(layer.enabled == "auto" for layer in layers)
        assert all(layer.enabled is True for layer in layers)
    assert [layer.enabled for layer in layers] == before
    # outside a loss's call the wrapped layers do not checkpoint: the metric's pass (no grad
    # anyway) and a caller's own forward with grad run as before the loss was built
    assert all(layer.enabled is False for layer in layers)
    metric = bsloss.BERTScorer(encoder=own_encoder)
    assert metric.score(["a cat"], ["a cat"])[2].item() == pytest.approx(1.0, abs=1e-5)


# ---------------------------------------------------------------- F2: documented tie-break


def test_a_flat_distribution_counts_as_pad_and_gets_no_gradient_as_documented(encoder, vocab):
    # docs/loss.md: ties go to the smallest id ([PAD] = 0 here), a special token: skipped
    assert encoder.tokenizer.convert_ids_to_tokens(0) == "[PAD]"
    loss = bsloss.BERTScoreLoss(encoder, reduction="none")
    flat = torch.zeros(2, 3, vocab, requires_grad=True)
    value = loss(flat, ["a cat sat", "the dog ran"])
    value.sum().backward()
    assert value.tolist() == [1.0, 1.0] and not flat.grad.any()
    broken = (1e-6 * torch.randn(2, 3, vocab)).requires_grad_()
    loss(broken, ["a cat sat", "the dog ran"]).sum().backward()
    assert broken.grad.abs().max() > 0


def test_an_encoder_of_every_layer_needs_all_layers_said():
    """``BERTScorer(encoder=<an all_layers encoder>)`` took the encoder's flag over its own
    ``all_layers=False`` and returned ``[7, N]`` scores where one layer's ``[N]`` was asked
    for; the opposite mismatch was refused by name. Both are now."""
    from bsloss.scorer.encoder import ScorerEncoder

    every = ScorerEncoder.from_pretrained(device="cpu", all_layers=True)
    with pytest.raises(ValueError, match=r"encoder keeps every layer .*pass all_layers=True"):
        bsloss.BERTScorer(encoder=every)
    assert bsloss.BERTScorer(encoder=every, all_layers=True).score(["a"], ["a"])[2].shape == (7, 1)
