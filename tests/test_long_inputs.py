"""long_inputs="window": texts longer than the model's maximum are scored whole."""

from __future__ import annotations

import warnings

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


def test_window_mode_leaves_short_texts_unchanged(scorer):
    cands, refs = ["a man plays the guitar"], ["someone is playing a guitar"]
    plain = torch.stack(scorer.score(cands, refs))
    windowed = torch.stack(
        bsloss.BERTScorer(encoder=scorer.encoder, long_inputs="window").score(cands, refs)
    )
    assert torch.equal(plain, windowed)
