"""The reference cache (bsloss/scorer/reference_cache.py): least recently used out first, bounded in
entries and bytes, keyed on what changes an entry (autocast, long_inputs), and as the loss and
the scorer use it."""

from __future__ import annotations

import pytest
import torch
from _helpers import long_text

from bsloss import BERTScoreLoss, BERTScorer
from bsloss.scorer.reference_cache import ReferenceCache


def test_decision_loss_reference_cache_is_bounded_lru_and_clearable(encoder, vocab):
    loss = BERTScoreLoss(encoder=encoder, reference_cache_size=2)
    assert isinstance(loss.reference_cache, ReferenceCache)
    logits = torch.randn(1, 3, vocab)
    for ref in ("one", "two", "one", "three"):
        loss(logits=logits, references=[ref])
    assert list(loss.reference_cache) == ["one", "three"]  # "two" least recently used
    for hidden, ids in loss.reference_cache.values():
        assert hidden.untyped_storage().nbytes() == hidden.numel() * 4
        assert ids.untyped_storage().nbytes() == ids.numel() * 8
    loss.clear_cache()
    assert len(loss.reference_cache) == 0
    assert len(BERTScoreLoss(encoder=encoder).reference_cache) == 0
    assert BERTScoreLoss(encoder=encoder).reference_cache.max_size == 10_000
    with pytest.raises(ValueError, match="reference_cache_size"):
        BERTScoreLoss(encoder=encoder, reference_cache_size=-1)


def test_decision_cache_is_keyed_on_autocast_and_long_input_mode(encoder, vocab):
    loss = BERTScoreLoss(encoder=encoder)
    logits = torch.randn(1, 3, vocab)
    plain = loss(logits=logits, references=["a dog"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss(logits=logits, references=["a dog"])
    # the bf16 entry replaced the float32 one: the float32 call does not reuse it
    assert loss(logits=logits, references=["a dog"]) == plain
    scorer = BERTScorer(encoder=encoder, reference_cache_size=4)
    truncated = scorer.score(["a river"], [long_text(600)])
    scorer.long_inputs = "window"
    windowed = scorer.score(["a river"], [long_text(600)])
    whole = BERTScorer(encoder=encoder, long_inputs="window").score(["a river"], [long_text(600)])
    torch.testing.assert_close(windowed, whole)
    assert (windowed[1] - truncated[1]).abs() > 1e-4


def test_reference_cache_unit():
    cache = ReferenceCache(max_size=2)
    entry = (torch.zeros(2, 3), torch.tensor([1, 2]))
    for text in "abc":
        cache.store(text, entry, truncated=text == "c", variant=("v",))
    assert list(cache) == ["b", "c"] and cache.truncated("c") and not cache.truncated("b")
    assert list(cache.lookup(["b"], ("v",))) == ["b"] and list(cache) == ["c", "b"]
    cache.max_size = 1
    assert list(cache) == ["b"]
    assert cache.lookup(["b"], ("other",)) == {} and len(cache) == 0
    with pytest.raises(TypeError, match="reference_cache_size"):
        cache.max_size = None
