"""Issue 13: each of the 18 root causes found by trying bsloss as a demanding user and an
attacker would, and each decision taken, has a test here (named ``test_rcN_...`` and
``test_decision_...``). The CLI cases (root causes 11-13) are in the ``cli`` section."""

from __future__ import annotations

import re

import pytest
import torch
from _helpers import caught_warnings, long_text, one_hot, token_ids

from bsloss import BERTScoreLoss, BERTScorer

# ----------------------------------------------------------------------------- 1: caches


# ----------------------------------------------------------------------------- 2, 3, 4: numbers


# ------------------------------------------------------------------------- 5-8: loss input
def test_rc5_float64_logits(encoder, vocab):
    loss = BERTScoreLoss(encoder=encoder, reduction="none")
    torch.manual_seed(0)
    logits = torch.randn(2, 4, vocab, dtype=torch.float64, requires_grad=True)
    value = loss(logits=logits, references=["a dog runs", "a cat sleeps"])
    value.sum().backward()
    assert value.dtype == torch.float32 and torch.isfinite(value).all()
    assert logits.grad.dtype == torch.float64 and torch.isfinite(logits.grad).all()
    as_float32 = loss(logits=logits.detach().float(), references=["a dog runs", "a cat sleeps"])
    torch.testing.assert_close(value.detach(), as_float32, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["logits", "probs", "candidate_ids", "embeddings"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_rc6_empty_batch(encoder, vocab, kind, reduction):
    inputs = {
        "logits": torch.zeros(0, 3, vocab, requires_grad=True),
        "probs": torch.zeros(0, 3, vocab, requires_grad=True),
        "candidate_ids": torch.zeros(0, 3, dtype=torch.long),
        "embeddings": torch.zeros(0, 3, encoder.hidden_size, requires_grad=True),
    }
    loss = BERTScoreLoss(encoder=encoder, reduction=reduction)
    value = loss(**{kind: inputs[kind]}, references=[])
    assert value.shape == ((0,) if reduction == "none" else ())
    if reduction != "none":
        assert value.item() == 0.0
    if inputs[kind].requires_grad:
        value.sum().backward()
        assert inputs[kind].grad.shape == inputs[kind].shape
    prf = loss.score(**{kind: inputs[kind]}, reference_ids=torch.zeros(0, 2, dtype=torch.long))
    assert prf.f1.shape == (0,)


# ----------------------------------------------------------------------------- 9: inference mode
@pytest.mark.parametrize("cache_size", [0, 10])
def test_rc9_inference_mode_call_does_not_poison_training(encoder, vocab, cache_size):
    refs = ["a dog runs in the park", "a cat sleeps"]
    torch.manual_seed(0)
    logits = torch.randn(2, 4, vocab)
    poisoned = BERTScoreLoss(encoder=encoder, reference_cache_size=cache_size)
    with torch.inference_mode():
        poisoned(logits=logits, references=refs)  # as PyTorch Lightning validates
    fresh = BERTScoreLoss(encoder=encoder, reference_cache_size=cache_size)
    grads = []
    for loss in (poisoned, fresh):
        x = logits.clone().requires_grad_(True)
        loss(logits=x, references=refs).backward()
        grads.append(x.grad)
    assert torch.isfinite(grads[0]).all() and grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-7, rtol=1e-5)
    for hidden, ids in poisoned.reference_cache.values():
        assert not hidden.is_inference() and not ids.is_inference()


# ----------------------------------------------------------------------------- 10: reward input


# ----------------------------------------------------------------------------- 14, 15: plot


# ----------------------------------------------------------------------------- 16: long candidates
@pytest.mark.parametrize("kind", ["logits", "candidate_ids"])
def test_rc16_padding_past_the_scorer_maximum(encoder, vocab, kind):
    ids, mask = token_ids(encoder, ["a man is playing a guitar on the stage tonight"])
    length = ids.shape[1]
    padded_ids = torch.zeros(1, 600, dtype=torch.long)
    padded_ids[:, :length] = ids
    padded_mask = torch.zeros(1, 600, dtype=torch.bool)
    padded_mask[:, :length] = mask
    loss = BERTScoreLoss(encoder=encoder, matching="hard", reduction="none")
    refs = ["a man plays the guitar"]
    if kind == "logits":
        short, long = {"logits": one_hot(ids, vocab)}, {"logits": one_hot(padded_ids, vocab)}
    else:
        short, long = {"candidate_ids": ids}, {"candidate_ids": padded_ids}
    expected = loss(**short, candidate_mask=mask, references=refs)
    got = loss(**long, candidate_mask=padded_mask, references=refs)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_rc16_more_real_tokens_than_the_scorer_takes(encoder, vocab):
    loss = BERTScoreLoss(encoder=encoder, matching="hard", reduction="none")
    ids, mask = token_ids(encoder, [long_text(700), "a short one"])
    assert mask[0].sum() > encoder.max_length
    value, messages = caught_warnings(
        loss, candidate_ids=ids, candidate_mask=mask, references=["a river", "a short one"]
    )
    (message,) = [m for m in messages if "real tokens" in m]
    assert "1 of 2 candidates" in message and "candidate_ids[0]" in message
    limit = encoder.max_length - 2
    cut = loss(candidate_ids=ids[:1, :limit], references=["a river"])
    torch.testing.assert_close(value[0], cut[0], atol=1e-6, rtol=0)
    assert value[1].item() == pytest.approx(0.0, abs=1e-6)


# ----------------------------------------------------------------------------- 17: loss long refs
def test_rc17_truncation_warning_names_the_right_reference(encoder, vocab):
    loss = BERTScoreLoss(encoder=encoder)
    logits = torch.randn(3, 3, vocab)
    refs = ["a dog", ["a cat", long_text(600)], long_text(650)]
    _, messages = caught_warnings(loss, logits=logits, references=refs)
    (message,) = [m for m in messages if "longer than" in m]
    assert "references[1][1], references[2]" in message and "2 of 4 inputs" in message
    suggested = re.findall(r"\b(\w+)=", message)
    assert suggested == ["long_inputs"]
    # the same warning when the references come from the cache
    _, messages = caught_warnings(loss, logits=logits[:1], references=[long_text(650)])
    assert any("references[0]" in m for m in messages if "longer than" in m)


def test_rc17_loss_long_inputs_window_equals_the_metric(encoder, vocab):
    cands = ["the river ran past old stone houses", "a dog"]
    refs = [long_text(600), "a dog sleeps"]
    ids, mask = token_ids(encoder, cands)
    loss = BERTScoreLoss(encoder=encoder, matching="hard", long_inputs="window")
    (prf, messages) = caught_warnings(
        loss.score, logits=one_hot(ids, vocab), candidate_mask=mask, references=refs
    )
    assert not [m for m in messages if "longer than" in m]
    exact = BERTScorer(encoder=encoder, long_inputs="window").score(cands, refs)
    truncated = BERTScorer(encoder=encoder).score(cands, refs)
    for ours, want in zip(prf, exact, strict=True):
        torch.testing.assert_close(ours.detach(), want, atol=1e-5, rtol=0)
    assert (exact[1][0] - truncated[1][0]).abs() > 1e-4  # the windows made a difference
    with pytest.raises(ValueError, match="long_inputs"):
        BERTScoreLoss(encoder=encoder, long_inputs="chunk")


def test_rc17_long_reference_ids_are_refused_by_name(encoder, vocab):
    loss = BERTScoreLoss(encoder=encoder)
    ids = torch.full((2, 600), 2000)
    with pytest.raises(ValueError, match=r"reference_ids\[0\] has tokens past position 512"):
        loss(logits=torch.randn(2, 3, vocab), reference_ids=ids)
    # padding past the maximum is dropped
    mask = torch.zeros(2, 600, dtype=torch.bool)
    mask[:, :5] = True
    value = loss(logits=torch.randn(2, 3, vocab), reference_ids=ids, reference_mask=mask)
    assert torch.isfinite(value)


# ----------------------------------------------------------------------------- 18: surrogates


# ----------------------------------------------------------------------------- decisions


def test_decision_top_k_one_is_refused(encoder):
    with pytest.raises(ValueError, match="top_k=1 gives an exactly zero gradient"):
        BERTScoreLoss(encoder=encoder, top_k=1)
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        BERTScoreLoss(encoder=encoder, top_k=0)
    BERTScoreLoss(encoder=encoder, top_k=2)


def test_decision_scorer_stays_frozen_under_parent_requires_grad(vocab):
    from bsloss.scorer.encoder import ScorerEncoder

    parent = torch.nn.Module()
    parent.head = torch.nn.Linear(4, 4)
    parent.loss = BERTScoreLoss(encoder=ScorerEncoder.from_pretrained(None))
    parent.requires_grad_(True)
    logits = torch.randn(1, 3, vocab, requires_grad=True)
    _, messages = caught_warnings(parent.loss, logits=logits, references=["a dog"])
    assert any("frozen again" in m for m in messages)
    parent.loss(logits=logits, references=["a dog"]).backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert all(not p.requires_grad and p.grad is None for p in parent.loss.encoder.parameters())
    assert all(p.requires_grad for p in parent.head.parameters())


# ----------------------------------------------------------------------------- 11-13: CLI
