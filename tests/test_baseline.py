"""The baselines (bsloss/baseline.py: reading a baseline file; bsloss/baseline_estimation.py:
computing one): malformed files and bad arguments are named."""

from __future__ import annotations

import re

import pytest

import bsloss
from bsloss import BERTScorer
from bsloss.baseline import read_baseline
from bsloss.baseline_estimation import compute_baseline


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "x"])
def test_rc4_baseline_with_a_non_finite_value(tmp_path, encoder, value):
    path = tmp_path / "baseline.tsv"
    rows = "".join(f"{layer},0.5,{value},0.5\n" for layer in range(7))
    path.write_text("LAYER,P,R,F\n" + rows)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}.*layer 6"):
        read_baseline(path, 6)
    with pytest.raises(ValueError, match="layer 6"):
        BERTScorer(encoder=encoder, rescale_with_baseline=True, baseline_path=str(path))


def test_decision_tab_separated_baseline(tmp_path, encoder):
    path = tmp_path / "baseline.tsv"
    path.write_text("LAYER\tP\tR\tF\n" + "".join(f"{i}\t0.5\t0.5\t0.5\n" for i in range(7)))
    with pytest.raises(ValueError, match=r"LAYER,P,R,F.*tab-separated"):
        read_baseline(path, 6)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_baseline(tmp_path / "missing.tsv", 6)
    with pytest.raises(FileNotFoundError, match="ships no baseline"):
        bsloss.baseline.load_baseline(None, "no-such/model", 3)


def test_compute_baseline_num_pairs(encoder):
    with pytest.raises(ValueError, match="num_pairs must be >= 1"):
        compute_baseline(["a b", "c d"], num_pairs=0)
