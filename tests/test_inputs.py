"""Input validation at the public boundary (bsloss/inputs.py and the checks of the loss, the
scorer and the reward that use it): texts, references, ids, tensor types and arguments are named
when refused. (Bad input across the whole API: tests/test_bad_input.py.)"""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
from _helpers import head_for

import bsloss
from bsloss import BERTScoreLoss, BERTScorer, BERTScoreReward, LogSumExp, Sinkhorn, Softmax
from bsloss.functional import Matching
from bsloss.functional.fused_expectation import fused_token_log_likelihood
from bsloss.functional.matching.base import SMALLEST_TEMPERATURE
from bsloss.functional.matching.logsumexp import LARGEST_TEMPERATURE
from bsloss.integrations import huggingface as hf


def test_rc7_references_as_a_string(encoder, vocab):
    loss = BERTScoreLoss(encoder=encoder)
    with pytest.raises(TypeError, match="references must be a list"):
        loss(logits=torch.randn(2, 3, vocab), references="ab")
    with pytest.raises(TypeError, match=re.escape("references[1][0]")):
        loss(logits=torch.randn(2, 3, vocab), references=["a", [3]])
    with pytest.raises(ValueError, match=re.escape("references[0] is an empty list")):
        loss(logits=torch.randn(2, 3, vocab), references=[[], "b"])


def test_rc8_reference_ids_outside_the_vocabulary(encoder, vocab):
    loss = BERTScoreLoss(encoder=encoder, reduction="none")
    logits = torch.randn(2, 3, vocab)
    ids = torch.tensor([[101, 2000, 102], [101, vocab + 5, 102]])
    with pytest.raises(ValueError, match=r"reference_ids has ids outside .*\[1, 1\]"):
        loss(logits=logits, reference_ids=ids)
    with pytest.raises(ValueError, match="reference_ids has ids outside"):
        loss(logits=logits, reference_ids=-ids)
    with pytest.raises(TypeError, match="reference_ids must have an integer dtype"):
        loss(logits=logits, reference_ids=ids.float())
    # a bad id on a masked-out position is padding: ignored
    mask = torch.tensor([[True, True, True], [True, False, False]])
    padded = loss(logits=logits, reference_ids=ids, reference_mask=mask)
    clean = loss(logits=logits, reference_ids=torch.where(mask, ids, 0), reference_mask=mask)
    torch.testing.assert_close(padded, clean)


def test_rc18_lone_surrogate_is_named(scorer, encoder, vocab):
    bad = "a \ud800 b"
    with pytest.raises(ValueError, match=re.escape("cands[1] is not valid Unicode")):
        scorer.score(["ok", bad], ["a", "b"])
    with pytest.raises(ValueError, match=re.escape("refs[0][1] is not valid Unicode")):
        scorer.score(["ok"], [["a", bad]])
    with pytest.raises(ValueError, match=re.escape("references[0] is not valid Unicode")):
        BERTScoreLoss(encoder=encoder)(logits=torch.randn(1, 2, vocab), references=[bad])
    with pytest.raises(ValueError, match=re.escape("completions[0] is not valid Unicode")):
        BERTScoreReward(scorer=scorer)(completions=[bad], reference=["a"])
    with pytest.raises(ValueError, match=re.escape("idf[1] is not valid Unicode")):
        BERTScorer(encoder=encoder, idf=["a", bad])
    # valid non-ASCII text is fine
    assert scorer.score(["café ☕ 東京"], ["café"])[2].item() > 0


def test_loss_tensor_types_are_named(encoder, vocab):
    loss = BERTScoreLoss(encoder=encoder)
    refs = ["a", "b"]
    with pytest.raises(TypeError, match="logits must be a torch.Tensor"):
        loss(logits=[[0.0]], references=refs)
    with pytest.raises(TypeError, match="logits must have a floating dtype"):
        loss(logits=torch.zeros(2, 3, vocab, dtype=torch.long), references=refs)
    with pytest.raises(TypeError, match="candidate_ids must have an integer dtype"):
        loss(candidate_ids=torch.zeros(2, 3), references=refs)
    with pytest.raises(TypeError, match="candidate_mask must have a bool or integer dtype"):
        loss(
            candidate_ids=torch.zeros(2, 3, dtype=torch.long),
            candidate_mask=torch.ones(2, 3),
            references=refs,
        )
    with pytest.raises(ValueError, match=r"probs must be \[B, L, V\]"):
        loss(probs=torch.ones(2, vocab), references=refs)
    with pytest.raises(ValueError, match="embeddings contains NaN"):
        loss(embeddings=torch.full((2, 3, encoder.hidden_size), float("nan")), references=refs)
    with pytest.raises(ValueError, match=r"got logits, probs"):
        loss(logits=torch.zeros(2, 3, vocab), probs=torch.zeros(2, 3, vocab), references=refs)
    with pytest.raises(ValueError, match="on meta"):
        loss(logits=torch.zeros(2, 3, vocab, device="meta"), references=refs)
    with pytest.raises(ValueError, match="gumbel_temperature"):
        BERTScoreLoss(encoder=encoder, gumbel_temperature=0.0)
    with pytest.raises(TypeError, match="sinkhorn_iterations"):
        BERTScoreLoss(encoder=encoder, sinkhorn_iterations=1.5)


def test_decision_arguments_are_validated_by_name(encoder, plain_loss):
    """Each was accepted, or failed without naming the argument."""
    with pytest.raises(ValueError, match="weight must be a finite number >= 0"):
        hf.BERTScoreTerm(plain_loss, encoder.tokenizer, weight=math.nan)
    with pytest.raises(TypeError, match="ce_weight must be a number"):
        hf.BERTScoreTerm(plain_loss, encoder.tokenizer, ce_weight="1")
    with pytest.raises(TypeError, match="temperature must be a number"):
        Softmax("0.1")
    hidden, weight = head_for([2000], plain_loss.generator_vocab_size, width=8)
    fused = dict(hidden_states=hidden, output_embeddings=weight, references=["a"])
    with pytest.raises(TypeError, match="generator_temperature must be a number"):
        plain_loss(**fused, generator_temperature=True)
    with pytest.raises(TypeError, match="logit_softcap must be a number"):
        plain_loss(**fused, logit_softcap="30")
    with pytest.raises(TypeError, match="output_embeddings .* floating dtype"):
        plain_loss(**{**fused, "output_embeddings": weight.long()})
    with pytest.raises(TypeError, match="generator_tokenizer must be a Hugging Face tokenizer"):
        BERTScoreLoss(encoder=encoder, generator_tokenizer="gpt2")


# Hardening, round 4 (2026-11-28): what an audit of the loss's and the metric's inputs found.


def test_bad_target_ids_are_named_at_their_place_in_the_batch(plain_loss):
    """A target id outside the vocabulary is named ``[b, t]`` in ``target_ids`` (the fused
    pass named a row of its selection: ``target_ids[9]``, or ``[8]`` with padding)."""
    from bsloss.integrations.lm_head import token_cross_entropy

    vocab = plain_loss.generator_vocab_size
    hidden, weight = head_for([2000, 3000, 4000, 2000, 3000, 4000], vocab, width=8)
    hidden = hidden.expand(2, -1, -1)
    targets = torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(0))
    targets[0, 4:] = -100
    targets[1, 3] = vocab + 5
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, 4:] = False
    refs = ["a cat sat on the mat", "the dog ran"]
    where = re.escape(f"outside [0, {vocab}) (and not -100) at target_ids[1, 3]")
    for candidate_mask in (None, mask):
        with pytest.raises(ValueError, match=where):
            plain_loss.loss_and_cross_entropy(
                bsloss.LMHeadInputs(hidden, weight), targets, refs, candidate_mask=candidate_mask
            )
    with pytest.raises(ValueError, match=re.escape("at labels[1, 3]")):
        token_cross_entropy(targets, hidden_states=hidden, head=weight)
    # the functional pass on its own [N] rows still names its own index
    with pytest.raises(ValueError, match=re.escape("at target_ids[9]")):
        fused_token_log_likelihood(hidden.flatten(0, 1), weight, targets.flatten())


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_token_ids_of_any_integer_dtype_are_read_as_int64(plain_loss, dtype):
    """uint8 ids compared against the vocabulary size in uint8 (30,522 wraps to 58: a false
    "outside the vocabulary"), int8 / int16 ids failed in torch's indexing; every integer
    dtype now gives the int64 ids' values."""
    from bsloss.integrations.lm_head import token_cross_entropy

    ids = torch.tensor([[101, 1037, 4937, 102], [101, 1996, 3899, 102]])
    small = ids.clamp(max=127)  # within every dtype's range
    refs = ["a cat sat on the mat", "the dog ran"]
    logits = torch.randn(
        2, 4, plain_loss.generator_vocab_size, generator=torch.Generator().manual_seed(0)
    )
    torch.testing.assert_close(
        plain_loss(bsloss.TokenIds(small.to(dtype)), refs), plain_loss(bsloss.TokenIds(small), refs)
    )
    torch.testing.assert_close(
        plain_loss(logits, reference_ids=small.to(dtype)), plain_loss(logits, reference_ids=small)
    )
    vocab = plain_loss.generator_vocab_size
    hidden, weight = head_for([2000, 3000, 4000, 2000], vocab, width=8)
    hidden = hidden.expand(2, -1, -1)
    fused = [
        plain_loss.loss_and_cross_entropy(bsloss.LMHeadInputs(hidden, weight), targets, refs)
        for targets in (small.to(dtype), small)
    ]
    torch.testing.assert_close(fused[0].loss, fused[1].loss)
    torch.testing.assert_close(fused[0].cross_entropy, fused[1].cross_entropy)
    torch.testing.assert_close(
        token_cross_entropy(small.to(dtype), hidden_states=hidden, head=weight),
        token_cross_entropy(small, hidden_states=hidden, head=weight),
    )
    assert bsloss.TokenIds(small.to(dtype)).ids.dtype == torch.long


@pytest.mark.parametrize("matching", [Softmax, LogSumExp, Sinkhorn])
def test_a_matching_temperature_below_float32s_smallest_normal_is_refused(
    plain_loss, encoder, matching
):
    """At T = 1e-39 the similarities over T overflowed float32 and the loss was NaN; from
    float32's smallest normal number up it is finite, value and gradient."""
    with pytest.raises(ValueError, match="at least 1.18e-38 .*smallest normal"):
        matching(1e-39)
    with pytest.raises(ValueError, match="at least 1.18e-38"):
        BERTScoreLoss(encoder=encoder, matching=matching.name, temperature=1e-39)
    logits = torch.randn(2, 4, plain_loss.generator_vocab_size, requires_grad=True)
    loss = BERTScoreLoss(encoder=encoder, matching=matching(SMALLEST_TEMPERATURE))
    value = loss(logits, ["a cat sat on the mat", "the dog ran"])
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(logits.grad).all()


def test_logsumexp_warns_above_one_and_refuses_a_runaway_temperature(encoder, vocab):
    """LogSumExp's scores pass the hard ones by up to T log Lr: at T = 1e20 the loss was -inf,
    at 1e38 NaN. Above T = 1 it warns, above 1e6 it is refused, and at 1e6 it is finite."""
    with pytest.warns(UserWarning, match=r"above T = 1 its scores pass 1"):
        LogSumExp(2.0)
    with pytest.raises(ValueError, match=r"at most 1e\+06"):
        LogSumExp(1e7)
    with pytest.raises(ValueError, match=r"at most 1e\+06"):
        BERTScoreLoss(encoder=encoder, matching="logsumexp", temperature=1e20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LogSumExp(0.05), LogSumExp(1.0)  # the useful range: no warning
    with pytest.warns(UserWarning):
        loss = BERTScoreLoss(encoder=encoder, matching=LogSumExp(LARGEST_TEMPERATURE))
    assert torch.isfinite(loss(torch.randn(2, 4, vocab), ["a cat sat", "the dog ran"]))


def test_a_matching_that_returns_the_wrong_shapes_is_named(encoder, vocab):
    """A user's Matching returning a scalar broadcast into a wrong P/R (a loss of -1.44);
    one returning [B, Lc] twice failed deep in torch. Both are now named."""

    class Scalar(Matching):
        def __call__(self, sim, candidate_mask, reference_mask):
            return sim.sum(), sim.sum()

    class Transposed(Matching):
        def __call__(self, sim, candidate_mask, reference_mask):
            return sim.amax(-1), sim.amax(-1)

    logits = torch.randn(2, 4, vocab)
    for matching, got in ((Scalar(), r"\(\[\], \[\]\)"), (Transposed(), r"\(\[2, 6\], \[2, 6\]\)")):
        loss = BERTScoreLoss(encoder=encoder, matching=matching, reduction="none")
        with pytest.raises(ValueError, match=rf"{type(matching).__name__}\(\) returned {got}"):
            loss(logits, ["a cat sat on the mat", "the dog ran"])


def test_reference_mask_with_reference_texts_is_refused(plain_loss, vocab):
    """It was ignored: a wrong-shaped, all-False mask gave the value without one."""
    with pytest.raises(ValueError, match="reference_mask goes with reference_ids"):
        plain_loss(torch.randn(2, 4, vocab), ["a", "b"], reference_mask=torch.zeros(2, 1).bool())


def test_probabilities_without_mass_at_a_scored_position_are_named(plain_loss, vocab):
    """An all-zero row at a real position scored as a zero embedding of weight 0, silently;
    a negative entry was refused without its place."""
    probs = torch.randn(2, 4, vocab, generator=torch.Generator().manual_seed(0)).softmax(-1)
    refs = ["a cat sat on the mat", "the dog ran"]
    zero = probs.clone()
    zero[0, 1] = 0
    with pytest.raises(ValueError, match=re.escape("probs[0, 1] sums to 0 at a scored position")):
        plain_loss(bsloss.Probabilities(zero), refs)
    masked = torch.ones(2, 4, dtype=torch.bool)
    masked[0, 1] = False  # a padded position may hold anything
    torch.testing.assert_close(
        plain_loss(bsloss.Probabilities(zero), refs, candidate_mask=masked),
        plain_loss(bsloss.Probabilities(probs), refs, candidate_mask=masked),
    )
    negative = probs.clone()
    negative[1, 2, 7] = -0.5
    with pytest.raises(ValueError, match=re.escape("a negative entry at probs[1, 2]")):
        plain_loss(bsloss.Probabilities(negative), refs)


def test_bytes_are_not_texts(plain_loss, vocab, scorer):
    """A bytes reference was read as a list of ints ("references[0][0] must be a string, got
    int")."""
    logits = torch.randn(2, 4, vocab)
    with pytest.raises(
        TypeError, match=re.escape("references[0] must be a string or a list of strings, got bytes")
    ):
        plain_loss(logits, [b"a cat", "the dog"])
    with pytest.raises(TypeError, match="references must be a list .* got bytes"):
        plain_loss(logits, b"ab")
    with pytest.raises(TypeError, match="got bytes"):
        scorer.score([b"a cat"], ["a cat"])


def test_an_empty_reference_is_named_once(encoder, vocab):
    """An empty completion in the data scored F = 0 in training, silently (the metric warned
    for the same pair). The loss warns once, naming the candidates."""
    loss = BERTScoreLoss(encoder=encoder, reduction="none")
    logits = torch.randn(3, 4, vocab)
    with pytest.warns(
        UserWarning,
        match=re.escape(
            "2 of 3 candidates have only empty or whitespace-only references "
            "(references[0], references[2])"
        ),
    ):
        value = loss(logits, ["", "a cat", ["  ", ""]])
    assert value[0] == 1 and value[2] == 1 and value[1] < 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss(logits, ["", "a cat", "b"])  # warned once per loss
