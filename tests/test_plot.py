"""The pair heatmap (API and CLI)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("matplotlib")

from bsloss import plot_example  # noqa: E402
from bsloss.cli import main  # noqa: E402
from bsloss.plot import pair_similarity  # noqa: E402


def test_plot_example_marks_each_tokens_best_match(scorer, tmp_path):
    cand, ref = "A man with a hard hat is dancing.", "A man wearing a hard hat is dancing."
    sim, cand_tokens, ref_tokens = pair_similarity(scorer, cand, ref)
    assert sim.shape == (len(cand_tokens), len(ref_tokens)) == (9, 9)
    assert cand_tokens[:2] == ["a", "man"] and "[CLS]" not in cand_tokens
    fig = plot_example(cand, ref, scorer=scorer, fname=tmp_path / "pair.png")
    assert (tmp_path / "pair.png").stat().st_size > 10_000
    precision_marks = fig.axes[0].collections[0].get_offsets()
    assert torch.equal(torch.tensor(precision_marks[:, 0]).long(), sim.argmax(dim=1))
    soft = plot_example(cand, ref, scorer=scorer, temperature=0.05)
    assert "T=0.05" in soft.axes[0].get_title()


def test_plot_cli(tmp_path, capsys):
    out = tmp_path / "cli.png"
    main(["plot", "-c", "a cat sat", "-r", "the cat sits", "-o", str(out), "--progress", "off"])
    assert out.exists() and "wrote" in capsys.readouterr().out


def test_scorer_method_draws_the_same_pair(scorer, tmp_path):
    """``BERTScorer.plot_example`` (bert_score's method) marks the same best matches."""
    cand, ref = "a cat sat on the mat", "the cat sits on a mat"
    sim, _, _ = pair_similarity(scorer, cand, ref)
    fig = scorer.plot_example(cand, ref, fname=str(tmp_path / "method.png"))
    assert (tmp_path / "method.png").stat().st_size > 10_000
    marks = fig.axes[0].collections[0].get_offsets()
    assert torch.equal(torch.tensor(marks[:, 0]).long(), sim.argmax(dim=1))
