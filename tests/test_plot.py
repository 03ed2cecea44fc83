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


def title_scores(figure) -> list[float]:
    import re

    title = figure.axes[0].get_title()
    return [float(re.search(rf"{name}=(-?[0-9.]+)", title).group(1)) for name in "PRF"]


def test_soft_heatmap_title_gives_the_soft_matchings_scores(scorer):
    """The shading is softmax(s / T): the title's P, R, F are the softmax matching's at T (the
    loss's soft score of the same token ids), not the hard ones."""
    import bsloss

    cand, ref = "A man with a hard hat is dancing.", "A man wearing a hard hat is dancing."
    soft_loss = bsloss.BERTScoreLoss(encoder=scorer.encoder, matching="softmax", temperature=0.5)
    ids = scorer.encoder.tokenizer([cand], return_tensors="pt")["input_ids"]
    expected = [x.item() for x in soft_loss.score(candidate_ids=ids, references=[ref])]
    hard = [x.item() for x in scorer.score([cand], [ref])]
    soft_title = title_scores(plot_example(cand, ref, scorer=scorer, temperature=0.5))
    assert soft_title == pytest.approx(expected, abs=1e-3)
    assert min(abs(h - s) for h, s in zip(hard, soft_title, strict=True)) > 0.01  # not the hard
    assert title_scores(plot_example(cand, ref, scorer=scorer)) == pytest.approx(hard, abs=1e-3)


def test_rc14_plot_temperature_zero(scorer):
    pytest.importorskip("matplotlib")
    from bsloss import plot_example

    for temperature in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            plot_example("a dog", "a cat", scorer=scorer, temperature=temperature)


@pytest.mark.parametrize(
    "cand, ref, name", [("", "a dog", "candidate"), ("a dog", "  ", "reference")]
)
def test_rc15_plot_empty_text(scorer, cand, ref, name):
    pytest.importorskip("matplotlib")
    from bsloss import plot_example

    with pytest.raises(ValueError, match=f"{name} has no token"):
        plot_example(cand, ref, scorer=scorer)
    with pytest.raises(TypeError, match="candidate must be a string"):
        plot_example(None, ref, scorer=scorer)
