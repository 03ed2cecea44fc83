"""User idf weights ({token_id: weight}) reach the float32 tables without overflow or underflow."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from bsloss import BERTScoreLoss, BERTScorer
from bsloss.functional.idf import table_from_mapping

TEXT = "a cat sat on the mat"


@pytest.mark.parametrize(
    "weights, ratios",
    [
        ({2000: 1e39, 4937: 2.5e38}, {2000: 4.0, 4937: 1.0}),
        ({2000: 1e300, 4937: 2.5e299}, {2000: 4.0, 4937: 1.0}),
        ({2000: 4e-50, 4937: 1e-50}, {2000: 4.0, 4937: 1.0}),
        ({2000: 5e-324}, {2000: 1.0}),
        (defaultdict(lambda: 1e39, {4937: 2.5e38}), {2000: 4.0, 4937: 1.0}),
    ],
)
def test_weights_past_float32_keep_their_ratios(weights, ratios):
    """1e39 is finite in float64, where the weights were checked ("must be finite and >= 0"),
    and passed; in the float32 table it was inf (and 4e-50 was 0). The table is scaled by a
    power of two now: finite in float32, every ratio exact."""
    table = table_from_mapping(weights, 30522).float()
    assert torch.isfinite(table).all()
    largest = max(ratios.values())
    for token_id, ratio in ratios.items():
        assert table[token_id] / table.max() == ratio / largest
    assert 0.5 <= table.max() < 1  # the fill value (the largest) included


def test_usual_weights_are_kept_as_given():
    """Weights within 2^-100 .. 2^100 are not scaled: the table holds the user's numbers."""
    table = table_from_mapping({3: 7.5, 4: 1e-20, 5: 1e20}, 10, special_token_ids=[0])
    assert table[3] == 7.5 and table[4] == 1e-20 and table[5] == 1e20 and table[0] == 0


def test_the_loss_and_the_metric_score_huge_weights_as_their_ratios(encoder, vocab):
    """``BERTScoreLoss(idf={2000: 1e39})`` gave a NaN loss (inf / inf), the metric F 0: both
    score them now as the same ratios in ordinary numbers."""
    huge, plain = {2000: 1e39, 4937: 2.5e38}, {2000: 4.0, 4937: 1.0}
    logits = torch.randn(1, 3, vocab)
    value = BERTScoreLoss(encoder=encoder, idf=huge)(logits, [TEXT])
    assert torch.isfinite(value)
    torch.testing.assert_close(value, BERTScoreLoss(encoder=encoder, idf=plain)(logits, [TEXT]))
    metric = BERTScorer(encoder=encoder, idf=huge).score(["a cat"], [TEXT])
    expected = BERTScorer(encoder=encoder, idf=plain).score(["a cat"], [TEXT])
    torch.testing.assert_close(metric, expected)
    assert expected[2] > 0.3
