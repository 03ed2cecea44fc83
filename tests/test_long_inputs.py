"""long_inputs="window": texts longer than the model's maximum are scored whole."""

from __future__ import annotations

import warnings

import pytest
import torch
from _helpers import LONG_WORDS

import bsloss
from bsloss.scorer.inference import embed_windows

FIRST_TOPIC = [*LONG_WORDS, "and", "dog", "slept", "in", "warm", "afternoon", "sun"]
SECOND_TOPIC = [
    "astronomers",
    "measured",
    "distant",
    "galaxies",
    "using",
    "telescopes",
    "orbiting",
    "planets",
    "whose",
    "spectra",
    "revealed",
    "hydrogen",
    "clouds",
    "collapsing",
    "into",
    "young",
    "stars",
]


def _long_text() -> str:
    """About 1,100 tokens: river words for the first 600 words, astronomy words after."""
    words = [FIRST_TOPIC[i % len(FIRST_TOPIC)] for i in range(600)]
    words += [SECOND_TOPIC[i % len(SECOND_TOPIC)] for i in range(500)]
    return " ".join(w + ("." if i % 15 == 14 else "") for i, w in enumerate(words))


def test_text_of_twice_the_maximum_is_fully_covered(scorer):
    encoder = scorer.encoder
    text = _long_text()
    ids = encoder.tokenization.encode([text], truncate=False)[0][0]
    assert len(ids) >= 2 * encoder.max_length
    hidden = embed_windows(encoder, ids).detach()
    assert hidden.shape == (len(ids), encoder.hidden_size)
    assert torch.isfinite(hidden).all()
    # Every token has its own vector; tokens inside the first window equal a plain encoding.
    head = encoder(input_ids=torch.tensor([ids[: encoder.max_length - 1] + ids[-1:]]))[0]
    assert torch.allclose(hidden[1:100], head[1:100], atol=1e-4)

    windowed = bsloss.BERTScorer(encoder=encoder, long_inputs="window")
    tail = " ".join(text.split()[-40:])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no truncation warning in window mode
        p, r, f = windowed.score([tail], [text])
    truncating = bsloss.BERTScorer(encoder=encoder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p_t, r_t, f_t = truncating.score([tail], [text])
    assert any("long_inputs='window'" in str(w.message) for w in caught)
    # The candidate is the end of the document: after truncation its words are missing from the
    # reference, with windows they are found (precision rises).
    assert p.item() > p_t.item() + 0.02
    # Recall averages over all ~1,000 reference tokens in window mode, not only the first 512.
    assert r.item() != r_t.item()


def test_windows_go_to_the_device_without_a_wait(scorer):
    """Audit h19: each batch of windows went to the device by ``torch.tensor(..., device=)``,
    on CUDA a copy that waits for the card at every batch of the loop; now pinned and
    asynchronous, as the metric's other batches (no device tensor made from host data)."""
    from _helpers import HostReads

    encoder = scorer.encoder
    text = _long_text()
    ids = encoder.tokenization.encode([text], truncate=False)[0][0]
    with HostReads() as waits:
        embed_windows(encoder, ids)
    assert not [w for w in waits.where if "host data" in w], waits.where


def test_window_mode_leaves_short_texts_unchanged(scorer):
    cands, refs = ["a man plays the guitar"], ["someone is playing a guitar"]
    plain = torch.stack(scorer.score(cands, refs))
    windowed = torch.stack(
        bsloss.BERTScorer(encoder=scorer.encoder, long_inputs="window").score(cands, refs)
    )
    assert torch.equal(plain, windowed)


def test_windows_are_encoded_in_batches_bounded_by_batch_size(scorer, monkeypatch):
    """The windows of one long text go to the encoder ``token_budget_rows(max_length,
    batch_size)`` at a time, with the same vectors and scores as all at once.

    Before: every window of a text went in one encoder call whatever ``batch_size`` (a
    50k-token text at ``batch_size=1``: 197 windows of 512 tokens in one batch, peak RSS
    +1.6 GiB)."""
    from bsloss.scorer.batching import token_budget_rows

    encoder = scorer.encoder
    text = _long_text() + " " + _long_text()
    ids = encoder.tokenization.encode([text], truncate=False)[0][0]
    all_at_once = embed_windows(encoder, ids, batch_size=10**6)  # one call: the former way
    rows: list[int] = []
    encode = encoder.encode_without_grad

    def counting(input_ids, attention_mask):
        rows.append(input_ids.shape[0])
        return encode(input_ids, attention_mask)

    monkeypatch.setattr(encoder, "encode_without_grad", counting)
    with torch.inference_mode():
        for batch_size in (1, 8, 20):
            rows.clear()
            sliced = embed_windows(encoder, ids, batch_size=batch_size)
            bound = token_budget_rows(encoder.max_length, batch_size)  # 1, 2, 5 windows
            assert max(rows) <= bound < sum(rows) == 9
            assert (sliced - all_at_once).abs().max().item() < 1e-6
        cands, refs = [" ".join(text.split()[-40:]), "a river"], [text, text]
        expected = bsloss.BERTScorer(encoder=encoder, long_inputs="window", batch_size=10**6)
        bounded = bsloss.BERTScorer(encoder=encoder, long_inputs="window", batch_size=8)
        rows.clear()
        scores = torch.stack(bounded.score(cands, refs))
        assert max(rows) <= token_budget_rows(encoder.max_length, 8)
        assert (scores - torch.stack(expected.score(cands, refs))).abs().max().item() < 1e-6


def test_an_idf_list_is_counted_on_whole_texts_in_window_mode(scorer):
    """``idf=refs``, ``idf_sents=refs`` and ``compute_idf(refs)`` count the same whole texts as
    ``idf=True`` does in window mode: the same weights and scores, and no truncation warning.

    Before: a list was counted on texts truncated at 512 tokens even with
    ``long_inputs="window"`` (F 0.8204 against idf=True's 0.8443 on the audit's first pair),
    and the construction warned "pass long_inputs='window'" although it was passed."""
    text = _long_text()
    cands = [" ".join(text.split()[-40:]), "a quiet lake", " ".join(text.split()[:30])]
    refs = [text, "a dog by the quiet lake", " ".join(text.split()[-700:])]
    window = {"encoder": scorer.encoder, "long_inputs": "window"}
    expected = torch.stack(bsloss.BERTScorer(idf=True, **window).score(cands, refs))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no truncation warning: the texts are kept whole
        from_list = bsloss.BERTScorer(idf=refs, **window)
        from_sents = bsloss.BERTScorer(idf=True, idf_sents=refs, **window)
        computed = bsloss.BERTScorer(idf=True, **window)
        computed.compute_idf(refs)
        for idf_scorer in (from_list, from_sents, computed):
            scores = torch.stack(idf_scorer.score(cands, refs))
            assert (scores - expected).abs().max().item() < 1e-6
    with pytest.warns(UserWarning, match=r"truncated \(idf\[0\], idf\[2\]\)"):
        bsloss.BERTScorer(encoder=scorer.encoder, idf=refs)  # truncate mode: as before


def test_the_loss_counts_an_idf_list_on_whole_texts_in_window_mode(scorer):
    """The loss built its idf table from texts truncated at 512 tokens even with
    ``long_inputs="window"``, with a warning to pass ``long_inputs='window'`` that was passed:
    it counts the whole texts now, as the metric does in that mode (the same table)."""
    text = _long_text()
    refs = [text, "a dog by the quiet lake", " ".join(text.split()[-700:])]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = bsloss.BERTScoreLoss(scorer.encoder, idf=refs, long_inputs="window")
    metric = bsloss.BERTScorer(encoder=scorer.encoder, idf=refs, long_inputs="window")
    torch.testing.assert_close(loss.scorer_weights.cpu(), metric._weight_table.float().cpu())
