"""The reference cache (bsloss/scorer/reference_cache.py): least recently used out first, bounded in
entries and bytes, keyed on what changes an entry (autocast, long_inputs), and as the loss and
the scorer use it."""

from __future__ import annotations

import pytest
import torch
from _helpers import long_text

from bsloss import BERTScoreLoss, BERTScorer
from bsloss.integrations import huggingface as hf
from bsloss.scorer.reference_cache import DEFAULT_MAX_BYTES, ReferenceCache


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


def test_decision_caches_are_bounded_in_bytes_and_entries(encoder, monkeypatch):
    """The reference cache counted entries only (10,500 long references: +1.1 GB); decision:
    a byte bound too (``max_bytes``, 512 MiB by default), least recently used out first. The
    term's label -> text cache is bounded (``DECODED_CACHE_SIZE``)."""
    cache = ReferenceCache(max_size=100, max_bytes=3 * 10 * 8 * 4 + 3 * 10 * 8)
    assert ReferenceCache().max_bytes == DEFAULT_MAX_BYTES
    for i in range(5):  # each entry: [10, 8] float32 + [10] int64 = 400 bytes
        cache.store(f"t{i}", (torch.zeros(10, 8), torch.zeros(10, dtype=torch.long)), False, ())
        assert cache.nbytes <= cache.max_bytes
    assert list(cache) == ["t2", "t3", "t4"] and cache.nbytes == 1200
    cache.max_bytes = 400
    assert list(cache) == ["t4"]
    with pytest.raises(ValueError, match="max_bytes"):
        cache.max_bytes = -1
    loss = BERTScoreLoss(encoder=encoder)
    assert loss.reference_cache.max_bytes == DEFAULT_MAX_BYTES
    loss.reference_cache.max_bytes = 20_000  # ~30 MiniLM tokens
    loss(logits=torch.zeros(3, 2, 30522), references=["a cat sat on a mat"] * 2 + ["x " * 40])
    assert 0 < loss.reference_cache.nbytes <= 20_000
    monkeypatch.setattr(hf, "DECODED_CACHE_SIZE", 2)
    tokenizer = encoder.tokenizer
    term = hf.BERTScoreTerm(loss, tokenizer, causal=False)
    for i in range(5):
        term.references_from_labels(torch.tensor([[1000 + i, 1001 + i]]))
    assert len(term._decoded) == 2 and (1004, 1005) in term._decoded


def test_cached_references_follow_a_change_of_the_scorers_weights():
    """The cache was keyed on the device, dtypes, autocast and window mode, not on the weights:
    after load_state_dict of changed scorer weights (a fine-tuned scorer's, or
    ``loss.load_state_dict`` with ``encoder.*`` keys, which the loss takes) the metric scored
    the references' old embeddings (F [0.8800, 0.6124] instead of [0.8838, 0.6176]), and the
    loss too. An in-place change of any weight starts the cache over."""
    from bsloss.scorer.encoder import ScorerEncoder

    encoder = ScorerEncoder.from_pretrained(device="cpu")  # its own: the weights change here
    cands, refs = ["a cat sat on the mat", "the dog barked"], ["a cat is on it", "a dog barks"]
    metric = BERTScorer(encoder=encoder, reference_cache_size=100)
    loss = BERTScoreLoss(encoder, reduction="none", reference_cache_size=100)
    logits = torch.randn(2, 4, encoder.input_embeddings.num_embeddings)
    metric.score(cands, refs), loss(logits=logits, references=refs)  # cached
    changed = {
        name: value + 0.05 * torch.randn_like(value) if "query.weight" in name else value
        for name, value in encoder.state_dict().items()
    }
    before = {k: v.clone() for k, v in encoder.model.state_dict().items()}
    loss.load_state_dict({f"encoder.{k}": v for k, v in changed.items()}, strict=False)
    assert any(  # the loss took the scorer's weights
        not torch.equal(before[k], v) for k, v in encoder.model.state_dict().items()
    )
    cached_metric, cached_loss = metric.score(cands, refs)[2], loss(logits=logits, references=refs)
    metric.clear_cache(), loss.clear_cache()
    torch.testing.assert_close(cached_metric, metric.score(cands, refs)[2], rtol=0, atol=1e-6)
    torch.testing.assert_close(cached_loss, loss(logits=logits, references=refs), rtol=0, atol=1e-6)


def changed_embeddings(encoder) -> dict:
    """The scorer's state with its word embeddings moved (what the candidates are encoded
    from) and its queries too (what the references are encoded through)."""
    return {
        name: value + 0.05 * torch.randn_like(value)
        if "word_embeddings" in name or "query.weight" in name
        else value.clone()
        for name, value in encoder.model.state_dict().items()
    }


def test_the_candidate_table_follows_a_change_of_the_scorers_weights():
    """The loss's generator table (the scorer's input embeddings, with their weights) was
    built once per device, dtype and size: after ``loss.load_state_dict`` with ``encoder.*``
    keys that move the word embeddings, the loss encoded its candidates from the old table
    (0.186 where a fresh loss on the new weights gives 0.086), and only ``clear_cache()``
    fixed it."""
    from bsloss.scorer.encoder import ScorerEncoder

    encoder = ScorerEncoder.from_pretrained(device="cpu")  # its own: the weights change here
    refs = ["a cat is on it", "a dog barks"]
    loss = BERTScoreLoss(encoder, reduction="none")
    ids = encoder.tokenizer(["a cat sat on it", "the dog barked"], padding=True)["input_ids"]
    ids = torch.tensor(ids)  # [PAD] positions are not content: skipped
    logits = 8.0 * torch.nn.functional.one_hot(ids, encoder.input_embeddings.num_embeddings)
    loss(logits=logits.float(), references=refs)  # the table built
    torch.manual_seed(0)
    loss.load_state_dict(
        {f"encoder.model.{k}": v for k, v in changed_embeddings(encoder).items()}, strict=False
    )
    fresh = BERTScoreLoss(encoder, reduction="none")
    torch.testing.assert_close(
        loss(logits=logits.float(), references=refs),
        fresh(logits=logits.float(), references=refs),
        rtol=0,
        atol=1e-6,
    )


@pytest.mark.parametrize("into", ["model", "loss"])
def test_caches_follow_weights_loaded_as_new_parameters(into):
    """``load_state_dict(..., assign=True)`` (the way into a meta-initialised model) installs
    new parameter objects; the caches counted in-place changes of the old ones only: the
    metric then scored F 0.48 instead of 0.95, the loss 0.563 instead of 0.086, and the
    replaced weights stayed alive in the cache's list of parameters (86.6 MiB for MiniLM)."""
    import gc
    import weakref

    from bsloss.scorer.encoder import ScorerEncoder

    encoder = ScorerEncoder.from_pretrained(device="cpu")
    cands, refs = ["a cat sat on the mat", "the dog barked"], ["a cat is on it", "a dog barks"]
    metric = BERTScorer(encoder=encoder, reference_cache_size=100)
    loss = BERTScoreLoss(encoder, reduction="none", reference_cache_size=100)
    logits = torch.randn(2, 4, encoder.input_embeddings.num_embeddings)
    metric.score(cands, refs), loss(logits=logits, references=refs)  # cached
    old = weakref.ref(encoder.input_embeddings.weight)
    torch.manual_seed(0)
    state = changed_embeddings(encoder)
    if into == "model":
        encoder.model.load_state_dict(state, assign=True)
    else:
        loss.load_state_dict({f"encoder.model.{k}": v for k, v in state.items()}, assign=True)
    assert encoder.input_embeddings.weight is not old()  # new parameter objects
    cached_metric, cached_loss = metric.score(cands, refs)[2], loss(logits=logits, references=refs)
    metric.clear_cache(), loss.clear_cache()
    torch.testing.assert_close(cached_metric, metric.score(cands, refs)[2], rtol=0, atol=1e-6)
    torch.testing.assert_close(cached_loss, loss(logits=logits, references=refs), rtol=0, atol=1e-6)
    gc.collect()
    assert old() is None  # the replaced weights are not held
