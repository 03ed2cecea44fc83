"""Input validation at the public boundary (bsloss/inputs.py and the checks of the loss, the
scorer and the reward that use it): texts, references, ids, tensor types and arguments are named
when refused. (Bad input across the whole API: tests/test_bad_input.py.)"""

from __future__ import annotations

import math
import re

import pytest
import torch
from _helpers import head_for

from bsloss import BERTScoreLoss, BERTScorer, BERTScoreReward, Softmax
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
