"""The scorer package's pieces (bsloss/scorer/): tokenization of no texts, device names checked on
loading. (The reference cache: tests/test_reference_cache.py; BERTScorer: tests/test_metric.py.)"""

from __future__ import annotations

import pytest


def test_rc1_tokenising_nothing(encoder):
    assert encoder.tokenization.encode([]) == ([], [])


def test_device_names_are_checked(encoder):
    from bsloss.scorer.loading import resolve_device

    with pytest.raises(ValueError, match="'gpu' is not a torch device"):
        resolve_device("gpu")
    with pytest.raises(ValueError, match="cuda:99"):
        resolve_device("cuda:99")
