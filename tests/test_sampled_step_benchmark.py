"""benchmarks/sampled_step.py in --tiny mode: its table has the CE step and each variant."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


def test_tiny_table_has_its_rows():
    from benchmarks import sampled_step

    table = sampled_step.main(["--tiny", "--steps", "1", "--variants", "full", "rows=2", "every=2"])
    rows = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")]
    assert rows == ["step", "ce", "full", "rows=2", "every=2"]
    ce = next(line for line in table.splitlines() if line.startswith("| ce |"))
    assert ce.split("|")[9].strip() == "1.00"  # the CE step against itself


def test_bad_variants_are_refused_before_the_model_loads():
    from benchmarks import sampled_step

    with pytest.raises(ValueError, match=r"SampledAnswers\(rows\)"):
        sampled_step.parse_args(["--variants", "rows=0"])
