"""Round 9: the remaining flags of the public boundary are checked as bools (a truth test read
the string ``"false"`` as true: ``verbose="false"`` printed, ``distributed="no"`` split the
pairs), each named."""

from __future__ import annotations

import pytest

import bsloss
from bsloss.integrations.huggingface import bertscore_compute_metrics
from bsloss.metric import get_hash


@pytest.mark.parametrize("flag", ["use_fast_tokenizer", "compile", "distributed"])
def test_scorer_flags_are_bools(encoder, flag):
    with pytest.raises(TypeError, match=rf"{flag} must be a bool \(or 0, 1\), got 'false'"):
        bsloss.BERTScorer(encoder=encoder, **{flag: "false"})


@pytest.mark.parametrize("flag", ["verbose", "progress"])
def test_score_flags_are_bools(encoder, flag, capsys):
    scorer = bsloss.BERTScorer(encoder=encoder)
    with pytest.raises(TypeError, match=rf"{flag} must be a bool \(or 0, 1\), got 'false'"):
        scorer.score(["a cat"], ["the cat"], **{flag: "false"})
    assert "calculating scores" not in capsys.readouterr().out  # refused before it printed
    with pytest.raises(TypeError, match=r"progress must be a bool \(or 0, 1\), got 'no'"):
        scorer.embed(["a cat"], progress="no")
    # None (a bar only on a terminal), bools, numpy bools and 0 / 1 still pass
    for value in (None, False, 0):
        assert scorer.score(["a cat"], ["a cat"], progress=value)[2][0] > 0.99


def test_the_functional_score_checks_its_flags():
    for flag in ("verbose", "use_fast_tokenizer", "distributed", "progress"):
        with pytest.raises(TypeError, match=rf"{flag} must be a bool"):
            bsloss.score(["a cat"], ["the cat"], **{flag: "no"})


def test_get_hash_flags_are_bools():
    assert get_hash("roberta-large", 17, 0, True, False, False).startswith(
        "roberta-large_L17_no-idf"
    )
    for position, flag in enumerate(
        ("idf", "rescale_with_baseline", "use_custom_baseline", "use_fast_tokenizer")
    ):
        flags = [False] * 4
        flags[position] = "no"
        with pytest.raises(TypeError, match=rf"{flag} must be a bool"):
            get_hash("roberta-large", 17, *flags)


def test_compute_metrics_flags_are_bools(encoder):
    scorer = bsloss.BERTScorer(encoder=encoder)
    tokenizer = scorer.encoder.tokenizer
    with pytest.raises(TypeError, match=r"causal must be a bool"):
        bertscore_compute_metrics(tokenizer, scorer, causal="no")
    with pytest.raises(TypeError, match=r"teacher_forced must be a bool"):
        bertscore_compute_metrics(tokenizer, scorer, teacher_forced="no")
